"""host.memory and host.shm: host memory for pinned buffers and hugepages, and /dev/shm.

Its config section also says where the host's /proc, /sys, /dev and root are.

- `host`: the probe (host.memory, host.shm); `config`: the `host:` section, where the host's filesystems are.
"""

from __future__ import annotations

from probes.family import Family, register_family
from probes.host.config import HostConfig

FAMILY = register_family(
    Family(key="host", module=__name__, config=HostConfig, title="Host", doc="docs/probes/host.md", order=10)
)
