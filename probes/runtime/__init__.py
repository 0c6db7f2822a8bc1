"""The probe runtime: what probes use to reach the host safely.

- `host`: `Host`, the one object a probe reaches the host through (`ctx.host`).
- `paths`: where the host's /proc, /sys, /dev and root are (`HostPaths`, the `host:` section's first keys),
  and host paths joined under them without `..` climbing out.
- `commands`: host commands with a hard deadline and a cap on their output.
- `children`: filesystem calls in forked children with a deadline, at most one in flight per key.
- `cpulimit`: the container's CPU limit and throttling counters, and the `work` cgroup every child of the
  probes joins between fork and exec, so their use never throttles the agent's HTTP loop.
- `procfs`: /proc reading (process info, cgroup → pod classification, device numbers); `procstat`: the one
  /proc/PID/stat parser.
- `fdscan`: the /proc/*/fd scan, in forked scanners that a hung filesystem cannot block; `fdtable`: what a
  scanner reads, one process's fd table after another; `mapscan`: the device nodes a process has mapped.
- `holders`: who holds a device node or port, in which pod, and how to stop it (npu, gpu, ports).
- `pyspy`: py-spy stack dumps and their classification (FileBaton wait, lock wait, idle loop, ...).
- `resolver`: name resolution against the host's or the pod's resolver, from plain values (`dnsquery`: one
  name looked up nameserver after nameserver as the C library would); `parallel`: the
  independent checks of one probe run in threads, under its deadline.
- `addresses`: host:port parsing shared by config models; `inventory`: which accelerator is on which PCI
  function.
- `podresources/`: the kubelet's PodResources API (the device plugins' ledger) and the node's pods.

Nothing here knows of findings, HTTP or Kubernetes (nothing imports `probes.base`), and nothing imports `agent`.
"""
