"""Lock files: /proc/locks, lock styles, listing lock files in a child, and removing one safely."""

from __future__ import annotations

import errno
import fnmatch
import glob
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from probes.base import ProbeParseError
from probes.runtime.paths import normalize_host_path


@dataclass(frozen=True)
class LockRecord:
    """One whole-file lock from /proc/locks (proc(5)): `1: FLOCK  ADVISORY  WRITE 12403 fe:00:2164387 0 EOF`."""

    kind: str  # FLOCK, POSIX, OFDLCK, LEASE, DELEG
    mode: str  # ADVISORY, MANDATORY, ACTIVE, BREAKING...
    access: str  # READ, WRITE
    pid: int  # -1 for OFD locks; 0 when the holder is outside the reader's pid namespace
    major: int
    minor: int
    inode: int
    blocked: bool  # a waiter (`1: -> FLOCK ...`), not a holder

    @property
    def file_key(self) -> tuple[int, int, int]:
        return (self.major, self.minor, self.inode)


def parse_proc_locks(text: str) -> list[LockRecord]:
    """/proc/locks → records. Device numbers there are hex `MAJ:MIN:INODE` (major and minor in hex).

    Leases and delegations print `LEASE  ACTIVE    READ` etc. with the same layout (and `BREAKING`/`BREAKER`
    variants): only the layout matters here.
    """
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        blocked = len(fields) > 1 and fields[1] == "->"
        if blocked:
            fields = [fields[0], *fields[2:]]
        if len(fields) < 6 or not fields[0].endswith(":"):
            raise ProbeParseError(f"/proc/locks line {number}: {line[:120]!r}")
        device = fields[5].split(":")
        try:
            pid = int(fields[4])
            major, minor, inode = int(device[0], 16), int(device[1], 16), int(device[2])
        except (ValueError, IndexError):
            raise ProbeParseError(f"/proc/locks line {number}: bad pid or MAJ:MIN:INODE: {line[:120]!r}") from None
        records.append(LockRecord(fields[1], fields[2], fields[3], pid, major, minor, inode, blocked))
    return records


def split_glob(pattern: str) -> tuple[str, str]:
    """`/a/b/*/x/lock` → (`/a/b`, `*/x/lock`): the non-wildcard root, and the rest (never empty)."""
    parts = normalize_host_path(pattern).split("/")[1:]
    fixed: list[str] = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return "/" + "/".join(fixed), "/".join(parts[len(fixed) :])


def is_soft_lock_record(head: bytes) -> bool:
    """filelock's SoftFileLock writes `<pid>\\n<hostname>\\n...` into the file it holds."""
    lines = head.split(b"\n")
    return len(lines) >= 2 and lines[0].strip().isdigit() and bool(lines[1].strip())


def lock_style(name: str, head: bytes | None, baton_names: Sequence[str]) -> str:
    """ "baton" (torch FileBaton: existence is the lock), "soft" (SoftFileLock, same semantics) or "flock"
    (filelock's UnixFileLock and its users: the kernel lock is the lock, the file means nothing)."""
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in baton_names):
        return "baton"
    if head and is_soft_lock_record(head):
        return "soft"
    return "flock"


def remove_lock_if_unchanged(root: str, rel: str, dev: int, ino: int, mtime_ns: int) -> str:
    """Remove root/rel if it is still the regular file that was judged stale; "removed" or why not.

    Runs in a child (also callable directly). `root` is opened as configured; every component below it is
    opened with O_NOFOLLOW relative to its parent's fd, so a symlink anywhere under the root (a swapped
    directory, a `lock` replaced by a link) is never followed. The file is re-checked by fstatat(
    AT_SYMLINK_NOFOLLOW) against (dev, inode, mtime) just before unlinkat.
    """
    parts = rel.split("/")
    if not rel or any(part in ("", ".", "..") for part in parts):
        return f"refused: {rel!r} is not a plain path below the root"
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    return f"refused: {part} is a symlink or not a directory"
                raise
            os.close(dir_fd)
            dir_fd = next_fd
        name = parts[-1]
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return "refused: already gone"
        if not stat.S_ISREG(st.st_mode):
            return "refused: no longer a regular file (a symlink or something else took its place)"
        if (st.st_dev, st.st_ino, st.st_mtime_ns) != (dev, ino, mtime_ns):
            return "refused: replaced or touched since it was judged stale"
        os.unlink(name, dir_fd=dir_fd)
        return "removed"
    finally:
        os.close(dir_fd)


def remove_container_lock_in_child(
    proc_dir: str, pid: int, namespace: str, rel: str, dev: int, ino: int, mtime_ns: int
) -> str:
    """Runs in a child: remove a stale lock inside a container, below `/proc/<pid>/root`, with the safety of
    remove_lock_if_unchanged, once the pid is seen to be still in the mount namespace that was walked (a
    pid reused by another process must not redirect the removal)."""
    try:
        current = os.readlink(f"{proc_dir}/{pid}/ns/mnt")
    except FileNotFoundError:
        return "refused: the container's process is gone"
    if current != namespace:
        return f"refused: pid {pid} is no longer in {namespace}"
    return remove_lock_if_unchanged(f"{proc_dir}/{pid}/root", rel, dev, ino, mtime_ns)
