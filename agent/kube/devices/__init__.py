"""The devices wing: one bad chip costs one chip.

- `match`: which device a finding is about, and which device of the cluster's ResourceSlices that is (pure).
- `isolation`: which mechanism isolates each bad device, and what that leaves for the Node to carry (pure).
- `isolator`: applies it: DeviceTaintRules and public faults, the node taint where nothing finer applies.
- `seats`: the isolator's device budget slots: who holds one, and what becomes of a device without one.
- `acting`: whether the cluster acts on DeviceTaintRules (the device-taint-eviction controller's status on them).
- `dra`: resource.k8s.io on the API side: the version serving DeviceTaintRules, ResourceSlices, the agent's rules
  (a 409 re-read and retried within the pass).
- `publicfault`: MindCluster ClusterD public faults in the agent's own ConfigMap.
- `budget`: the device budget (at most `max_unhealthy_devices` of the fleet's accelerators isolated at once).
- `report`: the device isolation's part of /status, and its metrics.
- `cleanup`: `node-health cleanup` for devices: the agents' rules, public faults and device slots.
"""
