"""storage.locks: the reasons, the lock files a walk found, how each is judged, and the findings.

A group is one walked glob: a host glob (its subject is the glob), or one container's glob (each stale lock
there is its own subject, `<pod/container>: <path as the container sees it>`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from probes.base import Check, Event, Finding, Reason, Status
from probes.storage.common import safe_text
from probes.storage.containers import MountNamespace
from probes.storage.mounttable import MountEntry, fstype_matches, mount_containing

LOCKS = Check("storage.locks")
STALE_FILE_BATON = Reason(
    "StaleFileBaton",
    Status.FAIL,
    "a node-local lock file (on the host or inside a container) older than stale_lock_age_seconds that no "
    "process on this node holds",
    "every job that builds or loads this torch extension (or model) waits on it forever: remove the file the "
    "finding names (rm <its path>) or set storage.remove_stale_locks: true",
)
STALE_LOCK_SHARED = Reason(
    "StaleLockShared",
    Status.WARN,
    "the same on a shared filesystem (storage.shared_fstypes), where a holder on another node is invisible",
    "a holder on another node is invisible from here: check that no job on any node is building or "
    "downloading into it (lsof/fuser there), then remove the file",
)
STALE_LOCK_REMOVED = Reason(
    "StaleLockRemoved",
    Status.WARN,
    "the agent removed stale node-local lock files this run (storage.remove_stale_locks)",
    "nothing to do; jobs that waited on it proceed. Frequent removals mean jobs get killed while building extensions",
)
LOCK_SCAN_FAILED = Reason(
    "LockScanFailed",
    Status.UNKNOWN,
    "old lock files were found but the scan of open files (/proc/*/fd) timed out or failed, or containers "
    "could not be told from the host",
    "a hung filesystem can stall the /proc/*/fd scan: check storage.mounts; the agent needs hostPID and CAP_SYS_PTRACE",
)
LOCK_SCAN_INCOMPLETE = Reason(
    "LockScanIncomplete",
    Status.UNKNOWN,
    "a lock walk ran out of its budget (lock_walk_max_entries, or its share of locks_timeout_seconds), or more "
    "containers ran than container_lock_max_namespaces: locks beyond that point were not looked at",
    "a lock directory with this many entries is not a lock cache: clean it up, narrow storage.lock_globs / "
    "container_lock_globs, or raise lock_walk_max_entries / container_lock_max_namespaces",
)


@dataclass
class LockFile:
    path: str  # as its mount namespace sees it (the host's for host globs)
    rel: str  # below the removal root (a host glob's root, or a container's /)
    mode: int
    dev: int
    ino: int
    size: int
    mtime: float
    mtime_ns: int
    style: str  # baton, soft, flock; "" when not a regular file
    fstype: str = ""
    shared: bool = False  # on a filesystem where a holder may sit on another node (set when judged)
    not_removed: str = ""

    @property
    def regular(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def inode_key(self) -> tuple[int, int]:
        return (self.dev, self.ino)

    @property
    def proc_locks_key(self) -> tuple[int, int, int]:
        return (os.major(self.dev), os.minor(self.dev), self.ino)

    def age(self, now: float) -> int:
        return round(max(0.0, now - self.mtime))

    def brief(self, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "age_seconds": self.age(now), "ino": self.ino, "style": self.style}
        if self.fstype:
            out["fstype"] = self.fstype
        if self.not_removed:
            out["not_removed"] = self.not_removed
        return out


@dataclass
class Group:
    """One walked glob and its verdict."""

    glob: str
    root: str  # the glob's non-wildcard root on the host, or "/" in a container
    namespace: MountNamespace | None  # None: the host
    files: list[LockFile]
    walk: Mapping[str, Any]  # symlinked_dirs, unreadable_dirs, truncated, incomplete, at
    stale_local: list[LockFile] = field(default_factory=list)
    stale_shared: list[LockFile] = field(default_factory=list)
    removed: list[LockFile] = field(default_factory=list)
    locked: list[LockFile] = field(default_factory=list)  # flock-style files /proc/locks shows locked
    # Old flock-style files that nothing locks nor holds open: harmless, unless a process polls one (an empty
    # SoftFileLock left by filelock <= 3.13): storage.locks then looks for pollers.
    unclaimed: list[LockFile] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    needs_scan: bool = False

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    @property
    def incomplete(self) -> str:
        return str(self.walk.get("incomplete") or "")


def lock_files(values: Sequence[tuple[Any, ...]], prefix: str) -> list[LockFile]:
    """Walk results (rel, mode, dev, ino, size, mtime, mtime_ns, style) → lock files named below `prefix`."""
    return [
        LockFile(os.path.join(prefix, rel), rel, mode, dev, ino, size, mtime, mtime_ns, style)
        for rel, mode, dev, ino, size, mtime, mtime_ns, style in values
    ]


def is_candidate(lock: LockFile, now: float, stale_age: float) -> bool:
    """An existence-style lock old enough to be stale: only those need the (costly) scan of open files."""
    return lock.regular and lock.style in ("baton", "soft") and now - lock.mtime >= stale_age


@dataclass(frozen=True)
class Evidence:
    """What the judgement of every group rests on: /proc/locks, the open-files scan, the config."""

    locked: Collection[tuple[int, int, int]]
    waiting: Collection[tuple[int, int, int]]
    holders: Mapping[tuple[int, int], list[int]]
    scan_error: str
    now: float
    stale_age: float
    shared_fstypes: Sequence[str]
    # Whether the open-files scan covered the old unlocked flock-style files too (done while a process polls).
    unclaimed_scanned: bool = False


def judge(group: Group, evidence: Evidence, table: Sequence[MountEntry] | None) -> None:
    """Sort a group's files into held, young, flock-style and stale (node-local or shared)."""
    for lock in group.files:
        if not lock.regular:
            group.count("not_regular")  # a symlink named like a lock is never followed nor judged
            continue
        if lock.style == "flock":
            judge_flock_style(group, lock, evidence, table)
            continue
        if not is_candidate(lock, evidence.now, evidence.stale_age):
            group.count("young")
            continue
        if evidence.scan_error:
            group.needs_scan = True
            continue
        if evidence.holders.get(lock.inode_key):
            group.count("held")
            continue
        (group.stale_shared if on_shared_filesystem(lock, evidence, table) else group.stale_local).append(lock)


def judge_flock_style(group: Group, lock: LockFile, evidence: Evidence, table: Sequence[MountEntry] | None) -> None:
    """A flock-style file means nothing once its holder is gone: /proc/locks tells whether it is locked. An old
    unlocked one that no process holds open is kept as unclaimed (an empty SoftFileLock looks the same)."""
    locked = lock.proc_locks_key in evidence.locked
    group.count("flock_locked" if locked else "flock_unlocked")
    if lock.proc_locks_key in evidence.waiting:
        group.count("flock_waiters")
    if locked:
        group.locked.append(lock)
        return
    old = evidence.now - lock.mtime >= evidence.stale_age
    if old and evidence.unclaimed_scanned and not evidence.scan_error and not evidence.holders.get(lock.inode_key):
        on_shared_filesystem(lock, evidence, table)
        group.unclaimed.append(lock)


def is_unclaimed_candidate(lock: LockFile, locked: Collection[tuple[int, int, int]], now: float, age: float) -> bool:
    """An old, regular, flock-style file /proc/locks does not show locked: worth the open-files scan while a
    process polls."""
    return lock.regular and lock.style == "flock" and lock.proc_locks_key not in locked and now - lock.mtime >= age


def on_shared_filesystem(lock: LockFile, evidence: Evidence, table: Sequence[MountEntry] | None) -> bool:
    """Whether the lock lies on a filesystem where a holder may sit on another node (or an unknown one); sets
    the lock's fstype."""
    mount = mount_containing(table, lock.path, lock.dev) if table else None
    lock.fstype = mount.fstype if mount else "unknown"
    lock.shared = mount is None or fstype_matches(mount.fstype, evidence.shared_fstypes)
    return lock.shared


def path_list(locks: Sequence[LockFile], limit: int = 3) -> str:
    shown = ", ".join(safe_text(lock.path) for lock in locks[:limit])
    return shown + (f" and {len(locks) - limit} more" if len(locks) > limit else "")


def group_observed(group: Group, now: float, unreadable: int) -> dict[str, Any]:
    observed: dict[str, Any] = {
        key: group.counts.get(key, 0)
        for key in ("held", "young", "flock_locked", "flock_waiters", "flock_unlocked", "not_regular")
    }
    observed.update(
        {
            "stale_local": [lock.brief(now) for lock in group.stale_local[:20]],
            "stale_shared": [lock.brief(now) for lock in group.stale_shared[:20]],
            "removed": [lock.brief(now) for lock in group.removed[:20]],
            "unreadable_processes": unreadable,
            "symlinked_dirs": group.walk.get("symlinked_dirs", 0),
            "unreadable_dirs": group.walk.get("unreadable_dirs", 0),
        }
    )
    if group.incomplete:
        observed["incomplete"] = {"why": group.incomplete, "at": safe_text(str(group.walk.get("at", "")))}
    return observed


def incomplete_text(group: Group) -> str:
    at = safe_text(str(group.walk.get("at") or ""))
    return f"the walk {group.incomplete}" + (f", at {at}" if at else "")


def host_group_finding(group: Group, evidence: Evidence, unreadable: int) -> Finding:
    """The one finding of a host glob."""
    age, now, subject = evidence.stale_age, evidence.now, group.glob
    observed = group_observed(group, now, unreadable)
    partial = f" ({incomplete_text(group)})" if group.incomplete else ""
    if group.stale_local:
        message = (
            f"{len(group.stale_local)} stale lock(s) with no holder on this node, older than {age:g}s: "
            f"{path_list(group.stale_local)}{partial}"
        )
        removal = "; ".join(f"rm {safe_text(lock.path)}" for lock in group.stale_local[:3])
        more = (
            f" and the {len(group.stale_local) - 3} more in observed.stale_local" if len(group.stale_local) > 3 else ""
        )
        hint = (
            "every job that builds or loads this torch extension (or model) waits on it forever: remove it "
            f"({removal}{more}) or set storage.remove_stale_locks: true"
        )
        return LOCKS.report(STALE_FILE_BATON, subject, message, observed, hint=hint)
    if group.removed:
        # The reconciler turns the event into a Kubernetes event on the Node: a deletion is always told.
        message = f"removed {len(group.removed)} stale node-local lock(s): {path_list(group.removed)}{partial}"
        event = Event("StaleLockRemoved", f"removed {path_list(group.removed)}")
        return LOCKS.report(STALE_LOCK_REMOVED, subject, message, observed, event=event)
    if group.needs_scan:
        message = f"old lock files found but the scan of open files failed: {evidence.scan_error}"
        return LOCKS.report(LOCK_SCAN_FAILED, subject, message, observed)
    if group.incomplete:
        message = f"lock files not all looked at: {incomplete_text(group)}"
        return LOCKS.report(LOCK_SCAN_INCOMPLETE, subject, message, observed)
    if group.stale_shared:
        message = (
            f"{len(group.stale_shared)} lock(s) on a shared filesystem older than {age:g}s with no holder "
            f"on this node: {path_list(group.stale_shared)}"
        )
        return LOCKS.report(STALE_LOCK_SHARED, subject, message, observed)
    counts = group.counts
    message = (
        f"no stale locks ({counts.get('held', 0)} held, {counts.get('young', 0)} recent, "
        f"{counts.get('flock_locked', 0)} flock-locked, {counts.get('flock_unlocked', 0)} unlocked flock files)"
    )
    if counts.get("own_subject"):
        message = f"{counts['own_subject']} lock(s) reported under their own subject; otherwise {message}"
    return LOCKS.ok(subject, message, observed)


def container_lock_subject(namespace: MountNamespace, lock: LockFile) -> str:
    return f"{namespace.label}: {safe_text(lock.path)}"


def host_side_path(proc: str, namespace: MountNamespace, lock: LockFile) -> str:
    """Where the container's lock is reached from the host: through one of its processes' root."""
    return f"{proc}/{namespace.pid}/root{lock.path}"


def container_lock_findings(group: Group, evidence: Evidence, proc: str) -> list[Finding]:
    """One finding per stale (or removed) lock inside a container, naming the pod and both paths."""
    namespace = group.namespace
    assert namespace is not None
    out = []
    for lock, reason in (
        *((lock, STALE_FILE_BATON) for lock in group.stale_local),
        *((lock, STALE_LOCK_SHARED) for lock in group.stale_shared),
        *((lock, STALE_LOCK_REMOVED) for lock in group.removed),
    ):
        host_path = host_side_path(proc, namespace, lock)
        shown, where = safe_text(lock.path), namespace.describe()
        observed = {**lock.brief(evidence.now), "host_path": host_path, "glob": group.glob, **namespace.observed()}
        if reason is STALE_LOCK_REMOVED:
            message = f"removed stale lock {shown} inside {where} (host side {safe_text(host_path)})"
            event = Event("StaleLockRemoved", f"removed {shown} inside {where}")
            out.append(LOCKS.report(reason, container_lock_subject(namespace, lock), message, observed, event=event))
            continue
        holder = "on this node" if reason is STALE_FILE_BATON else "on this node (shared filesystem)"
        message = (
            f"stale lock {shown} inside {where}, {lock.age(evidence.now)}s old, no holder {holder}; "
            f"host side {safe_text(host_path)}" + (f"; not removed: {lock.not_removed}" if lock.not_removed else "")
        )
        hint = (
            f"every job in this container that builds or loads the extension waits on it forever: remove it "
            f"({namespace.command_inside('rm ' + shown)}, or on the node rm {safe_text(host_path)}), or set "
            "storage.remove_stale_locks: true"
            if reason is STALE_FILE_BATON
            else None
        )
        out.append(LOCKS.report(reason, container_lock_subject(namespace, lock), message, observed, hint=hint))
    return out
