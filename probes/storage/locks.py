"""storage.locks: stale torch FileBaton / SoftFileLock files with no holder on this node, on the host and
inside containers' own filesystems; the processes waiting on them; safe removal.

One run: walk every host glob, and every container's globs (one child per mount namespace), side by side
within the probe's deadline → /proc/locks and one scan of every /proc/*/fd for the old existence-style
locks → judge → remove (when asked) → name the waiters (py-spy) → findings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from probes.base import Finding, Probe, ProbeContext, ProbeOutput, ProbeParseError, Sample, register
from probes.runtime.children import ChildResult
from probes.runtime.procfs import ScanError, scan_open_files
from probes.storage.common import (
    CHILD_REASONS,
    MAX_PARALLEL_CHILDREN,
    ChildCall,
    child_error_finding,
    item_timeout,
    path_failure_finding,
    reserve_seconds,
    run_child_calls,
)
from probes.storage.config import StorageConfig
from probes.storage.containers import MountNamespace, NamespaceCensus, container_namespaces
from probes.storage.lockfiles import LockRecord, parse_proc_locks, split_glob
from probes.storage.lockfindings import (
    LOCK_SCAN_FAILED,
    LOCK_SCAN_INCOMPLETE,
    LOCKS,
    STALE_FILE_BATON,
    STALE_LOCK_REMOVED,
    STALE_LOCK_SHARED,
    Evidence,
    Group,
    container_lock_findings,
    container_lock_subject,
    host_group_finding,
    incomplete_text,
    is_candidate,
    is_unclaimed_candidate,
    judge,
    lock_files,
)
from probes.storage.lockleftovers import (
    LEFTOVER_REASONS,
    HolderWatch,
    HungLock,
    holders_of,
    leftover_findings,
    removal,
)
from probes.storage.lockremoval import remove_stale
from probes.storage.lockwalk import SOFT_SHARE, WalkPlan, glob_parts, walk_in_child, walk_namespace_in_child
from probes.storage.mounttable import MountEntry, read_mount_table
from probes.storage.waiters import (
    LOCK_WAITER_CHECK_UNAVAILABLE,
    POLLING_WINDOW,
    PROCESS_WAITING_ON_FILE_BATON,
    SLOW_POLLING_WINDOW,
    StaleLock,
    lock_waiter_candidates,
)

# Shares of what the run has left: the walks may take this much, then the open-files scan this much of
# the rest, so py-spy and removals still have time before the deadline.
WALK_SHARE = 0.5
SCAN_SHARE = 0.6
# Of the time left when pollers are looked for, at most this share watches slow pollers (py-spy dumps follow).
SLOW_SHARE = 0.4
CONTAINERS_SUBJECT = "containers"


@dataclass
class Walked:
    """One walk child: a host glob (namespace None) or one container's globs, and the groups it found."""

    globs: list[str]
    roots: list[str]
    namespace: MountNamespace | None
    result: ChildResult
    groups: list[Group] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.result.ok and not self.result.value.get("gone"):
            walks = self.result.value["globs"]
            self.groups = [
                Group(glob, root, self.namespace, lock_files(walk["files"], root), walk)
                for glob, root, walk in zip(self.globs, self.roots, walks, strict=True)
            ]

    @property
    def gone(self) -> bool:
        return self.result.ok and bool(self.result.value.get("gone"))

    @property
    def subject(self) -> str:
        return self.namespace.label if self.namespace else self.globs[0]


@register
class LocksProbe(Probe):
    name = "storage.locks"
    checks = ("storage.locks",)
    reasons = (
        STALE_FILE_BATON,
        STALE_LOCK_SHARED,
        STALE_LOCK_REMOVED,
        PROCESS_WAITING_ON_FILE_BATON,
        LOCK_WAITER_CHECK_UNAVAILABLE,
        LOCK_SCAN_FAILED,
        LOCK_SCAN_INCOMPLETE,
        *LEFTOVER_REASONS,
        *CHILD_REASONS,
    )
    default_interval = 60.0
    default_timeout = 20.0
    needs = (
        "the lock directories (storage.lock_globs), containers' roots (/proc/<pid>/root), /proc/locks, every "
        "/proc/*/fd (hostPID, CAP_SYS_PTRACE), py-spy to name waiters"
    )

    def __init__(self) -> None:
        self._removed_total: dict[tuple[str, str], int] = {}  # (scope, glob) → locks removed since start
        self._holders = HolderWatch()  # whether flock holders make progress, from run to run

    def applicable(self, ctx: ProbeContext) -> str | None:
        # Two lists feed this probe: it applies while either has a glob (skip_when_empty needs all of them).
        settings = ctx.settings(StorageConfig)
        if settings.lock_globs or settings.container_lock_globs:
            return None
        return "nothing configured in storage.lock_globs nor storage.container_lock_globs"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(StorageConfig)
        census = (
            container_namespaces(ctx.host, settings.container_lock_max_namespaces)
            if settings.container_lock_globs
            else None
        )
        walked = self._walk(ctx, settings, census)
        groups = [group for item in walked for group in item.groups]
        drop_seen_on_host(groups)
        records = parse_proc_locks(ctx.host.proc_path("locks").read_text(errors="replace"))
        pollers = self._pollers(ctx, settings, groups, records)
        evidence, unreadable = self._evidence(ctx, settings, groups, records, bool(pollers))
        tables: dict[int, list[MountEntry] | None] = {}
        for group in groups:
            judge(group, evidence, self._table(ctx, group.namespace, tables))
        if settings.remove_stale_locks:
            for group in groups:
                self._count_removed(group, remove_stale(ctx, group, settings.locks_timeout_seconds))
        hung = self._hung_holders(ctx, groups, records)
        stale = stale_locks(ctx, groups)
        leftovers = leftover_findings(ctx, settings, groups, evidence, stale, pollers, hung)
        out: ProbeOutput = []
        out += self._host_findings(ctx, walked, evidence, unreadable)
        if census is not None:
            out += self._container_findings(ctx, walked, evidence, census)
        return out + leftovers + self._samples(settings, groups)

    # --- phases ------------------------------------------------------------------------------------

    def _walk(self, ctx: ProbeContext, settings: StorageConfig, census: NamespaceCensus | None) -> list[Walked]:
        """Every host glob and every container walked side by side, each within its share of the deadline."""
        children = len(settings.lock_globs) + (len(census.namespaces) if census else 0)
        reserve = reserve_seconds(ctx, min(children, MAX_PARALLEL_CHILDREN))
        budget = min(settings.locks_timeout_seconds, max(0.0, item_timeout(ctx, 1e9, reserve)) * WALK_SHARE)
        baton = tuple(settings.baton_lock_names)

        def plan(root: str, globs: list[str]) -> WalkPlan:
            parts = tuple(tuple(glob_parts(pattern)) for pattern in globs)
            return WalkPlan(root, parts, baton, settings.lock_walk_max_entries, budget * SOFT_SHARE)

        items: list[tuple[list[str], list[str], MountNamespace | None]] = []
        calls: list[ChildCall] = []
        for pattern in settings.lock_globs:
            root, rest = split_glob(pattern)
            items.append(([pattern], [root], None))
            host_args: tuple[object, ...] = (plan(str(ctx.host.root_path(root)), [rest]),)
            calls.append(ChildCall(f"locks:{pattern}", walk_in_child, host_args, budget))
        for namespace in census.namespaces if census else ():
            globs = list(settings.container_lock_globs)
            items.append((globs, ["/"] * len(globs), namespace))
            root = str(ctx.host.proc_path(namespace.pid, "root"))
            ns_args: tuple[object, ...] = (str(ctx.host.proc), namespace.pid, namespace.namespace, plan(root, globs))
            calls.append(ChildCall(f"locks-ns:{namespace.namespace}", walk_namespace_in_child, ns_args, budget))
        results = run_child_calls(ctx, calls, reserve)
        return [Walked(globs, roots, ns, result) for (globs, roots, ns), result in zip(items, results, strict=True)]

    def _evidence(
        self,
        ctx: ProbeContext,
        settings: StorageConfig,
        groups: list[Group],
        records: list[LockRecord],
        unclaimed: bool,
    ) -> tuple[Evidence, int]:
        """/proc/locks, and who holds the old existence-style locks (one /proc/*/fd scan for all of them); with
        `unclaimed` (a process polls), the old unlocked flock-style files too."""
        now = time.time()
        age = settings.stale_lock_age_seconds
        locked = {r.file_key for r in records if not r.blocked}
        candidates = {
            lock.inode_key
            for group in groups
            for lock in group.files
            if is_candidate(lock, now, age) or (unclaimed and is_unclaimed_candidate(lock, locked, now, age))
        }
        holders: dict[tuple[int, int], list[int]] = {}
        scan_error = ""
        unreadable = 0
        if candidates:
            timeout = max(0.05, (ctx.remaining(0.0) - reserve_seconds(ctx)) * SCAN_SHARE)
            try:
                scan = scan_open_files(ctx.host, inodes=candidates, timeout=timeout)
            except ScanError as exc:
                scan_error = str(exc)
            else:
                unreadable = scan.permission_denied
                for match in scan.matches:
                    holders.setdefault((match.key[1], match.key[2]), []).append(match.pid)
        evidence = Evidence(
            locked=locked,
            waiting={r.file_key for r in records if r.blocked},
            holders=holders,
            scan_error=scan_error,
            now=now,
            stale_age=age,
            shared_fstypes=tuple(settings.shared_fstypes),
            unclaimed_scanned=unclaimed,
        )
        return evidence, unreadable

    def _table(
        self, ctx: ProbeContext, namespace: MountNamespace | None, tables: dict[int, list[MountEntry] | None]
    ) -> list[MountEntry] | None:
        """The mount table a group's paths are in: the host's (a bad one is a ParseError of the probe), or the
        container's (unreadable: its locks count as on an unknown, so possibly shared, filesystem)."""
        pid = namespace.pid if namespace else 1
        if pid not in tables:
            if namespace is None:
                tables[pid] = read_mount_table(ctx)
            else:
                try:
                    tables[pid] = read_mount_table(ctx, pid)
                except (OSError, ProbeParseError):
                    tables[pid] = None
        return tables[pid]

    def _count_removed(self, group: Group, removed: int) -> None:
        key = ("containers" if group.namespace else "host", group.glob)
        self._removed_total[key] = self._removed_total.get(key, 0) + removed

    def _hung_holders(self, ctx: ProbeContext, groups: list[Group], records: list[LockRecord]) -> list[HungLock]:
        """Flock-style lock files whose holder is stopped or made no progress since the previous run."""
        locked = {r.file_key for r in records if not r.blocked}
        held = [
            (group, lock)
            for group in groups
            for lock in group.files
            if lock.regular and lock.style == "flock" and lock.proc_locks_key in locked
        ]
        why = self._holders.hung(ctx.host.proc, {pid for _, lock in held for pid in holders_of(records, lock)[0]})
        out = []
        for group, lock in held:
            holders, blocked = holders_of(records, lock)
            hung = [pid for pid in holders if pid in why]
            if hung:
                out.append(HungLock(group, lock, hung[0], why[hung[0]], blocked))
        return out

    def _pollers(
        self, ctx: ProbeContext, settings: StorageConfig, groups: list[Group], records: list[LockRecord]
    ) -> list[int] | None:
        """Python processes seen polling, the candidates of the waiter check: looked for only while a process
        could wait on something here (an old existence-style lock, an old unlocked lock file, which an empty
        SoftFileLock looks like, or a held flock); None when nothing could be waited on."""
        if not settings.lock_waiter_max_processes:
            return None
        now, age = time.time(), settings.stale_lock_age_seconds
        locked = {r.file_key for r in records if not r.blocked}
        watched = [
            group
            for group in groups
            for lock in group.files
            if is_candidate(lock, now, age)
            or is_unclaimed_candidate(lock, locked, now, age)
            or lock.proc_locks_key in locked
        ]
        if not watched:
            return None
        prefer = {group.namespace.namespace for group in watched if group.namespace}
        # Slow pollers are watched longer, within the run's time: py-spy's dumps come after.
        slow = max(0.0, min(SLOW_POLLING_WINDOW, (ctx.remaining(0.0) - reserve_seconds(ctx)) * SLOW_SHARE))
        return lock_waiter_candidates(
            ctx.host.proc, settings.lock_waiter_max_processes, prefer, POLLING_WINDOW, slow_window=slow
        )

    # --- findings ----------------------------------------------------------------------------------

    def _host_findings(
        self, ctx: ProbeContext, walked: list[Walked], evidence: Evidence, unreadable: int
    ) -> ProbeOutput:
        out: ProbeOutput = []
        for item in walked:
            if item.namespace is not None:
                continue
            if not item.result.ok:
                out.append(path_failure_finding(ctx, LOCKS, item.subject, item.roots[0], item.result))
                continue
            out += [host_group_finding(group, evidence, unreadable) for group in item.groups]
        return out

    def _container_findings(
        self, ctx: ProbeContext, walked: list[Walked], evidence: Evidence, census: NamespaceCensus
    ) -> ProbeOutput:
        """Per stale lock in a container, per container whose walk failed or ran out, and one summary."""
        out: ProbeOutput = []
        proc = str(ctx.host.proc)
        containers = [item for item in walked if item.namespace is not None]
        for item in containers:
            namespace = item.namespace
            assert namespace is not None
            if not item.result.ok:
                out.append(child_error_finding(LOCKS, item.subject, item.result, namespace.observed()))
                continue
            for group in item.groups:
                out += container_lock_findings(group, evidence, proc)
            short = [group for group in item.groups if group.incomplete]
            if short:
                message = f"lock files inside {namespace.describe()} not all looked at: {incomplete_text(short[0])}"
                observed = {**namespace.observed(), "globs": [group.glob for group in short]}
                out.append(LOCKS.report(LOCK_SCAN_INCOMPLETE, item.subject, message, observed))
        out.append(containers_summary(containers, evidence, census))
        return out

    def _samples(self, settings: StorageConfig, groups: list[Group]) -> list[Sample]:
        """Stale locks left per glob (summed over containers for container globs), and removals so far."""
        stale: dict[tuple[str, str], int] = {("host", glob): 0 for glob in settings.lock_globs}
        for glob in settings.container_lock_globs:
            stale[("containers", glob)] = 0
        for group in groups:
            key = ("containers" if group.namespace else "host", group.glob)
            stale[key] = stale.get(key, 0) + len(group.stale_local) + len(group.stale_shared)
        out = [
            Sample(
                "nodehealth_storage_stale_locks",
                "Stale lock files (no holder on this node, older than the threshold) left after removal.",
                count,
                {"glob": glob, "scope": scope},
            )
            for (scope, glob), count in stale.items()
        ]
        out += [
            Sample(
                "nodehealth_storage_stale_locks_removed_total",
                "Stale node-local lock files the agent removed (storage.remove_stale_locks).",
                self._removed_total.get(key, 0),
                {"glob": key[1], "scope": key[0]},
                kind="counter",
            )
            for key in stale
        ]
        return out


def containers_summary(containers: list[Walked], evidence: Evidence, census: NamespaceCensus) -> Finding:
    """How far the container pass got: every container walked, or why not."""
    walked = [item for item in containers if item.result.ok and not item.gone]
    groups = [group for item in walked for group in item.groups]
    observed: dict[str, Any] = {
        "namespaces": census.total,
        "walked": len(walked),
        "lock_files": sum(len(group.files) for group in groups),
        "stale": sum(len(group.stale_local) + len(group.stale_shared) for group in groups),
        "removed": sum(len(group.removed) for group in groups),
        "unreadable_processes": census.unreadable,
    }
    if census.error:
        return LOCKS.report(LOCK_SCAN_FAILED, CONTAINERS_SUBJECT, f"containers not looked at: {census.error}", observed)
    if any(group.needs_scan for group in groups):
        message = f"old lock files inside containers, but the scan of open files failed: {evidence.scan_error}"
        return LOCKS.report(LOCK_SCAN_FAILED, CONTAINERS_SUBJECT, message, observed)
    if census.total > len(census.namespaces):
        message = (
            f"walked {len(census.namespaces)} of {census.total} containers' mount namespaces "
            "(storage.container_lock_max_namespaces); the others' locks were not looked at"
        )
        return LOCKS.report(LOCK_SCAN_INCOMPLETE, CONTAINERS_SUBJECT, message, observed)
    message = (
        f"{len(walked)} container mount namespace(s) walked: {observed['lock_files']} lock file(s), "
        f"{observed['stale']} stale (each reported under its own subject), {observed['removed']} removed"
    )
    return LOCKS.ok(CONTAINERS_SUBJECT, message, observed)


def drop_seen_on_host(groups: list[Group]) -> None:
    """A lock a container sees through a bind mount of a host directory that a host glob covers is the host's
    lock: judged and reported once, under the host glob."""
    on_host = {lock.inode_key for group in groups if group.namespace is None for lock in group.files}
    for group in groups:
        if group.namespace is not None and on_host:
            group.files = [lock for lock in group.files if lock.inode_key not in on_host]


def stale_locks(ctx: ProbeContext, groups: list[Group]) -> list[StaleLock]:
    """The stale locks left after removal, as the waiter check looks for them."""
    out = []
    for group in groups:
        for lock in (*group.stale_local, *group.stale_shared):
            where = group.glob if group.namespace is None else container_lock_subject(group.namespace, lock)
            namespace = group.namespace.namespace if group.namespace else None
            out.append(StaleLock(f"{where} waiters", lock.path, namespace, removal(ctx, group, lock), lock.inode_key))
    return out
