"""Storage: space, expected mounts, write probes as the job's uid, stale locks, model caches.

- `space`, `mounts`, `write`, `locks`, `model_cache`: the probes storage.space, storage.mounts, storage.write,
  storage.locks, storage.model_cache; `config`: the `storage:` section.
- `common`: what the probes share (a hung or failed filesystem call, child calls side by side, helpers);
  `mounttable`: /proc/PID/mountinfo and which mount a path is on; `quota`: which quota an EDQUOT came from.
- storage.locks' parts: `lockwalk` (the globs walked in a child), `lockfiles` (/proc/locks, lock styles,
  removing one), `lockfindings` (the judgements), `lockleftovers` (filelock's leftovers), `lockremoval`
  (removing stale locks), `containers` (containers' own filesystems), `waiters` (who waits on a lock).
"""

from __future__ import annotations

from probes.family import Family, register_family
from probes.storage.config import StorageConfig

FAMILY = register_family(
    Family(
        key="storage", module=__name__, config=StorageConfig, title="Storage", doc="docs/probes/storage.md", order=50
    )
)
