"""Config of the host family (`host:`): where the host's filesystems are, host memory and /dev/shm."""

from __future__ import annotations

from pydantic import Field

from probes.base import Percent, Section


class HostMemoryConfig(Section):
    min_available_mib: float = Field(2048, ge=0)
    min_available_percent: Percent = 5.0
    # Free hugepages (of the default size) below this → HostMemoryLow; 0 disables the hugepage check.
    min_free_hugepages: int = Field(0, ge=0)


class HostShmConfig(Section):
    path: str = "/dev/shm"
    min_size_mib: float = Field(1024, ge=0)
    min_free_mib: float = Field(512, ge=0)


class HostConfig(Section):
    proc: str = "/proc"
    sys: str = "/sys"
    dev: str = "/dev"
    root: str = "/"
    memory: HostMemoryConfig = HostMemoryConfig()
    shm: HostShmConfig = HostShmConfig()
