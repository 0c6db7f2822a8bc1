"""Config of the host family (`host:`): where the host's filesystems are, host memory and /dev/shm.

The first four keys (proc, sys, dev, root) are the probe runtime's `HostPaths`, which every family uses
through `ctx.host`; they stay in this section, where operators have always written them.
"""

from __future__ import annotations

from pydantic import Field

from probes.family import Percent, Section
from probes.runtime.paths import HostPaths


class HostMemoryConfig(Section):
    min_available_mib: float = Field(2048, ge=0)
    min_available_percent: Percent = 5.0
    # Free hugepages (of the default size) below this → HostMemoryLow; 0 disables the hugepage check.
    min_free_hugepages: int = Field(0, ge=0)


class HostShmConfig(Section):
    path: str = "/dev/shm"
    min_size_mib: float = Field(1024, ge=0)
    min_free_mib: float = Field(512, ge=0)


class HostConfig(HostPaths, Section):
    memory: HostMemoryConfig = HostMemoryConfig()
    shm: HostShmConfig = HostShmConfig()
