"""Reading the fd tables of /proc, one process after another: the part of the /proc/*/fd scan that runs
inside a forked scanner (`probes.runtime.fdscan` forks, watches and replaces the scanners).

Pure `os`, `struct` and the statx(2) loaded here at import: a forked scanner may take no lock, log nothing and
import nothing. Each fd is read with readlink (procfs answers that itself, whatever the file is on) and, when
its target could be one that is wanted, with statx(AT_STATX_DONT_SYNC), which FUSE and NFS answer from the
inode cache without asking their server. A device scan (only device numbers wanted) needs no link text to
decide: one statx per fd, and the readlink only for a wanted device; it also reads each process's mappings
(`probes.runtime.mapscan`). Progress goes to shared memory (`PROGRESS`), findings to `emit`.

A process whose main thread called pthread_exit() keeps its fds and mappings in its other threads, while
/proc/PID/fd and /proc/PID/maps of its leader (a zombie) read empty: for a process whose fd table reads empty,
and only then, the leader's state is read (`live_task`), and when it is a zombie with live threads, the fds,
maps and cmdline of one live thread (/proc/TID, which has map_files as /proc/PID/task/TID has not) are read
instead. No other process costs a read more.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import stat
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probes.runtime.mapscan import MappedDevices
from probes.runtime.procstat import parse_stat, state_of


def list_pids(proc: Path) -> list[int]:
    return sorted(int(name) for name in os.listdir(proc) if name.isdigit())


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


def live_task(proc_dir: str, pid: int) -> int | None:
    """A live thread of `pid` when its leader has exited (zombie) and other threads still run, else None.

    Only the leader's stat is read for any other process (a kernel thread or a process without fds, the only
    others whose fd table reads empty); /proc/PID/status (Threads) and the task list only for a zombie."""
    try:
        with open(f"{proc_dir}/{pid}/stat", "rb") as handle:
            if state_of(handle.read(4096).decode("utf-8", "replace")) != "Z":
                return None
        with open(f"{proc_dir}/{pid}/status", "rb") as handle:
            status = handle.read(_TEXT_LIMIT)
        at = status.find(b"\nThreads:")
        if at < 0 or int(status[at + 9 : status.find(b"\n", at + 1)].strip() or b"0") < 2:
            return None  # a plain zombie: its thread group is gone with it
        for name in os.listdir(f"{proc_dir}/{pid}/task"):
            if name.isdigit() and int(name) != pid:
                with contextlib.suppress(OSError), open(f"{proc_dir}/{pid}/task/{name}/stat", "rb") as handle:
                    if state_of(handle.read(4096).decode("utf-8", "replace")) not in ("Z", "X", ""):
                        return int(name)
    except (OSError, ValueError):
        return None  # exited meanwhile
    return None


# /proc/PID/{stat,cgroup,status} as text and /proc/PID/cmdline as bytes (None when it could not be read).
ProcessTexts = tuple[str, str, str, bytes | None]


@dataclass(frozen=True)
class ScanRequest:
    """What one scan looks for, and where."""

    proc_dir: str
    rdevs: frozenset[int]
    inodes: frozenset[tuple[int, int]]
    sockets: frozenset[int]
    use_statx: bool
    dev_prefixes: tuple[str, ...]
    # Also match the device nodes each process has mapped (/proc/PID/maps), for holders that closed the fd.
    mappings: bool = False


# Shared with the forked scanner: (index in its pid list, fds read so far), so a stall is seen from outside.
PROGRESS = struct.Struct("=qq")


_DENIED = (errno.EACCES, errno.EPERM)
# A scanner flushes what it found at least every this many processes (and whenever it found something).
_FLUSH_EVERY = 64


def scan_fds(
    request: ScanRequest,
    pids: Sequence[int],
    progress: mmap.mmap | None = None,
    emit: Callable[[list[tuple[Any, ...]], dict[str, int], bool, dict[int, Any]], None] | None = None,
) -> dict[str, Any]:
    """Scan the fds of `pids` (pure `os`; runs in a scanner, or in-process for benchmarks and tests).

    Returns {"matches": [(pid, start_time, fd, target, key, via)], "texts": {pid: ProcessTexts}, "vanished",
    "permission_denied", "processes", "fds", "skipped", "maps_truncated", "maps_denied"}; `via` is "fd", or
    "mmap" for a device node the process has mapped (fd -1). With `emit`, hands over what it found in frames as
    it goes (cumulative counters). A process's fd matches are handed over before its maps and texts are read,
    so a maps or cmdline read that blocks (its mmap lock held) stalls the scanner without losing the match.
    """
    reader = _FdReader(request)
    pending: list[tuple[Any, ...]] = []
    found: list[tuple[Any, ...]] = []
    texts: dict[int, Any] = {}

    def hand_over(new: dict[int, Any]) -> None:
        if emit is not None:
            emit([], reader.counters, False, new)

    def flush() -> None:
        nonlocal pending
        if emit is not None:
            emit(pending, reader.counters, False, {})
        found.extend(pending)
        pending = []

    for index, pid in enumerate(pids):
        if progress is not None:
            PROGRESS.pack_into(progress, 0, index, reader.counters["fds"])
        matches = reader.process(pid, progress, index)
        pending.extend(matches)
        if request.mappings:
            if matches:
                flush()
            mapped = reader.mapped(pid, matches)
            pending.extend(mapped)
            matches = matches + mapped
        if emit is not None and (matches or index % _FLUSH_EVERY == _FLUSH_EVERY - 1):
            flush()
        if matches:
            _read_texts(request.proc_dir, pid, texts, hand_over, reader.where(pid))
    found.extend(pending)
    if emit is not None:
        emit(pending, reader.counters, True, {})
    return {"matches": found, "texts": texts, **reader.counters, "processes": reader.processes}


def _read_texts(
    proc_dir: str,
    pid: int,
    texts: dict[int, Any],
    hand_over: Callable[[dict[int, Any]], None],
    where: tuple[str, int],
) -> None:
    """stat, cgroup and status first (procfs answers them without the process's locks), handed over; then
    the cmdline (from `where`: a live thread's when the leader has exited, whose own reads empty), which may
    block on the process's mmap lock, handed over when it comes."""
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
    with contextlib.suppress(OSError), open(f"{where[0]}/{where[1]}/cmdline", "rb") as handle:
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
    mappings: bool = False,
) -> dict[str, Any]:
    """Every process of `proc_dir` scanned in this process, with no scanner and no deadline (benchmarks, tests)."""
    request = ScanRequest(proc_dir, rdevs, inodes, sockets, use_statx and STATX_AVAILABLE, ("/dev/",), mappings)
    return scan_fds(request, list_pids(Path(proc_dir)))


_DENIED_FD = object()


class _FdReader:
    """Reads one process's fd table after another; counts what vanished or was refused."""

    def __init__(self, request: ScanRequest) -> None:
        self.request = request
        self.counters = {"vanished": 0, "permission_denied": 0, "fds": 0, "skipped": 0}
        self.processes = 0
        self.tasks: dict[int, int] = {}  # pid → the live thread read for it: its leader has exited
        self.self_pid = os.getpid()
        self.statx = _STATX if request.use_statx else None
        self.buffer = ctypes.create_string_buffer(_STATX_SIZE)
        self.want_stat = bool(request.rdevs or request.inodes)
        # Without statx a stat may block on a hung mount: a device scan then stats only device paths.
        self.dev_only = self.statx is None and not request.inodes
        # A device scan with statx needs no link text to decide: one statx per fd, a readlink only for a match.
        self.devices_by_statx = (
            self.statx is not None and bool(request.rdevs) and not (request.inodes or request.sockets)
        )
        self.rdev_pairs = {(os.major(rdev), os.minor(rdev)) for rdev in request.rdevs}
        self.mode_high = memoryview(self.buffer).cast("B")  # the statx answer, byte by byte
        self.counters.update(maps_truncated=0, maps_denied=0)
        prefixes = tuple(p.encode() for p in request.dev_prefixes) if self.statx is None else None
        self.maps = MappedDevices(request.rdevs, self._stat_mode, prefixes, self.counters)

    def process(self, pid: int, progress: mmap.mmap | None, index: int) -> list[tuple[Any, ...]]:
        if pid == self.self_pid:
            return []
        self.processes += 1
        proc_dir = self.request.proc_dir
        found, refused, listed = self._fd_table(f"{proc_dir}/{pid}/fd", progress, index)
        if listed == 0:  # nothing open, a kernel thread, or a leader that exited before its threads
            task = live_task(proc_dir, pid)
            if task is not None:
                self.tasks[pid] = task
                found, refused, _listed = self._fd_table(f"{proc_dir}/{task}/fd", progress, index)
        if refused:
            self.counters["permission_denied"] += 1
        if not found:
            return []
        start = _start_time_or_none(proc_dir, pid)
        if start is None:
            self.counters["vanished"] += 1
            return []
        return [(pid, start, *match, "fd") for match in found]

    def where(self, pid: int) -> tuple[str, int]:
        """(/proc, id) whose /proc/ID holds the fd table, maps and cmdline to read for `pid`: the PID, or a live
        thread's TID when the leader has exited (`live_task`). /proc/TID, not /proc/PID/task/TID: only the
        former has map_files."""
        return self.request.proc_dir, self.tasks.get(pid, pid)

    def _fd_table(self, path: str, progress: mmap.mmap | None, index: int) -> tuple[list[tuple[Any, ...]], bool, int]:
        """(wanted fds, whether some fd was refused, fds listed: -1 when the table could not be read) of one fd
        directory."""
        try:
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            self._count_error(exc)
            return [], False, -1
        found: list[tuple[Any, ...]] = []
        refused = False
        try:
            try:
                entries = os.listdir(dir_fd)
            except OSError as exc:
                self._count_error(exc)
                return [], False, -1
            if self.devices_by_statx:
                refused = self._device_fds(dir_fd, entries, found, progress, index)
            else:
                for entry in entries:
                    self.counters["fds"] += 1
                    if progress is not None and not self.counters["fds"] & 255:
                        PROGRESS.pack_into(progress, 0, index, self.counters["fds"])
                    match = self._entry(dir_fd, entry)
                    if match is _DENIED_FD:
                        refused = True
                    elif match is not None:
                        found.append(match)  # type: ignore[arg-type]
        finally:
            os.close(dir_fd)
        return found, refused, len(entries)

    def mapped(self, pid: int, fd_matches: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """(pid, start_time, -1, path, ("rdev", rdev), "mmap") per wanted device node `pid` has mapped and does
        not also hold by an fd."""
        if pid == self.self_pid or not self.request.rdevs:
            return []
        held = {match[4][1] for match in fd_matches if match[4][0] == "rdev"}
        mapped = [(path, rdev) for path, rdev in self.maps.find(*self.where(pid)) if rdev not in held]
        if not mapped:
            return []
        start = fd_matches[0][1] if fd_matches else _start_time_or_none(self.request.proc_dir, pid)
        if start is None:
            return []
        return [(pid, start, -1, path, ("rdev", rdev), "mmap") for path, rdev in mapped]

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

    def _device_fds(
        self, dir_fd: int, entries: list[str], found: list[tuple[Any, ...]], progress: mmap.mmap | None, index: int
    ) -> bool:
        """A device scan's fd table: one statx per fd (from the inode cache, whatever the fd is: a socket, a pipe,
        a file on a hung mount), the link text only of a wanted device. The scan's hot loop, one turn per fd on
        the host: the call and one byte of its answer (the file type) for any fd that is no character device.
        True when some fd may not be read."""
        statx, buffer, mode_high = self.statx, self.buffer, self.mode_high
        assert statx is not None  # devices_by_statx
        refused = False
        counted = self.counters["fds"]
        for offset in range(0, len(entries), _PROGRESS_EVERY):
            if progress is not None and offset:
                PROGRESS.pack_into(progress, 0, index, counted + offset)
            for entry in entries[offset : offset + _PROGRESS_EVERY]:
                if statx(dir_fd, entry.encode(), AT_STATX_DONT_SYNC, _STATX_TYPE_AND_INO, buffer) != 0:
                    if ctypes.get_errno() in _DENIED:
                        refused = True
                    else:
                        self.counters["vanished"] += 1
                elif mode_high[_STATX_MODE_HIGH_BYTE] & 0xF0 == _S_IFCHR_HIGH:
                    self._device_fd(dir_fd, entry, found)
        self.counters["fds"] = counted + len(entries)
        return refused

    def _device_fd(self, dir_fd: int, entry: str, found: list[tuple[Any, ...]]) -> None:
        """A character device fd (statx just filled the buffer): kept when it is a wanted one."""
        _mode, rdev_major, rdev_minor = _STATX_MODE_RDEV.unpack_from(self.buffer)
        if (rdev_major, rdev_minor) not in self.rdev_pairs:
            return
        try:
            found.append((int(entry), os.readlink(entry, dir_fd=dir_fd), ("rdev", os.makedev(rdev_major, rdev_minor))))
        except OSError:
            self.counters["vanished"] += 1

    def _stat_mode(self, dir_fd: int, entry: str) -> tuple[int, int]:
        mode, rdev, _dev, _ino = self._stat(dir_fd, entry)
        return mode, rdev

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
_STATX_MODE_RDEV = struct.Struct("=28xH98x2I")  # stx_mode, stx_rdev_major, stx_rdev_minor
# stx_mode is little- or big-endian as the machine: the byte holding the file type bits (S_IFMT) of it.
_STATX_MODE_HIGH_BYTE = 29 if sys.byteorder == "little" else 28
_S_IFCHR_HIGH = stat.S_IFCHR >> 8
_PROGRESS_EVERY = 256


def _start_time_or_none(proc_dir: str, pid: int) -> int | None:
    try:
        with open(f"{proc_dir}/{pid}/stat", "rb") as handle:
            text = handle.read().decode("utf-8", "replace")
        return parse_stat(text).start_time
    except (OSError, ValueError):
        return None
