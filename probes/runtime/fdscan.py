"""One pass over every /proc/*/fd of the host: who holds a device, a file or a socket open.

Each fd is read with readlink (procfs answers that itself, whatever the file is on) and, when its target could
be one that is wanted, with statx(AT_STATX_DONT_SYNC): FUSE and NFS then answer from the inode cache without
asking their server, so a file on a hung mount cannot block the scan (a plain stat(2) of it sleeps in D state).
Character devices match by st_rdev (a container's /dev/davinci0 is a different inode with the same
major:minor, which `fuser` on the host path misses), regular files by (st_dev, st_ino), sockets by the
`socket:[N]` link text without any stat.

The scan runs in forked scanners, never on an agent thread. A scanner reports its progress through shared
memory and its findings through a pipe as it goes; one that makes no progress for a while (a filesystem that
ignores AT_STATX_DONT_SYNC, or a kernel without statx) is killed, the process it was reading is named as
unreadable, and a new scanner carries on after it: what was read is kept, and one bad mount blinds nothing else.
The scanner also reads the /proc texts of each process it matched (`ScanResult.texts`), the cmdline last: that
read waits while the process's mmap lock is held, and must not happen on an agent thread.
"""

# Size: temporary: being brought under 500 lines (the helpers it shares with holders.py move out); do not grow it.

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import mmap
import os
import pickle
import select
import signal
import stat
import struct
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probes.runtime.host import try_reap

if TYPE_CHECKING:
    from probes.runtime.host import Host

# --- /proc/PID/stat --------------------------------------------------------------------------------


def parse_stat(text: str) -> tuple[str, list[str]]:
    """/proc/PID/stat → (comm, fields from field 3 on). comm may hold spaces and ')': split at the last ')'."""
    open_paren = text.find("(")
    close_paren = text.rfind(")")
    if open_paren < 0 or close_paren < open_paren:
        raise ValueError(f"not a /proc/PID/stat line: {text[:80]!r}")
    return text[open_paren + 1 : close_paren], text[close_paren + 1 :].split()


def parse_start_time(text: str) -> int:
    """Field 22 (starttime) of a /proc/PID/stat line."""
    _, rest = parse_stat(text)
    if len(rest) < 20:
        raise ValueError(f"/proc/PID/stat has {len(rest) + 2} fields, need 22")
    return int(rest[19])  # rest[0] is field 3


def list_pids(proc: Path) -> list[int]:
    return sorted(int(name) for name in os.listdir(proc) if name.isdigit())


# --- open-file scan --------------------------------------------------------------------------------

# statx(2) with AT_STATX_DONT_SYNC answers from the inode cache: FUSE and NFS do not ask their server, so a
# hung mount cannot block it. Loaded once here; a forked scanner only calls it.
_AT_FDCWD = -100
AT_STATX_DONT_SYNC = 0x4000
_STATX_TYPE_AND_INO = 0x1 | 0x100
_STATX_SIZE = 256


def _load_statx() -> Any:
    try:
        function = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):  # glibc before 2.28
        return None
    # No argtypes: ctypes passes ints as C ints and bytes and buffers as pointers, which is what statx takes,
    # and the per-call conversion argtypes adds costs more than the call (the scan makes one per fd).
    function.restype = ctypes.c_int
    if function(_AT_FDCWD, b"/", 0, _STATX_TYPE_AND_INO, ctypes.create_string_buffer(_STATX_SIZE)) != 0:
        return None  # ENOSYS: a kernel before 4.11
    return function


_STATX = _load_statx()
STATX_AVAILABLE = _STATX is not None


class ScanError(Exception):
    """The scan of /proc/*/fd could not be done (no /proc, the scanner failed); the check is unknown."""


class ScanTimeout(ScanError):
    """The scan did not finish by its deadline, or too many earlier scanners are still stuck."""


@dataclass(frozen=True)
class FdMatch:
    pid: int
    start_time: int
    fd: int
    target: str  # readlink text of /proc/PID/fd/N, as the holder's mount namespace names it
    key: tuple[Any, ...]  # ("rdev", rdev) | ("inode", st_dev, st_ino) | ("socket", inode)


@dataclass(frozen=True)
class UnreadableProcess:
    """A process whose open files could not be read: its scanner got no answer (a hung filesystem)."""

    pid: int
    comm: str
    why: str


# /proc/PID/{stat,cgroup,status} as text and /proc/PID/cmdline as bytes (None when it could not be read).
ProcessTexts = tuple[str, str, str, bytes | None]


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
        parts = [f"PID {p.pid} ({p.comm or '?'}): {p.why}" for p in self.unreadable[:3]]
        if len(self.unreadable) > 3:
            parts.append(f"{len(self.unreadable) - 3} more unreadable")
        if self.unscanned:
            parts.append(f"{self.unscanned} processes not reached before the deadline")
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
) -> ScanResult:
    """One pass over every /proc/*/fd of the host, in forked scanners bounded by `timeout`.

    Each fd is readlink'ed (procfs answers that itself) and, when its target could be wanted, stat'ed with
    statx(AT_STATX_DONT_SYNC), so a hung FUSE/NFS mount does not block it; without statx only targets under
    a dev dir are stat'ed for a device scan. A scanner that makes no progress for `stall_seconds` anyway
    is killed, the process it was on is named in `unreadable`, and a new scanner goes on after it.

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
        request = _ScanRequest(
            str(host.proc),
            frozenset(int(r) for r in rdevs),
            frozenset((int(d), int(i)) for d, i in inodes),
            frozenset(int(s) for s in sockets),
            use_statx and STATX_AVAILABLE,
            ("/dev/", str(host.dev).rstrip("/") + "/"),
        )
        stall = stall_seconds if stall_seconds is not None else min(2.0, max(0.25, timeout / 4))
        result = _scan_all(request, key, deadline, stall, started)
    finally:
        lock.release()
    if not result.complete and not partial:
        raise ScanTimeout(f"scan of {host.proc}/*/fd incomplete within {timeout:g}s: {result.shortfall()}")
    return result


@dataclass(frozen=True)
class _ScanRequest:
    proc_dir: str
    rdevs: frozenset[int]
    inodes: frozenset[tuple[int, int]]
    sockets: frozenset[int]
    use_statx: bool
    dev_prefixes: tuple[str, ...]


@dataclass
class _Tally:
    matches: list[FdMatch]
    counters: dict[str, int]
    unreadable: list[UnreadableProcess]
    texts: dict[int, ProcessTexts] = field(default_factory=dict)


def _scan_all(request: _ScanRequest, key: str, deadline: float, stall: float, started: float) -> ScanResult:
    try:
        pids = list_pids(Path(request.proc_dir))
    except OSError as exc:
        raise ScanError(f"scan of {request.proc_dir}/*/fd failed: cannot list {request.proc_dir}: {exc}") from None
    lingering = lingering_scanners(key)
    if len(lingering) >= MAX_LINGERING_SCANNERS:
        raise ScanTimeout(f"scan of {request.proc_dir}/*/fd: {len(lingering)} earlier scanners still stuck")
    with _SCAN_LOCKS_GUARD:
        avoided = {stuck for _, stuck in _LINGERING.get(key, [])}
    tally = _Tally([], {"vanished": 0, "permission_denied": 0, "fds": 0, "skipped": 0}, [])
    for pid in avoided & set(pids):
        tally.unreadable.append(_unreadable(request.proc_dir, pid, "an earlier scanner is still stuck on it"))
    remaining = [pid for pid in pids if pid not in avoided]
    unscanned = 0
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
            why = f"no answer within {stall:g}s (a file on a hung filesystem?)"
            tally.unreadable.append(_unreadable(request.proc_dir, remaining[outcome.index], why))
            remaining = remaining[outcome.index + 1 :]
            continue
        unscanned = len(remaining) - outcome.index
        break
    return ScanResult(
        matches=tuple(tally.matches),
        vanished=tally.counters["vanished"],
        permission_denied=tally.counters["permission_denied"],
        processes=len(pids) - unscanned - len(tally.unreadable),
        fds=tally.counters["fds"],
        duration=time.monotonic() - started,
        unreadable=tuple(tally.unreadable),
        unscanned=unscanned,
        skipped=tally.counters["skipped"],
        texts=tally.texts,
    )


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


def _run_scanner(request: _ScanRequest, pids: list[int], deadline: float, stall: float) -> _Outcome:
    """Fork one scanner over `pids`; read its frames until it ends, stalls, or the deadline passes."""
    progress = mmap.mmap(-1, _PROGRESS.size)  # shared with the child: (index in pids, fds read)
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
        outcome.index = _PROGRESS.unpack_from(progress, 0)[0]
    outcome.reaped = try_reap(child, wait_seconds=0.05 if not outcome.finished else 1.0)
    progress.close()
    return outcome


_PROGRESS = struct.Struct("=qq")
_FRAME = struct.Struct("=I")


def _read_frames(fd: int, progress: mmap.mmap, outcome: _Outcome, deadline: float, stall: float) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    buffer = bytearray()
    last_seen, last_change = _PROGRESS.unpack_from(progress, 0), time.monotonic()
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
        seen = _PROGRESS.unpack_from(progress, 0)
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
        outcome.matches.extend(FdMatch(p, s, fd, target, tuple(k)) for p, s, fd, target, k in frame["matches"])
        outcome.counters = frame["counters"]
        outcome.texts.update(frame.get("texts") or {})
        ended = bool(frame.get("end"))
    return ended


def _scanner_main(  # pragma: no cover - runs in the forked scanner
    read_fd: int, write_fd: int, progress: mmap.mmap, request: _ScanRequest, pids: list[int]
) -> None:
    """The forked scanner: only `os`, `struct`, `pickle` and the preloaded statx; no logging, no locks."""
    status = 0
    try:
        os.close(read_fd)
        _drop_inherited_fds(write_fd)
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


def _drop_inherited_fds(keep: int) -> None:
    """A scanner stuck on a hung mount may live long: it must hold none of the agent's descriptors."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))


_DENIED = (errno.EACCES, errno.EPERM)
# A scanner flushes what it found at least every this many processes (and whenever it found something).
_FLUSH_EVERY = 64


def scan_fds(
    request: _ScanRequest,
    pids: Sequence[int],
    progress: mmap.mmap | None = None,
    emit: Callable[[list[tuple[Any, ...]], dict[str, int], bool, dict[int, Any]], None] | None = None,
) -> dict[str, Any]:
    """Scan the fds of `pids` (pure `os`; runs in a scanner, or in-process for benchmarks and tests).

    Returns {"matches": [(pid, start_time, fd, target, key)], "texts": {pid: ProcessTexts}, "vanished",
    "permission_denied", "processes", "fds", "skipped"}; with `emit`, hands over what it found in frames as it
    goes (cumulative counters). A process's matches are handed over before its texts are read, so a cmdline
    that blocks (its mmap lock held) stalls the scanner without losing the match.
    """
    reader = _FdReader(request)
    pending: list[tuple[Any, ...]] = []
    found: list[tuple[Any, ...]] = []
    texts: dict[int, Any] = {}

    def hand_over(new: dict[int, Any]) -> None:
        if emit is not None:
            emit([], reader.counters, False, new)

    for index, pid in enumerate(pids):
        if progress is not None:
            _PROGRESS.pack_into(progress, 0, index, reader.counters["fds"])
        matches = reader.process(pid, progress, index)
        pending.extend(matches)
        if emit is not None and (matches or index % _FLUSH_EVERY == _FLUSH_EVERY - 1):
            emit(pending, reader.counters, False, {})
            found.extend(pending)
            pending = []
        if matches:
            _read_texts(request.proc_dir, pid, texts, hand_over)
    found.extend(pending)
    if emit is not None:
        emit(pending, reader.counters, True, {})
    return {"matches": found, "texts": texts, **reader.counters, "processes": reader.processes}


def _read_texts(proc_dir: str, pid: int, texts: dict[int, Any], hand_over: Callable[[dict[int, Any]], None]) -> None:
    """stat, cgroup and status first (procfs answers them without the process's locks), handed over; then
    the cmdline, which may block on the process's mmap lock, handed over when it comes."""
    parts: list[str] = []
    try:
        for name in ("stat", "cgroup", "status"):
            with open(f"{proc_dir}/{pid}/{name}", "rb") as handle:
                parts.append(handle.read(_TEXT_LIMIT).decode("utf-8", "replace"))
    except OSError:
        return  # exited: the parent finds its start time gone
    texts[pid] = (*parts, None)
    hand_over({pid: texts[pid]})
    cmdline: bytes | None = None
    with contextlib.suppress(OSError), open(f"{proc_dir}/{pid}/cmdline", "rb") as handle:
        cmdline = handle.read(_CMDLINE_LIMIT)
    if cmdline is not None:
        texts[pid] = (*parts, cmdline)
        hand_over({pid: texts[pid]})


_TEXT_LIMIT = 64 * 1024
_CMDLINE_LIMIT = 4096


def scan_in_process(
    proc_dir: str,
    rdevs: frozenset[int],
    inodes: frozenset[tuple[int, int]],
    sockets: frozenset[int],
    use_statx: bool = True,
) -> dict[str, Any]:
    """Every process of `proc_dir` scanned in this process, with no scanner and no deadline (benchmarks, tests)."""
    request = _ScanRequest(proc_dir, rdevs, inodes, sockets, use_statx and STATX_AVAILABLE, ("/dev/",))
    return scan_fds(request, list_pids(Path(proc_dir)))


_DENIED_FD = object()


class _FdReader:
    """Reads one process's fd table after another; counts what vanished or was refused."""

    def __init__(self, request: _ScanRequest) -> None:
        self.request = request
        self.counters = {"vanished": 0, "permission_denied": 0, "fds": 0, "skipped": 0}
        self.processes = 0
        self.self_pid = os.getpid()
        self.statx = _STATX if request.use_statx else None
        self.buffer = ctypes.create_string_buffer(_STATX_SIZE)
        self.want_stat = bool(request.rdevs or request.inodes)
        # Without statx a stat may block on a hung mount: a device scan then stats only device paths.
        self.dev_only = self.statx is None and not request.inodes

    def process(self, pid: int, progress: mmap.mmap | None, index: int) -> list[tuple[Any, ...]]:
        if pid == self.self_pid:
            return []
        self.processes += 1
        try:
            dir_fd = os.open(f"{self.request.proc_dir}/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            self._count_error(exc)
            return []
        found: list[tuple[Any, ...]] = []
        refused = False
        try:
            try:
                entries = os.listdir(dir_fd)
            except OSError as exc:
                self._count_error(exc)
                return []
            for entry in entries:
                self.counters["fds"] += 1
                if progress is not None and not self.counters["fds"] & 255:
                    _PROGRESS.pack_into(progress, 0, index, self.counters["fds"])
                match = self._entry(dir_fd, entry)
                if match is _DENIED_FD:
                    refused = True
                elif match is not None:
                    found.append(match)  # type: ignore[arg-type]
        finally:
            os.close(dir_fd)
        if refused:
            self.counters["permission_denied"] += 1
        if not found:
            return []
        start = _start_time_or_none(self.request.proc_dir, pid)
        if start is None:
            self.counters["vanished"] += 1
            return []
        return [(pid, start, *match) for match in found]

    def _count_error(self, exc: OSError) -> None:
        self.counters["permission_denied" if exc.errno in _DENIED else "vanished"] += 1

    def _entry(self, dir_fd: int, entry: str) -> tuple[Any, ...] | object | None:
        """(fd, target, key) when the fd is one that is wanted, _DENIED_FD when it may not be read."""
        request = self.request
        try:
            target = os.readlink(entry, dir_fd=dir_fd)  # procfs answers this itself: it never blocks
        except OSError as exc:
            if exc.errno in _DENIED:
                return _DENIED_FD
            self.counters["vanished"] += 1
            return None
        if target.startswith("socket:["):
            inode = int(target[8:-1]) if target[8:-1].isdigit() else None
            if inode is not None and inode in request.sockets:
                return (int(entry), target, ("socket", inode))
            return None
        # pipe:[N], anon_inode:[eventfd], net:[N], mnt:[N] ... name no file we could want.
        if not self.want_stat or not target.startswith("/"):
            return None
        if self.dev_only and not target.startswith(request.dev_prefixes):
            self.counters["skipped"] += 1
            return None
        try:
            mode, rdev, dev, ino = self._stat(dir_fd, entry)
        except OSError as exc:
            if exc.errno in _DENIED:
                return _DENIED_FD
            self.counters["vanished"] += 1
            return None
        if request.rdevs and stat.S_ISCHR(mode) and rdev in request.rdevs:
            return (int(entry), target, ("rdev", rdev))
        if request.inodes and (dev, ino) in request.inodes:
            return (int(entry), target, ("inode", dev, ino))
        return None

    def _stat(self, dir_fd: int, entry: str) -> tuple[int, int, int, int]:
        """(mode, rdev, dev, inode) of the file an fd is open on, from the inode cache when statx exists."""
        if self.statx is None:
            st = os.stat(entry, dir_fd=dir_fd)
            return st.st_mode, st.st_rdev, st.st_dev, st.st_ino
        if self.statx(dir_fd, entry.encode(), AT_STATX_DONT_SYNC, _STATX_TYPE_AND_INO, self.buffer) != 0:
            number = ctypes.get_errno()
            raise OSError(number, os.strerror(number))
        mode, ino, rdev_major, rdev_minor, dev_major, dev_minor = _STATX_FIELDS.unpack_from(self.buffer)
        return mode, os.makedev(rdev_major, rdev_minor), os.makedev(dev_major, dev_minor), ino


# struct statx (the kernel's uapi stat.h): stx_mode at 28, stx_ino at 32, rdev and dev major:minor at 128.
_STATX_FIELDS = struct.Struct("=28xH2xQ88x4I")


def _start_time_or_none(proc_dir: str, pid: int) -> int | None:
    try:
        with open(f"{proc_dir}/{pid}/stat", "rb") as handle:
            text = handle.read().decode("utf-8", "replace")
        return parse_start_time(text)
    except (OSError, ValueError):
        return None
