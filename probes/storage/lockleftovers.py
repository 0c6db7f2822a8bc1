"""storage.locks: filelock's leftovers that block jobs although no rule of the lock styles calls them stale.

- **An empty SoftFileLock.** filelock <= 3.13 creates a SoftFileLock's file empty (newer ones write
  `<pid>\\n<hostname>`), and huggingface_hub and modelscope fall back to SoftFileLock where flock does not
  work. Its holder killed, the empty file looks exactly like the file an unlocked UnixFileLock leaves behind,
  which means nothing. What tells them apart is a process polling it: a FileLock waiter would have taken an
  unlocked flock at once, so a process that keeps polling an old, unlocked file nobody holds open waits on a
  dead SoftFileLock forever → StaleFileLock, naming the waiter.
- **A flock held by a hung process.** A download stuck on a dead connection, or a process stopped (SIGSTOP, a
  debugger), keeps its flock: /proc/locks shows it held, correctly, and every job behind it waits. A holder
  that is stopped (state T/t), or has made no progress (CPU time and I/O counters unchanged) since the previous
  run, with waiters behind it (blocked in /proc/locks, or polling it as py-spy shows) → LockHeldByHungProcess
  (warn), naming the holder and the waiters.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probes.base import Finding, ProbeContext, ProbeOutput, Reason, Status
from probes.runtime.holders import Holder, PodNames, stop_command
from probes.runtime.procfs import process_info
from probes.runtime.procstat import parse_stat
from probes.storage.common import reserve_seconds, safe_text
from probes.storage.config import StorageConfig
from probes.storage.lockfiles import LockRecord
from probes.storage.lockfindings import LOCKS, Evidence, Group, LockFile, container_lock_subject, host_side_path
from probes.storage.waiters import StaleLock, baton_waiter_findings, describe_process, describe_waiter, find_waiters

STALE_FILE_LOCK = Reason(
    "StaleFileLock",
    Status.FAIL,
    "an empty or unparseable lock file (a SoftFileLock of filelock <= 3.13, the huggingface_hub/modelscope "
    "fallback where flock does not work) older than stale_lock_age_seconds, that no process holds open nor "
    "locks, while a process polls it: its holder died and the waiter polls forever (warn on a shared "
    "filesystem, where the holder may be on another node)",
    "the lock has no holder: remove the file the finding names (rm <its path>) and the waiting job takes the "
    "lock and continues; on a shared filesystem first check no job on another node holds it",
    also=(Status.WARN,),
)
LOCK_HELD_BY_HUNG_PROCESS = Reason(
    "LockHeldByHungProcess",
    Status.WARN,
    "a flock-style lock file is held by a process that is stopped (state T) or has made no progress (CPU time, "
    "I/O) since the previous run, and other processes wait behind it (blocked in /proc/locks, or polling it)",
    "the holder (named with the waiters) is stopped or hung, e.g. a download on a dead connection: resume it "
    "(kill -CONT PID) or end it (kill PID, kubectl delete pod for a pod's, podman stop ID for a podman "
    "container's: the finding gives the command); the lock is released with it and a waiter takes it",
)
LEFTOVER_REASONS = (STALE_FILE_LOCK, LOCK_HELD_BY_HUNG_PROCESS)
_STOPPED_STATES = ("T", "t")


@dataclass(frozen=True)
class Progress:
    state: str
    cpu_ticks: int
    io_chars: int | None  # rchar + wchar of /proc/PID/io; None when unreadable


def read_progress(proc: Path, pid: int) -> tuple[int, Progress] | None:
    """(start time, progress) of a process from /proc; None when it is gone."""
    try:
        stat = parse_stat((proc / str(pid) / "stat").read_text(errors="replace"))
    except (OSError, ValueError):
        return None
    io_chars = None
    try:
        fields = dict(line.split(":", 1) for line in (proc / str(pid) / "io").read_text().splitlines() if ":" in line)
        io_chars = int(fields["rchar"]) + int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        io_chars = None
    return stat.start_time, Progress(stat.state, stat.cpu_ticks, io_chars)


class HolderWatch:
    """Whether flock holders are hung: stopped now, or unchanged (CPU time, I/O) since the previous run. Kept by
    the probe between runs; only the holders of the current run are remembered (bounded by the locks held)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._seen: dict[tuple[int, int], tuple[Progress, float]] = {}

    def hung(self, proc: Path, pids: Iterable[int]) -> dict[int, str]:
        """pid → why it is hung ("stopped (state T)", "no progress for 61 s (state S)"), for the hung ones."""
        now = self._clock()
        seen: dict[tuple[int, int], tuple[Progress, float]] = {}
        out: dict[int, str] = {}
        for pid in sorted(set(pids)):
            current = read_progress(proc, pid)
            if current is None:
                continue
            start, progress = current
            key = (pid, start)
            previous = self._seen.get(key)
            unchanged = previous is not None and (previous[0].cpu_ticks, previous[0].io_chars) == (
                progress.cpu_ticks,
                progress.io_chars,
            )
            since = previous[1] if unchanged and previous is not None else now
            seen[key] = (progress, since)
            if progress.state in _STOPPED_STATES:
                out[pid] = f"stopped (state {progress.state})"
            elif unchanged:
                out[pid] = f"no progress for {now - since:.0f} s (state {progress.state}, CPU time and I/O unchanged)"
        self._seen = seen
        return out


def holders_of(records: Sequence[LockRecord], lock: LockFile) -> tuple[list[int], list[int]]:
    """(holder pids, blocked waiter pids) of a lock file in /proc/locks (pids outside our pid namespace and OFD
    locks, -1 or 0, left out)."""
    holders = [r.pid for r in records if r.file_key == lock.proc_locks_key and not r.blocked and r.pid > 0]
    blocked = [r.pid for r in records if r.file_key == lock.proc_locks_key and r.blocked and r.pid > 0]
    return sorted(set(holders)), sorted(set(blocked))


def leftover_subject(group: Group, lock: LockFile) -> str:
    """A lock file's own subject: `<glob>: <path>` on the host, `<container>: <path>` in a container."""
    if group.namespace is not None:
        return container_lock_subject(group.namespace, lock)
    return f"{group.glob}: {safe_text(lock.path)}"


def named(people: Sequence[Mapping[str, Any]], describe: Any) -> str:
    shown = ", ".join(describe(person) for person in people[:5])
    return shown + (f" and {len(people) - 5} more" if len(people) > 5 else "")


def stale_file_lock_finding(
    subject: str,
    lock: LockFile,
    waiters: Sequence[Mapping[str, Any]],
    remove_hint: str,
    now: float,
    describe: Any,
    extra: Mapping[str, Any] | None = None,
) -> Finding:
    """StaleFileLock: fail on a node-local filesystem, warn on a shared one (as the judge found it)."""
    shared = lock.shared
    content = "empty" if lock.size == 0 else "unparseable"
    message = (
        f"{safe_text(lock.path)}: an {content} lock file {lock.age(now)}s old that no process holds or locks, "
        f"polled by {named(waiters, describe)}: a SoftFileLock whose holder is gone"
    )
    hint = f"the lock has no holder: remove it ({remove_hint}) and the waiting job takes it and continues"
    if shared:
        message += f" (on {lock.fstype}, shared: a holder on another node is invisible from here)"
        hint = f"check no job on another node holds it (lsof/fuser there), then remove it ({remove_hint})"
    observed = {**lock.brief(now), **(extra or {}), "waiters": list(waiters[:20])}
    status = Status.WARN if shared else Status.FAIL
    return LOCKS.report(STALE_FILE_LOCK, subject, message, observed, hint=hint, status=status)


def end_command(ctx: ProbeContext, pid: int) -> str:
    """How to end a lock's holder, as the device and port holders are told to stop: `kubectl delete pod` (or
    crictl stopp when the pod's name is unknown) for a pod's process, the runtime's CLI (`podman stop ID`) for a
    container Kubernetes does not run, systemctl stop for a service, else `kill PID`."""
    info = process_info(ctx.host.proc, pid, with_command=False)
    if info is None:
        return f"kill {pid}"
    return stop_command(Holder(info, PodNames(ctx.host.root).pod(info.cgroup)))


def hung_holder_finding(
    subject: str,
    lock: LockFile,
    holder: Mapping[str, Any],
    end: str,
    why: str,
    waiters: Sequence[Mapping[str, Any]],
    now: float,
    describe: Any,
    extra: Mapping[str, Any] | None = None,
) -> Finding:
    """LockHeldByHungProcess; `end` is the command that ends the holder (end_command)."""
    pid = holder["pid"]
    message = (
        f"{safe_text(lock.path)} is locked by {describe(holder)}, {why}, and {len(waiters)} process(es) wait "
        f"behind it: {named(waiters, describe)}"
    )
    hint = (
        f"the holder is stopped or hung (a download on a dead connection, a stopped process): resume it (kill -CONT "
        f"{pid}) or end it ({end}); the lock goes with it and a waiter takes it. node-health diagnose {pid} shows "
        "its stack"
    )
    observed = {**lock.brief(now), **(extra or {}), "holder": dict(holder), "why": why, "waiters": list(waiters[:20])}
    return LOCKS.report(LOCK_HELD_BY_HUNG_PROCESS, subject, message, observed, hint=hint)


@dataclass(frozen=True)
class HungLock:
    """A flock-style lock file held by a hung process, and the processes /proc/locks shows blocked behind it."""

    group: Group
    lock: LockFile
    holder: int
    why: str
    blocked: list[int]


def removal(ctx: ProbeContext, group: Group, lock: LockFile) -> str:
    """How to remove a lock file: `rm PATH` on the host; inside a container, both ways."""
    if group.namespace is None:
        return f"rm {safe_text(lock.path)}"
    host_path = safe_text(host_side_path(str(ctx.host.proc), group.namespace, lock))
    return f"rm {safe_text(lock.path)} in the container, or rm {host_path} on the node"


def watched_lock(ctx: ProbeContext, group: Group, lock: LockFile, kind: str) -> StaleLock:
    """A lock file whose waiters are looked for under its own subject (unclaimed: StaleFileLock, hung:
    LockHeldByHungProcess)."""
    namespace = group.namespace.namespace if group.namespace else None
    return StaleLock(
        leftover_subject(group, lock), lock.path, namespace, removal(ctx, group, lock), lock.inode_key, kind
    )


def where_observed(group: Group) -> dict[str, Any]:
    return group.namespace.observed() if group.namespace else {"glob": group.glob}


def leftover_findings(
    ctx: ProbeContext,
    settings: StorageConfig,
    groups: Sequence[Group],
    evidence: Evidence,
    stale: Sequence[StaleLock],
    pollers: Sequence[int] | None,
    hung: Sequence[HungLock],
) -> ProbeOutput:
    """Waiters on stale locks (ProcessWaitingOnFileBaton), on unclaimed lock files (StaleFileLock) and behind
    hung flock holders (LockHeldByHungProcess), from one py-spy pass. A lock reported here is counted in its
    group's `own_subject`."""
    unclaimed = [watched_lock(ctx, g, lock, "unclaimed") for g in groups for lock in g.unclaimed] if pollers else []
    held = [watched_lock(ctx, item.group, item.lock, "hung") for item in hung]
    command, limit = settings.py_spy_command or ["py-spy"], settings.lock_waiter_max_processes
    waiters: dict[str, list[dict[str, Any]]] = {}
    unavailable = ""
    if (stale or unclaimed or held) and limit:
        watched = [*stale, *unclaimed, *held]
        waiters, unavailable = find_waiters(ctx, command, limit, watched, reserve_seconds(ctx), pollers or [])
    out: ProbeOutput = []
    if stale and limit:
        out += baton_waiter_findings(stale, waiters, unavailable, command)
    removals = {entry.subject: entry.remove_hint for entry in unclaimed}
    for group in groups:
        for lock in group.unclaimed:
            subject = leftover_subject(group, lock)
            found = waiters.get(subject)
            if found and subject in removals:
                extra = where_observed(group)
                out.append(
                    stale_file_lock_finding(
                        subject, lock, found, removals[subject], evidence.now, describe_waiter, extra
                    )
                )
                group.count("own_subject")
    for item in hung:
        subject = leftover_subject(item.group, item.lock)
        behind = [describe_process(ctx, pid, item.lock.path) for pid in item.blocked]
        known = {entry["pid"] for entry in behind}
        behind += [entry for entry in waiters.get(subject, []) if entry["pid"] not in known]
        if behind:
            holder = describe_process(ctx, item.holder, item.lock.path)
            end = end_command(ctx, item.holder)
            extra = where_observed(item.group)
            out.append(
                hung_holder_finding(
                    subject, item.lock, holder, end, item.why, behind, evidence.now, describe_waiter, extra
                )
            )
            item.group.count("own_subject")
    return out
