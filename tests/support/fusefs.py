"""FUSE filesystems for the storage tests, each a real mount served by its own process.

Run as a script (`python tests/support/fusefs.py MOUNTPOINT [--write-errno EDQUOT] ...`) it serves an in-memory
filesystem in the foreground until killed; `fuse_mount()` starts one in a subprocess, waits until the
kernel's mount table shows it (never by touching the mount: a hanging one would block the test), and
always lazily unmounts it and kills the daemon, which aborts the connection and frees any process stuck
in a request.

Faults, all chosen on the command line:
  --write-errno E / --fsync-errno E / --flush-errno E   fail write(2) / fsync(2) / close(2) with errno E
  --create-errno E                                      fail creating files
  --getattr-errno E                                     fail every stat, the mount point's included (ESTALE)
  --hang-getattr                                        never answer any stat or lookup
  --delay-ms N                                          answer every stat, lookup and listing N ms late
  --files N --ffree N                                   inode counts statfs reports
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FSNAME = "nodehealthtest"


class MemoryFs:
    """A small in-memory tree (dirs and regular files) with injectable errors."""

    use_ns = True

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mutex = threading.Lock()
        now = time.time_ns()
        self.nodes: dict[str, dict[str, Any]] = {
            "/": {"st_mode": stat.S_IFDIR | 0o777, "st_nlink": 2, "st_uid": 0, "st_gid": 0, "st_size": 0}
        }
        self.nodes["/"].update(st_atime=now, st_mtime=now, st_ctime=now)
        self.data: dict[str, bytearray] = {}
        self.forever = threading.Event()

    @staticmethod
    def _errno(name: str | None) -> int | None:
        return getattr(errno, name) if name else None

    def _fail(self, which: str) -> None:
        number = self._errno(getattr(self.args, which))
        if number is not None:
            raise _fuse_error(number)

    def _new(self, path: str, mode: int) -> None:
        from mfusepy import fuse_get_context

        uid, gid, _pid = fuse_get_context()
        now = time.time_ns()
        self.nodes[path] = {
            "st_mode": mode,
            "st_nlink": 2 if stat.S_ISDIR(mode) else 1,
            "st_uid": uid,
            "st_gid": gid,
            "st_size": 0,
            "st_atime": now,
            "st_mtime": now,
            "st_ctime": now,
        }

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        if self.args.hang_getattr:
            self.forever.wait()
        if self.args.delay_ms:
            time.sleep(self.args.delay_ms / 1000)
        self._fail("getattr_errno")
        with self.mutex:
            node = self.nodes.get(path)
            if node is None:
                raise _fuse_error(errno.ENOENT)
            out = dict(node)
            if path in self.data:
                out["st_size"] = len(self.data[path])
            return out

    def readdir(self, path: str, fh: int) -> list[str]:
        if self.args.delay_ms:
            time.sleep(self.args.delay_ms / 1000)
        prefix = path.rstrip("/") + "/"
        with self.mutex:
            names = [p[len(prefix) :] for p in self.nodes if p != path and p.startswith(prefix)]
        return [".", "..", *(n for n in names if "/" not in n)]

    def mkdir(self, path: str, mode: int) -> int:
        with self.mutex:
            self._new(path, stat.S_IFDIR | mode)
        return 0

    def rmdir(self, path: str) -> int:
        with self.mutex:
            self.nodes.pop(path, None)
        return 0

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        self._fail("create_errno")
        with self.mutex:
            self._new(path, stat.S_IFREG | (mode & 0o7777))
            self.data[path] = bytearray()
        return 0

    def open(self, path: str, flags: int) -> int:
        with self.mutex:
            if path not in self.nodes:
                raise _fuse_error(errno.ENOENT)
        return 0

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        with self.mutex:
            return bytes(self.data.get(path, b"")[offset : offset + size])

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self._fail("write_errno")
        with self.mutex:
            buf = self.data.setdefault(path, bytearray())
            if len(buf) < offset:
                buf.extend(b"\0" * (offset - len(buf)))
            buf[offset : offset + len(data)] = data
        return len(data)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        with self.mutex:
            buf = self.data.setdefault(path, bytearray())
            del buf[length:]
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        self._fail("fsync_errno")
        return 0

    def flush(self, path: str, fh: int) -> int:
        self._fail("flush_errno")
        return 0

    def release(self, path: str, fh: int) -> int:
        return 0

    def unlink(self, path: str) -> int:
        with self.mutex:
            self.nodes.pop(path, None)
            self.data.pop(path, None)
        return 0

    def rename(self, old: str, new: str) -> int:
        with self.mutex:
            self.nodes[new] = self.nodes.pop(old)
            if old in self.data:
                self.data[new] = self.data.pop(old)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        with self.mutex:
            node = self.nodes.get(path)
            if node is None:
                raise _fuse_error(errno.ENOENT)
            atime, mtime = times if times else (time.time_ns(), time.time_ns())
            node["st_atime"], node["st_mtime"] = atime, mtime
        return 0

    def chmod(self, path: str, mode: int) -> int:
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        files = self.args.files or 100000
        ffree = self.args.ffree if self.args.ffree is not None else files - len(self.nodes)
        return {
            "f_bsize": 4096,
            "f_frsize": 4096,
            "f_blocks": 262144,
            "f_bfree": 131072,
            "f_bavail": 131072,
            "f_files": files,
            "f_ffree": ffree,
            "f_favail": ffree,
            "f_namemax": 255,
        }


def _fuse_error(number: int) -> OSError:
    from mfusepy import FuseOSError

    return FuseOSError(number)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mountpoint")
    for name in ("write", "fsync", "flush", "create", "getattr"):
        parser.add_argument(f"--{name}-errno", metavar="ENAME")
    parser.add_argument("--hang-getattr", action="store_true")
    parser.add_argument("--delay-ms", type=int, default=0)
    parser.add_argument("--files", type=int, default=0)
    parser.add_argument("--ffree", type=int)
    args = parser.parse_args(argv)
    from mfusepy import FUSE, Operations

    ops = type("NodeHealthTestFs", (MemoryFs, Operations), {})(args)
    # allow_other: write probes run as a non-root uid; no default_permissions: this filesystem decides.
    FUSE(ops, args.mountpoint, foreground=True, allow_other=True, fsname=FSNAME, attr_timeout=0, entry_timeout=0)


# --- the test side ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FuseMount:
    path: Path
    daemon_pid: int


def mounted_at(path: Path) -> dict[str, str] | None:
    """fstype and source of the mount at `path`, from our own mount table (never touching the mount)."""
    from probes.storage.mounttable import mount_at, parse_mountinfo

    entry = mount_at(parse_mountinfo(Path("/proc/self/mountinfo").read_text()), str(path))
    return {"fstype": entry.fstype, "source": entry.source} if entry else None


@contextlib.contextmanager
def fuse_mount(parent: Path, *flags: str, start_timeout: float = 15.0) -> Iterator[FuseMount]:
    """Mount a test filesystem at parent/mnt in a subprocess; always unmounted and killed afterwards."""
    mnt = Path(parent) / "mnt"
    mnt.mkdir()
    log_path = Path(parent) / "fusefs.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, __file__, str(mnt), *flags],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + start_timeout
        while mounted_at(mnt) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"FUSE test filesystem did not mount: {log_path.read_text(errors='replace')}")
            time.sleep(0.02)
        yield FuseMount(mnt, proc.pid)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, timeout=10, check=False)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
