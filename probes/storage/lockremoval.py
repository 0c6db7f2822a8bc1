"""Removing stale node-local locks (storage.remove_stale_locks), on the host and inside containers.

Each removal runs in a child: every directory below the root is opened with O_NOFOLLOW, the file is
re-checked (still a regular file with the inode and mtime it was judged with) just before unlinkat, and a
container's lock is removed only while the process it is reached through is still in that container's mount
namespace. Every removal is logged with the path escaped, and evented through the finding.
"""

from __future__ import annotations

import logging
import time

from probes.base import ProbeContext
from probes.storage.common import ChildCall, run_child_call, safe_text
from probes.storage.lockfiles import remove_container_lock_in_child, remove_lock_if_unchanged
from probes.storage.lockfindings import Group, LockFile

log = logging.getLogger(__name__)


def _removal_call(ctx: ProbeContext, group: Group, lock: LockFile, timeout: float) -> ChildCall:
    if group.namespace is None:
        root = str(ctx.host.root_path(group.root))
        host_args: tuple[object, ...] = (root, lock.rel, lock.dev, lock.ino, lock.mtime_ns)
        return ChildCall(f"locks-remove:{group.glob}", remove_lock_if_unchanged, host_args, timeout)
    ns = group.namespace
    ns_args: tuple[object, ...] = (
        str(ctx.host.proc),
        ns.pid,
        ns.namespace,
        lock.rel,
        lock.dev,
        lock.ino,
        lock.mtime_ns,
    )
    return ChildCall(f"locks-remove:{ns.namespace}", remove_container_lock_in_child, ns_args, timeout)


def remove_stale(ctx: ProbeContext, group: Group, timeout: float) -> int:
    """Remove the group's stale node-local locks; those removed move to `group.removed`, the others stay in
    `group.stale_local` with why (`not_removed`). Returns how many were removed."""
    kept: list[LockFile] = []
    where = f" inside {group.namespace.describe()}" if group.namespace else ""
    for lock in group.stale_local:
        result = run_child_call(ctx, _removal_call(ctx, group, lock, timeout))
        outcome = result.value if result.ok else f"failed: {result.error or result.state}"
        if outcome == "removed":
            log.warning(
                "removed stale lock %s%s (age %ss, inode %s, no holder on this node)",
                safe_text(lock.path),
                where,
                lock.age(time.time()),
                lock.ino,
            )
            group.removed.append(lock)
        else:
            log.warning("did not remove stale lock %s%s: %s", safe_text(lock.path), where, safe_text(outcome))
            lock.not_removed = outcome
            kept.append(lock)
    group.stale_local = kept
    return len(group.removed)
