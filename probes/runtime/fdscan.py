"""One pass over every /proc/*/fd of the host: who holds a device, a file or a socket open.

Each fd is read with readlink (procfs answers that itself, whatever the file is on) and, when its target could
be one that is wanted, with statx(AT_STATX_DONT_SYNC): FUSE and NFS then answer from the inode cache without
asking their server, so a file on a hung mount cannot block the scan (a plain stat(2) of it sleeps in D state).
Character devices match by st_rdev (a container's /dev/davinci0 is a different inode with the same
major:minor, which `fuser` on the host path misses), regular files by (st_dev, st_ino), sockets by the
`socket:[N]` link text without any stat.

A device scan also reads each process's /proc/PID/maps for the device nodes it has mapped with no fd left open
(`probes.runtime.mapscan`), in the same scanner, after that process's fds.

The scan runs in forked scanners, never on an agent thread: one per CPU the children may use (`scanner_count`),
each over an interleaved share of the processes. A scanner reports its progress through shared
memory and its findings through a pipe as it goes; one that makes no progress for a while (a filesystem that
ignores AT_STATX_DONT_SYNC, or a kernel without statx) is killed, the process it was reading is named as
unreadable, and a new scanner carries on after it: what was read is kept, and one bad mount blinds nothing else.
The scanner also reads the /proc texts of each process it matched (`ScanResult.texts`), the cmdline last: that
read waits while the process's mmap lock is held, and must not happen on an agent thread.

This module is the scanners' protocol (fork, watch the progress, read the frames, replace a stalled scanner);
what a scanner does inside, one fd table after another, is `probes.runtime.fdtable`.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import pickle
import select
import signal
import struct
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probes.runtime.children import drop_inherited_fds, try_reap
from probes.runtime.cpulimit import children_millicores, enter_work
from probes.runtime.fdtable import PROGRESS, STATX_AVAILABLE, ProcessTexts, ScanRequest, list_pids, scan_fds

if TYPE_CHECKING:
    from probes.runtime.host import Host


class ScanError(Exception):
    """The scan of /proc/*/fd could not be done (no /proc, the scanner failed); the check is unknown."""


class ScanTimeout(ScanError):
    """The scan did not finish by its deadline, or too many earlier scanners are still stuck."""


@dataclass(frozen=True)
class FdMatch:
    pid: int
    start_time: int
    fd: int
    target: str  # readlink text of /proc/PID/fd/N (or the mapping's path), as the holder's mount namespace names it
    key: tuple[Any, ...]  # ("rdev", rdev) | ("inode", st_dev, st_ino) | ("socket", inode)
    via: str = "fd"  # "mmap": a device node the process has mapped (fd is -1), found in /proc/PID/maps


@dataclass(frozen=True)
class UnreadableProcess:
    """A process whose open files could not be read: its scanner got no answer (a hung filesystem)."""

    pid: int
    comm: str
    why: str


@dataclass(frozen=True)
class ScanResult:
    matches: tuple[FdMatch, ...]
    vanished: int  # processes that exited, and fds closed, while being read
    permission_denied: int  # processes whose fd table (or some fd) could not be read (EACCES/EPERM)
    processes: int
    fds: int
    duration: float  # seconds, including the scanners' start
    unreadable: tuple[UnreadableProcess, ...] = ()
    unscanned: int = 0  # processes not reached before the deadline
    skipped: int = 0  # fd targets not stat'ed (no statx: only targets under a dev dir are)
    maps_truncated: int = 0  # processes with more mappings than are read (mapping scans)
    maps_denied: int = 0  # processes whose mappings could not be matched (no CAP_SYS_ADMIN for map_files)
    # pid → (stat, cgroup, status, cmdline or None) of each process with a match, read by the scanner that
    # found it: reading a cmdline takes the process's mmap lock and can block, so no agent thread does it.
    texts: Mapping[int, ProcessTexts] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.unreadable and not self.unscanned

    def by_key(self) -> dict[tuple[Any, ...], list[FdMatch]]:
        out: dict[tuple[Any, ...], list[FdMatch]] = {}
        for match in self.matches:
            out.setdefault(match.key, []).append(match)
        return out

    def shortfall(self) -> str:
        """What the scan could not read, for messages; "" when it is complete."""
        return shortfall(self.unreadable, self.unscanned)


def shortfall(unreadable: Sequence[UnreadableProcess], unscanned: int) -> str:
    """What a scan could not read, for messages: the first unreadable processes and why, and how many it did
    not reach; "" when it read everything."""
    parts = [f"PID {p.pid} ({p.comm or '?'}): {p.why}" for p in unreadable[:3]]
    if len(unreadable) > 3:
        parts.append(f"{len(unreadable) - 3} more processes unreadable")
    if unscanned:
        parts.append(f"{unscanned} processes not reached before the deadline")
    return "; ".join(parts)


SCAN_KEY = "procfs-fd-scan"
# Scanners killed for a stall that have not exited (unkillable D state): while one lives, the process it
# was stuck on is skipped, and past this many no new scan starts.
MAX_LINGERING_SCANNERS = 4
_SCAN_LOCKS: dict[str, threading.Lock] = {}
_LINGERING: dict[str, list[tuple[int, int]]] = {}  # key → [(scanner pid, pid it was stuck on)]
_SCAN_LOCKS_GUARD = threading.Lock()


def _scan_lock(key: str) -> threading.Lock:
    with _SCAN_LOCKS_GUARD:
        return _SCAN_LOCKS.setdefault(key, threading.Lock())


def lingering_scanners(key: str = SCAN_KEY) -> list[int]:
    """PIDs of scanners of `key` killed for a stall that have not exited yet."""
    with _SCAN_LOCKS_GUARD:
        alive = [(child, stuck) for child, stuck in _LINGERING.get(key, []) if not try_reap(child)]
        _LINGERING[key] = alive
        return [child for child, _ in alive]


def scan_open_files(
    host: Host,
    *,
    rdevs: Collection[int] = (),
    inodes: Collection[tuple[int, int]] = (),
    sockets: Collection[int] = (),
    timeout: float,
    key: str = SCAN_KEY,
    partial: bool = False,
    stall_seconds: float | None = None,
    use_statx: bool = True,
    mappings: bool = False,
) -> ScanResult:
    """One pass over every /proc/*/fd of the host, in forked scanners bounded by `timeout`.

    Each fd is readlink'ed (procfs answers that itself) and, when its target could be wanted, stat'ed with
    statx(AT_STATX_DONT_SYNC), so a hung FUSE/NFS mount does not block it; without statx only targets under
    a dev dir are stat'ed for a device scan. With `mappings`, each process's /proc/PID/maps is read too, for
    the `rdevs` it has mapped (`probes.runtime.mapscan`). A scanner that makes no progress for
    `stall_seconds` anyway is killed, the process it was on is named in `unreadable`, and a new scanner goes
    on after it.

    Scans with the same `key` run one at a time (a caller waits within its timeout). With `partial`, what
    was read by the deadline is returned (`complete` False); without it an incomplete scan raises
    ScanTimeout, so a caller that must not miss a holder (a lock's) never acts on half a scan.
    Raises ScanError when /proc cannot be listed or a scanner fails.
    """
    started = time.monotonic()
    deadline = started + max(timeout, 0.0)
    lock = _scan_lock(key)
    if not lock.acquire(timeout=max(timeout, 0.0)):
        raise ScanTimeout(f"scan of {host.proc}/*/fd: another scan still running after {timeout:g}s")
    try:
        request = ScanRequest(
            str(host.proc),
            frozenset(int(r) for r in rdevs),
            frozenset((int(d), int(i)) for d, i in inodes),
            frozenset(int(s) for s in sockets),
            use_statx and STATX_AVAILABLE,
            ("/dev/", str(host.dev).rstrip("/") + "/"),
            mappings and bool(rdevs),
        )
        stall = stall_seconds if stall_seconds is not None else min(2.0, max(0.25, timeout / 4))
        result = _scan_all(request, key, deadline, stall, started)
    finally:
        lock.release()
    if not result.complete and not partial:
        raise ScanTimeout(f"scan of {host.proc}/*/fd incomplete within {timeout:g}s: {result.shortfall()}")
    return result


@dataclass
class _Tally:
    matches: list[FdMatch]
    counters: dict[str, int]
    unreadable: list[UnreadableProcess]
    texts: dict[int, ProcessTexts] = field(default_factory=dict)
    unscanned: int = 0  # processes not reached before the deadline


# A scan's processes are shared among up to this many scanners, one per CPU its children may use, each with
# at least MIN_PIDS_PER_SCANNER processes (a fork is not worth fewer). Under a CPU limit of less than two cores
# (the DaemonSet's) there is one: more would only share the same quota.
MAX_SCANNERS = 4
MIN_PIDS_PER_SCANNER = 400


def scanner_count(processes: int) -> int:
    """How many scanners share a scan of `processes` processes."""
    cpus = len(os.sched_getaffinity(0))
    millicores = children_millicores()
    if millicores is not None:
        cpus = min(cpus, max(1, millicores // 1000))
    return max(1, min(MAX_SCANNERS, cpus, processes // MIN_PIDS_PER_SCANNER))


def _scan_all(request: ScanRequest, key: str, deadline: float, stall: float, started: float) -> ScanResult:
    try:
        pids = list_pids(Path(request.proc_dir))
    except OSError as exc:
        raise ScanError(f"scan of {request.proc_dir}/*/fd failed: cannot list {request.proc_dir}: {exc}") from None
    lingering = lingering_scanners(key)
    if len(lingering) >= MAX_LINGERING_SCANNERS:
        raise ScanTimeout(f"scan of {request.proc_dir}/*/fd: {len(lingering)} earlier scanners still stuck")
    with _SCAN_LOCKS_GUARD:
        avoided = {stuck for _, stuck in _LINGERING.get(key, [])}
    remaining = [pid for pid in pids if pid not in avoided]
    count = scanner_count(len(remaining))
    # Interleaved, not in runs: neighbouring pids (one pod's processes, a busy service's workers) cost alike.
    shards = [remaining[index::count] for index in range(count)]
    if count == 1:
        tallies = [_scan_shard(request, key, shards[0], deadline, stall)]
    else:
        with ThreadPoolExecutor(count - 1, thread_name_prefix="fdscan") as pool:
            others = [pool.submit(_scan_shard, request, key, shard, deadline, stall) for shard in shards[1:]]
            tallies = [_scan_shard(request, key, shards[0], deadline, stall)]
            tallies += [future.result() for future in others]
    stuck = [pid for pid in pids if pid in avoided]
    unreadable = [_unreadable(request.proc_dir, pid, "an earlier scanner is still stuck on it") for pid in stuck]
    unreadable += [process for tally in tallies for process in tally.unreadable]
    counters = {name: sum(tally.counters.get(name, 0) for tally in tallies) for name in _COUNTERS}
    position = {pid: index for index, pid in enumerate(pids)}
    matches = sorted((m for tally in tallies for m in tally.matches), key=lambda m: position.get(m.pid, -1))
    unscanned = sum(tally.unscanned for tally in tallies)
    return ScanResult(
        matches=tuple(matches),
        vanished=counters["vanished"],
        permission_denied=counters["permission_denied"],
        processes=len(pids) - unscanned - len(unreadable),
        fds=counters["fds"],
        duration=time.monotonic() - started,
        unreadable=tuple(unreadable),
        unscanned=unscanned,
        skipped=counters["skipped"],
        maps_truncated=counters["maps_truncated"],
        maps_denied=counters["maps_denied"],
        texts={pid: texts for tally in tallies for pid, texts in tally.texts.items()},
    )


_COUNTERS = ("vanished", "permission_denied", "fds", "skipped", "maps_truncated", "maps_denied")


def _scan_shard(request: ScanRequest, key: str, remaining: list[int], deadline: float, stall: float) -> _Tally:
    """One scanner after another over `remaining`: a stalled one is replaced after the process it was stuck on."""
    tally = _Tally([], dict.fromkeys(_COUNTERS, 0), [])
    while remaining:
        outcome = _run_scanner(request, remaining, deadline, stall)
        tally.matches.extend(outcome.matches)
        tally.texts.update(outcome.texts)
        for name in tally.counters:
            tally.counters[name] += outcome.counters.get(name, 0)
        if outcome.finished:
            break
        if not outcome.reaped:
            with _SCAN_LOCKS_GUARD:
                _LINGERING.setdefault(key, []).append((outcome.scanner, remaining[outcome.index]))
        if outcome.stalled:
            why = f"no answer within {stall:g}s (a file on a hung filesystem, or its memory map locked?)"
            tally.unreadable.append(_unreadable(request.proc_dir, remaining[outcome.index], why))
            remaining = remaining[outcome.index + 1 :]
            continue
        tally.unscanned = len(remaining) - outcome.index
        break
    return tally


def _unreadable(proc_dir: str, pid: int, why: str) -> UnreadableProcess:
    comm = ""
    with contextlib.suppress(OSError), open(f"{proc_dir}/{pid}/comm", "rb") as handle:
        comm = handle.read(64).decode("utf-8", "replace").strip()
    return UnreadableProcess(pid, comm, why)


@dataclass
class _Outcome:
    scanner: int
    matches: list[FdMatch]
    counters: dict[str, int]
    finished: bool = False
    stalled: bool = False
    index: int = 0  # position in the pid list the scanner was at when it was stopped
    reaped: bool = True
    texts: dict[int, ProcessTexts] = field(default_factory=dict)


def _run_scanner(request: ScanRequest, pids: list[int], deadline: float, stall: float) -> _Outcome:
    """Fork one scanner over `pids`; read its frames until it ends, stalls, or the deadline passes."""
    progress = mmap.mmap(-1, PROGRESS.size)  # shared with the child: (index in pids, fds read)
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the scanner
        _scanner_main(read_fd, write_fd, progress, request, pids)
    os.close(write_fd)
    outcome = _Outcome(child, [], {})
    try:
        _read_frames(read_fd, progress, outcome, deadline, stall)
    except ScanError:
        try_reap(child, wait_seconds=1.0)  # it exited without its end frame: only its zombie is left
        raise
    finally:
        os.close(read_fd)
    if not outcome.finished:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        outcome.index = PROGRESS.unpack_from(progress, 0)[0]
    outcome.reaped = try_reap(child, wait_seconds=0.05 if not outcome.finished else 1.0)
    progress.close()
    return outcome


_FRAME = struct.Struct("=I")


def _read_frames(fd: int, progress: mmap.mmap, outcome: _Outcome, deadline: float, stall: float) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    buffer = bytearray()
    last_seen, last_change = PROGRESS.unpack_from(progress, 0), time.monotonic()
    while True:
        now = time.monotonic()
        if now >= deadline:
            return
        if poller.poll(max(1, math.ceil(min(deadline - now, 0.05) * 1000))):
            chunk = os.read(fd, 65536)
            if not chunk:
                if not outcome.finished:
                    raise ScanError("the /proc/*/fd scanner died without an answer")
                return
            buffer += chunk
            outcome.finished = _take_frames(buffer, outcome) or outcome.finished
        seen = PROGRESS.unpack_from(progress, 0)
        if seen != last_seen:
            last_seen, last_change = seen, time.monotonic()
        elif not outcome.finished and time.monotonic() - last_change > stall:
            outcome.stalled = True
            return


def _take_frames(buffer: bytearray, outcome: _Outcome) -> bool:
    """Consume the complete frames in `buffer`; True when the last one was the scanner's end."""
    ended = False
    while len(buffer) >= _FRAME.size:
        (size,) = _FRAME.unpack_from(buffer, 0)
        if len(buffer) < _FRAME.size + size:
            break
        frame = pickle.loads(bytes(buffer[_FRAME.size : _FRAME.size + size]))
        del buffer[: _FRAME.size + size]
        outcome.matches.extend(
            FdMatch(p, s, fd, target, tuple(k), via) for p, s, fd, target, k, via in frame["matches"]
        )
        outcome.counters = frame["counters"]
        outcome.texts.update(frame.get("texts") or {})
        ended = bool(frame.get("end"))
    return ended


def _scanner_main(  # pragma: no cover - runs in the forked scanner
    read_fd: int, write_fd: int, progress: mmap.mmap, request: ScanRequest, pids: list[int]
) -> None:
    """The forked scanner: only `os`, `struct`, `pickle` and the preloaded statx; no logging, no locks."""
    status = 0
    try:
        enter_work()  # the children's cgroup, never the agent's quota (probes.runtime.cpulimit)
        os.close(read_fd)
        drop_inherited_fds(write_fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

        def emit(matches: list[tuple[Any, ...]], counters: dict[str, int], end: bool, texts: dict[int, Any]) -> None:
            data = pickle.dumps({"matches": matches, "counters": dict(counters), "end": end, "texts": texts})
            view = memoryview(_FRAME.pack(len(data)) + data)
            while view:
                view = view[os.write(write_fd, view) :]

        scan_fds(request, pids, progress=progress, emit=emit)
    except BaseException:  # noqa: BLE001 - the scanner exits whatever happens; the parent sees no end frame
        status = 1
    finally:
        os._exit(status)
