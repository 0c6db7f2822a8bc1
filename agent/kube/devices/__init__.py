"""The devices wing: one bad chip costs one chip.

- `match`: which device a finding is about, and which device of the cluster's ResourceSlices that is (pure).
- `isolation`: which mechanism isolates each bad device, and what that leaves for the Node to carry (pure).
- `isolator`: applies it: DeviceTaintRules and public faults, the node taint where nothing finer applies.
- `dra`: resource.k8s.io on the API side: the version serving DeviceTaintRules, ResourceSlices, the agent's rules.
- `publicfault`: MindCluster ClusterD public faults in the agent's own ConfigMap.
- `budget`: the device budget (at most `max_unhealthy_devices` of the fleet's accelerators isolated at once).
- `report`: the device isolation's part of /status, and its metrics.
- `cleanup`: `node-health cleanup` for devices: the agents' rules, public faults and device slots.
"""
