"""The probe runtime: what probes use to reach the host safely.

- `host`: where the host's /proc, /sys, /dev and root are; host commands with a hard deadline; filesystem
  calls in forked children with a deadline.
- `procfs`: /proc scanning (open files by device number, cgroup → pod classification).
- `fdscan`: the /proc/*/fd scan itself, in forked scanners that a hung filesystem cannot block.
- `holders`: who holds a device node or port, in which pod, and how to stop it (npu, gpu, ports).
- `pyspy`: py-spy stack dumps and their classification (FileBaton wait, lock wait, idle loop, ...).
- `addresses`: host:port parsing shared by config models.

Nothing here knows of findings, HTTP or Kubernetes, and nothing here imports `agent`.
"""
