"""Storage: space, expected mounts, write probes as the job's uid, stale locks, model caches."""

from __future__ import annotations

from probes.family import Family, register_family
from probes.storage.config import StorageConfig

FAMILY = register_family(
    Family(
        key="storage", module=__name__, config=StorageConfig, title="Storage", doc="docs/probes/storage.md", order=50
    )
)
