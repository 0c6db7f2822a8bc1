"""Processes waiting on a lock: Python processes seen polling (a thread in time.sleep that keeps waking up),
dumped with py-spy and classified.

Waiters are named by PID, executable name and pod/container; their command lines (other tenants' secrets
can be in them) only when the operator turned `redact_cmdlines` off.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from probes.base import Finding, ProbeContext, Reason, Status
from probes.runtime.paths import join_under
from probes.runtime.procfs import list_pids, process_info
from probes.runtime.procstat import state_of
from probes.runtime.pyspy import FILEBATON_WAIT, LOCK_WAIT, PY_SPY_NOT_FOUND, diagnose
from probes.storage.common import MIN_CHILD_SECONDS, safe_text
from probes.storage.containers import HostNamespace, read_namespace
from probes.storage.lockfindings import LOCKS

PROCESS_WAITING_ON_FILE_BATON = Reason(
    "ProcessWaitingOnFileBaton",
    Status.FAIL,
    "a process on this node (on the host or in a container) is stuck in FileBaton.wait() (or a lock-file poll) "
    "on a stale lock; it is named by PID, executable and pod",
    "remove the stale lock (rm <its path>, which the finding names) and the waiting job continues; node-health "
    "diagnose PID shows the stack",
)
LOCK_WAITER_CHECK_UNAVAILABLE = Reason(
    "LockWaiterCheckUnavailable",
    Status.UNKNOWN,
    "stale locks exist but py-spy (storage.py_spy_command) is not available or may not read the processes, so "
    "processes waiting on them cannot be named",
    "install py-spy in the agent's image or point storage.py_spy_command at it (e.g. [nsenter, -t, 1, -m, --, "
    "py-spy]); the agent needs CAP_SYS_PTRACE",
)

# Process names of Python jobs as /proc/PID/comm shows them (torch renames its main thread pt_main_thread).
_PYTHON_COMMS = ("python", "pt_main_thread", "torchrun", "accelerate", "deepspeed")
_DUMP_SECONDS = 3.0
# States (field 3 of /proc/PID/stat) of a process that polls a lock: sleeping between checks, or checking.
_POLLING_STATES = ("S", "R")
# Polling detection: at most this many candidates sampled (a node may run hundreds of data-loader workers), and
# this many threads of each (two reads of a status file per thread).
_MAX_SAMPLED = 1024
_MAX_THREADS = 32
# How long the wake-ups of candidates are watched when only pollers are wanted (filelock polls every 50 ms,
# FileBaton every 100 ms).
POLLING_WINDOW = 0.5
# How much longer the threads that slept through that window in nanosleep are watched: slow pollers
# (filelock's acquire(poll_interval=2.0)) wake twice within the two windows, 4.5 s, for intervals up to 2 s,
# with half a second to spare for a late wake-up on a busy machine. Only when such a thread exists.
SLOW_POLLING_WINDOW = 4.0
# A poller wakes up this often within the window at least (filelock 10 times, FileBaton 5); a thread that merely
# fell asleep as the first sample was taken may count once.
POLLING_MIN_WAKEUPS = 2
# py-spy errors that mean it may not read processes at all (no CAP_SYS_PTRACE), not that one process vanished.
_DENIED = ("permission denied", "operation not permitted")


@dataclass(frozen=True)
class StaleLock:
    """A stale lock a process may wait on, and the subject its waiters are reported under."""

    subject: str  # `<glob> waiters` on the host, `<pod/container>: <path> waiters` in a container
    path: str  # as its mount namespace sees it
    namespace: str | None  # the container's mount namespace; None for a host lock
    remove_hint: str  # what to remove, for the hint
    inode_key: tuple[int, int]  # (st_dev, st_ino)
    # stale: a FileBaton/SoftFileLock judged stale (its waiters: ProcessWaitingOnFileBaton); unclaimed: an old,
    # unlocked lock file nobody holds (a poller makes it a StaleFileLock); hung: a flock whose holder is hung.
    kind: str = "stale"


def read_text_or_empty(path: Any) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(4096).decode("utf-8", "replace")
    except OSError:
        return ""


def lock_waiter_candidates(
    proc: Any,
    limit: int,
    prefer: Collection[str] = (),
    polling_window: float = POLLING_WINDOW,
    slow_window: float = 0.0,
) -> list[int]:
    """Python processes seen polling, as lock waiters do (FileBaton.wait and filelock's acquire sleep between
    tries): a thread of theirs sleeping in nanosleep woke up (voluntary context switches) within
    `polling_window` seconds, or, for a thread that slept through it, within `slow_window` seconds more (a slow
    poller); those in the mount namespaces `prefer` (containers with stale locks) and the
    newest sampled first, the most wake-ups first. Cheap, and it leaves out idle daemons and busy training
    processes alike, so py-spy (which pauses a process) is spent on likely waiters only. Zombies, stopped
    processes and those in uninterruptible I/O poll nothing.
    """
    found: list[tuple[bool, int]] = []
    me = os.getpid()
    for pid in list_pids(proc):
        if pid == me:
            continue
        comm = read_text_or_empty(os.path.join(proc, str(pid), "comm")).strip()
        if not comm.startswith(_PYTHON_COMMS):
            continue
        if state_of(read_text_or_empty(os.path.join(proc, str(pid), "stat"))) not in _POLLING_STATES:
            continue
        namespace = None
        if prefer:
            try:
                namespace = os.readlink(os.path.join(proc, str(pid), "ns", "mnt"))
            except OSError:
                namespace = None
        found.append((namespace not in prefer, pid))
    newest = sorted(found, key=lambda item: (item[0], -item[1]))[:_MAX_SAMPLED]
    woke = polling(proc, [pid for _, pid in newest], polling_window, slow_window)
    preferred = {pid for not_preferred, pid in newest if not not_preferred}
    return sorted(woke, key=lambda pid: pid not in preferred)[:limit]


def thread_samples(proc: Any, pid: int) -> dict[str, tuple[bool, int]] | None:
    """Per thread (at most _MAX_THREADS): whether it sleeps in nanosleep (time.sleep, where a lock poller waits
    between tries) and its voluntary context switches; None when the process is gone."""
    task_dir = os.path.join(proc, str(pid), "task")
    try:
        tids = sorted(os.listdir(task_dir), key=lambda tid: int(tid) if tid.isdigit() else 0)[:_MAX_THREADS]
    except OSError:
        return None
    samples: dict[str, tuple[bool, int]] = {}
    for tid in tids:
        sleeping = "nanosleep" in read_text_or_empty(os.path.join(task_dir, tid, "wchan"))
        for line in read_text_or_empty(os.path.join(task_dir, tid, "status")).splitlines():
            fields = line.split()
            if line.startswith("voluntary_ctxt_switches:") and len(fields) == 2 and fields[1].isdigit():
                samples[tid] = (sleeping, int(fields[1]))
    return samples


def polling(proc: Any, pids: Sequence[int], window: float, slow_window: float = 0.0) -> list[int]:
    """The processes among `pids` with a thread seen sleeping in nanosleep (at either of two samples `window`
    seconds apart) that woke up at least POLLING_MIN_WAKEUPS times in between, most wake-ups first: a loop
    around time.sleep, as lock pollers are. Busy threads, threads blocked on I/O, locks or a condition, and long
    sleepers do not count. Two samples, so that a poller caught running (or waiting for a CPU) still counts.

    With `slow_window`, the processes none of whose threads woke that often but one of which slept in nanosleep
    are sampled once more `slow_window` seconds later, and count when such a thread woke often enough over both
    windows: a poller with a longer interval. Nothing is waited for when there is no such thread."""
    before = {pid: thread_samples(proc, pid) for pid in pids}
    time.sleep(window)
    rates: list[tuple[int, int]] = []
    sleepers: dict[int, set[str]] = {}  # pid → threads seen in nanosleep that did not wake often enough
    for pid, first in before.items():
        after = thread_samples(proc, pid) if first else None
        if not first or not after:
            continue
        woke = _wakeups(first, after, set())
        if woke:
            rates.append((-woke, pid))
        else:
            sleepers[pid] = {tid for tid, (slept, _) in first.items() if slept or after.get(tid, (False, 0))[0]}
    slow = {pid: tids for pid, tids in sleepers.items() if tids}
    if slow and slow_window > 0:
        time.sleep(slow_window)
        for pid, tids in slow.items():
            later = thread_samples(proc, pid)
            woke = _wakeups(before[pid] or {}, later, tids) if later else 0
            if woke:
                rates.append((-woke, pid))
    return [pid for _, pid in sorted(rates)]


def _wakeups(first: dict[str, tuple[bool, int]], after: dict[str, tuple[bool, int]], slept: set[str]) -> int:
    """Wake-ups between two samples of the threads seen sleeping in nanosleep (at either, or in `slept`) that
    woke at least POLLING_MIN_WAKEUPS times; 0 when none did."""
    woke = 0
    for tid, (was_sleeping, count) in first.items():
        now_sleeping, now_count = after.get(tid, (False, count))
        if (was_sleeping or now_sleeping or tid in slept) and now_count - count >= POLLING_MIN_WAKEUPS:
            woke += now_count - count
    return woke


def stat_key_in_child(path: str) -> tuple[int, int]:
    """Runs in a child: (st_dev, st_ino) of the file a path names (as the process whose root it goes through
    would open it)."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def match_waited_lock(
    ctx: ProbeContext, pid: int, waited: str, stale: Sequence[StaleLock], reserve: float
) -> StaleLock | None:
    """The stale lock process `pid` waits on (`waited`: the path its frames show, "" when they do not).

    A lock of the waiter's own mount namespace (a container's, or the host's for a waiter on the host) is
    matched by its path; a host lock waited on from a container (a bind mount, another path) only when the
    waiter's path, opened through its root, is the very file. A waiter whose frames show no path is matched
    only when its namespace has exactly one stale lock.
    """
    namespace = read_namespace(ctx.host, pid)
    on_host = HostNamespace.of(ctx.host).holds(ctx.host, pid, namespace)
    own = [lock for lock in stale if (lock.namespace == namespace if lock.namespace else on_host)]
    if not waited:
        return own[0] if len(own) == 1 else None
    for lock in own:
        if waited == lock.path:
            return lock
    host_locks = [lock for lock in stale if lock.namespace is None]
    if on_host or not host_locks:
        return None
    timeout = min(1.0, ctx.remaining(0.0) - reserve)
    if timeout < MIN_CHILD_SECONDS:
        return None
    result = ctx.host.child_call(
        f"locks-waiter:{pid}",
        stat_key_in_child,
        str(join_under(ctx.host.proc_path(pid, "root"), waited)),
        timeout=timeout,
    )
    return next((lock for lock in host_locks if result.ok and result.value == lock.inode_key), None)


def describe_process(ctx: ProbeContext, pid: int, lock_path: str) -> dict[str, Any]:
    """A waiter (or holder) by PID, executable and pod/container; its command line only when not redacted."""
    info = process_info(ctx.host.proc, pid, with_command=not ctx.redact_cmdlines)
    entry: dict[str, Any] = {"pid": pid, "exe": info.comm if info else "?", "lock": lock_path}
    if info is not None and info.cgroup.kind in ("pod", "container"):
        entry.update({"pod_uid": info.cgroup.pod_uid, "container_id": info.cgroup.container_id})
        entry["owner"] = info.cgroup.describe()
    if not ctx.redact_cmdlines and info is not None:
        entry["command"] = info.command[:200]
    return entry


def describe_waiter(waiter: dict[str, Any]) -> str:
    parts = [safe_text(waiter["exe"])]
    if waiter.get("owner"):
        parts.append(waiter["owner"])
    if waiter.get("command"):
        parts.append(safe_text(waiter["command"][:80]))
    return f"pid {waiter['pid']} ({', '.join(parts)})"


def py_spy_missing(command: Sequence[str]) -> str:
    """Why the configured py-spy cannot run at all ("" when its first element is an executable)."""
    return "" if shutil.which(command[0]) else f"{PY_SPY_NOT_FOUND}: {command[0]} is not an executable on PATH"


def find_waiters(
    ctx: ProbeContext,
    command: Sequence[str],
    limit: int,
    watched: Sequence[StaleLock],
    reserve: float,
    candidates: Sequence[int],
) -> tuple[dict[str, list[dict[str, Any]]], str]:
    """Waiters by the subject of the lock they wait on, and why the check could not be done ("" when it could).
    `candidates`: the processes to dump, up to `limit` (lock_waiter_candidates)."""
    missing = py_spy_missing(command)
    if missing:
        return {}, missing
    waiters: dict[str, list[dict[str, Any]]] = {}
    denied: list[str] = []
    dumped = 0
    for pid in list(candidates)[:limit]:
        budget = min(_DUMP_SECONDS, ctx.remaining(0.0) - reserve)
        if budget < 0.5:
            break
        diagnosis = diagnose(pid, budget, py_spy=command, proc=ctx.host.proc)
        if diagnosis.error:
            if diagnosis.error.startswith(PY_SPY_NOT_FOUND):
                return {}, diagnosis.error
            if any(text in diagnosis.error.lower() for text in _DENIED):
                denied.append(f"pid {pid}: {diagnosis.error}")
            continue
        dumped += 1
        if diagnosis.kind not in (FILEBATON_WAIT, LOCK_WAIT):
            continue
        lock = match_waited_lock(ctx, pid, diagnosis.lock_path or "", watched, reserve)
        if lock is not None:
            waiters.setdefault(lock.subject, []).append(describe_process(ctx, pid, lock.path))
    if denied and not dumped:
        return waiters, f"py-spy may not read the processes: {denied[0]}"
    return waiters, ""


def baton_waiter_findings(
    stale: Sequence[StaleLock],
    waiters: dict[str, list[dict[str, Any]]],
    unavailable: str,
    command: Sequence[str],
) -> list[Finding]:
    """ProcessWaitingOnFileBaton per stale lock subject with waiters, or LockWaiterCheckUnavailable for
    every stale lock subject when py-spy cannot be used."""
    findings = []
    if unavailable:
        for subject in dict.fromkeys(lock.subject for lock in stale):
            message = f"cannot tell which processes wait on the stale lock(s): {safe_text(unavailable)}"
            findings.append(
                LOCKS.report(LOCK_WAITER_CHECK_UNAVAILABLE, subject, message, {"py_spy_command": list(command)})
            )
    by_subject = {lock.subject: lock for lock in stale}
    for subject, found in waiters.items():
        lock = by_subject.get(subject)
        if lock is None:
            continue  # a waiter on another kind of lock: reported with that lock
        names = ", ".join(describe_waiter(waiter) for waiter in found[:5])
        message = f"{len(found)} process(es) waiting on stale lock {safe_text(found[0]['lock'])}: {names}"
        hint = (
            f"the lock has no holder: remove it ({lock.remove_hint}) and the waiting job continues; "
            "node-health diagnose PID shows the stack"
        )
        observed = {"waiters": found[:20]}
        findings.append(LOCKS.report(PROCESS_WAITING_ON_FILE_BATON, subject, message, observed, hint=hint))
    return findings
