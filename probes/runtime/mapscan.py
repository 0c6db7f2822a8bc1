"""Device nodes a process has mapped: /proc/PID/maps, read inside the forked /proc scanner.

A process can open a device node, mmap it and close the fd: it still holds the device (the Ascend and NVIDIA
runtimes keep such mappings), and its fd table no longer shows it. /proc/PID/maps lists every mapping as
`start-end perms offset major:minor inode path`, where major:minor is the device of the *filesystem* the
mapped file lives on (devtmpfs, a container's /dev tmpfs), not the device number of the node (proc(5)). So
a mapping is matched by the node's device number through /proc/PID/map_files/<start-end>, a link to the mapped
file whose statx (AT_STATX_DONT_SYNC, from the inode cache) gives its st_mode and st_rdev: a container's own
/dev/davinci0 counts, wherever it was mknod'ed. One statx per distinct (filesystem, inode) per scanner: the
answer is kept for the rest of the scan, so a library mapped by a thousand processes is looked at once.

What it cannot see: a driver whose mmap replaces the mapped file (a shared mapping of /dev/zero becomes
`/dev/zero (deleted)` on shmem) and mappings past the first MAPS_LIMIT bytes of a process's maps (counted).
Reading map_files needs CAP_SYS_ADMIN (or CAP_CHECKPOINT_RESTORE); without it no mapping can be matched and
the processes are counted as permission denied. Pure `os` and `re`: it runs in a forked scanner.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

# At most this much of one process's maps is read (~20,000 mappings); a longer one is counted as truncated.
MAPS_LIMIT = 2 << 20
# The `major:minor inode` of each line that maps a file (a non-zero inode: anonymous memory, [heap], [stack] and
# [vdso] have none). Anchored at the newline before the line (the kernel escapes newlines inside paths), so a
# file name cannot pose as a mapping; a literal first character keeps the scan fast (maps texts are long).
_FILE_KEY = re.compile(rb"\n[^ ]++ [^ ]++ [^ ]++ ([^ ]++ [1-9][0-9]*+) ")  # possessive: no backtracking
_DENIED = (errno.EACCES, errno.EPERM)


def read_maps(proc_dir: str, pid: int, buffer: bytearray) -> tuple[int, bool]:
    """Read /proc/PID/maps into `buffer` after its first byte (kept a newline, so every line follows one):
    (bytes read, whether there was more than fits). procfs hands the text over a page or so per read; the
    read takes the process's mmap lock, so a scanner may stall here (it is watched)."""
    view = memoryview(buffer)
    size = 1
    fd = os.open(f"{proc_dir}/{pid}/maps", os.O_RDONLY)
    try:
        while size < len(buffer):
            count = os.readv(fd, [view[size:]])
            if not count:
                return size, False
            size += count
        return size, bool(os.read(fd, 1))
    finally:
        os.close(fd)


# statx of a path relative to a directory fd → (mode, rdev); raises OSError.
StatMode = Callable[[int, str], tuple[int, int]]


@dataclass
class MappedDevices:
    """Finds the wanted device nodes among one process's mappings after another, remembering per scanner what
    each mapped file (by filesystem and inode) is."""

    rdevs: Collection[int]
    stat_mode: StatMode
    dev_prefixes: tuple[bytes, ...] | None = None  # without statx: only paths under a dev dir are stat'ed
    counters: dict[str, int] = field(default_factory=lambda: {"maps_truncated": 0, "maps_denied": 0})
    _rdev_of: dict[bytes, int | None] = field(default_factory=dict)  # b"major:minor inode" → rdev or None
    _unwanted: set[bytes] = field(default_factory=set)  # the keys of files that are no wanted device
    _map_files_refused: bool = False  # EPERM: no capability to follow map_files, for any process
    # One buffer for every process's maps (read into, never copied): a newline, then the text.
    _buffer: bytearray = field(default_factory=lambda: bytearray(b"\n" + bytes(MAPS_LIMIT)))

    def find(self, proc_dir: str, pid: int) -> list[tuple[str, int]]:
        """(path as the process names it, device number) of each wanted device node `pid` has mapped."""
        if self._map_files_refused:
            self.counters["maps_denied"] += 1
            return []
        text = self._buffer
        try:
            size, truncated = read_maps(proc_dir, pid, text)
        except OSError as exc:
            if exc.errno in _DENIED:
                self.counters["maps_denied"] += 1
            return []  # ENOENT/ESRCH: exited; its fd table said so already
        self.counters["maps_truncated"] += truncated
        # Each mapped file once (a library has several mappings); the files known to be no wanted device (nearly
        # all, after the first processes) are dropped in one set difference.
        listed = _FILE_KEY.findall(text, 0, size)
        if self._unwanted.issuperset(listed):
            return []
        keys = set(listed) - self._unwanted
        found: dict[int, str] = {}
        map_files: int | None = None
        try:
            for key in keys:
                if key not in self._rdev_of:
                    line = _line_of(text, size, key)
                    if line is None:
                        continue
                    if map_files is None:
                        map_files = os.open(f"{proc_dir}/{pid}/map_files", os.O_RDONLY | os.O_DIRECTORY)
                    rdev = self._lookup(map_files, *line)
                    if rdev == -1:
                        continue  # unmapped meanwhile, or refused: not remembered
                    self._rdev_of[key] = rdev
                    if rdev is None or rdev not in self.rdevs:
                        self._unwanted.add(key)
                rdev = self._rdev_of[key]
                if rdev is not None and rdev in self.rdevs and rdev not in found:
                    line = _line_of(text, size, key)
                    found[rdev] = os.fsdecode(line[1]) if line else "?"
        except OSError as exc:  # map_files itself: the process exited, or it may not be read
            if exc.errno in _DENIED:
                self.counters["maps_denied"] += 1
        finally:
            if map_files is not None:
                os.close(map_files)
        return [(path, rdev) for rdev, path in found.items()]

    def _lookup(self, map_files: int, span: bytes, path: bytes) -> int | None:
        """The device number of a mapped character device, None for any other file, -1 when not known."""
        if self.dev_prefixes is not None and not path.startswith(self.dev_prefixes):
            return None  # no statx: a stat of a file on a hung mount would block; device nodes live in /dev
        try:
            mode, rdev = self.stat_mode(map_files, span.decode())
        except OSError as exc:
            if exc.errno == errno.EPERM:
                self._map_files_refused = True
                self.counters["maps_denied"] += 1
            return -1
        return rdev if stat.S_ISCHR(mode) else None


def _line_of(text: bytearray, size: int, key: bytes) -> tuple[bytes, bytes] | None:
    """(start-end, path) of the first line of `text[:size]` (maps after a newline) that maps the file `key`;
    an occurrence of the key inside a file name is passed over."""
    needle = b" " + key + b" "
    at = text.find(needle, 0, size)
    while at != -1:
        start = text.rfind(b"\n", 0, at) + 1
        end = text.find(b"\n", at, size)
        fields = bytes(text[start : end if end != -1 else size]).split(None, 5)
        if len(fields) >= 5 and fields[3] + b" " + fields[4] == key:
            return fields[0], fields[5] if len(fields) > 5 else b""
        at = text.find(needle, at + 1, size)
    return None
