"""Walking lock globs in a child: bounded in entries and time, never through a symlink.

A glob is walked component by component from a directory opened once (a host glob's non-wildcard root, or a
container's `/proc/<pid>/root`): every directory below it is opened with O_NOFOLLOW relative to its parent's
descriptor, so a symlinked directory is skipped (and counted) rather than followed, the same way every run,
and a symlink named like a lock is recorded as not regular, never judged. Anyone who can write a lock
directory could otherwise point it anywhere and have the node tainted.

The walk stops itself after `max_entries` directory entries or `soft_seconds` (LockScanIncomplete, with how
far it got); the child's own deadline is longer, so a child that does not answer at all is stuck in one
filesystem call (MountHung), not merely busy with a large tree.

Everything here but `glob_parts` and `WalkPlan` runs in the child: only `os`, `stat`, `time` and pure Python.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import stat
import time
from dataclasses import dataclass
from typing import Any

from probes.storage.lockfiles import lock_style

_FILE_LIMIT = 5000
_HEAD_BYTES = 256
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A walk's own budget is this share of its child's deadline; the rest tells "busy" from "stuck".
SOFT_SHARE = 0.7


def glob_parts(pattern: str) -> list[str]:
    """`/root/.cache/x/*/lock` → [`root`, `.cache`, `x`, `*`, `lock`] (normalised, absolute patterns only)."""
    return [part for part in os.path.normpath(pattern).split("/") if part and part != "."]


def has_magic(part: str) -> bool:
    return any(char in part for char in "*?[")


def name_matches(name: str, part: str) -> bool:
    """fnmatch as glob(3) does it: a wildcard does not match a leading dot unless the pattern has one."""
    if not has_magic(part):
        return name == part
    if name.startswith(".") and not part.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, part)


@dataclass(frozen=True)
class WalkPlan:
    """What one child walks: globs (as component lists) below one root, with one shared budget."""

    root: str
    globs: tuple[tuple[str, ...], ...]
    baton_names: tuple[str, ...]
    max_entries: int
    soft_seconds: float


class _Stop(Exception):
    """The walk's budget (entries or time) ran out."""


class _Walk:
    """One glob's walk state: what was found, what was skipped, and how far the budget went."""

    def __init__(self, plan: WalkPlan, shared: dict[str, Any]) -> None:
        self.plan = plan
        self.shared = shared  # {"entries": n, "deadline": monotonic} across the plan's globs
        self.files: list[tuple[Any, ...]] = []
        self.symlinked_dirs = 0
        self.unreadable_dirs = 0
        self.truncated = False
        self.at = ""

    def tick(self, where: str) -> None:
        self.shared["entries"] += 1
        self.at = where
        if self.shared["entries"] > self.plan.max_entries:
            raise _Stop(f"stopped after {self.plan.max_entries} directory entries")
        if time.monotonic() > self.shared["deadline"]:
            raise _Stop(f"stopped after {self.plan.soft_seconds:.2g}s")

    def walk(self, dir_fd: int, rel: str, parts: tuple[str, ...]) -> None:
        part, rest = parts[0], parts[1:]
        if has_magic(part):
            with os.scandir(dir_fd) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
            names = [entry.name for entry in entries]
        else:
            names = [part]
        for name in names:
            path = f"{rel}/{name}" if rel else name
            self.tick(path)
            if not name_matches(name, part):
                continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            except PermissionError:
                self.unreadable_dirs += 1
                continue
            if rest:
                self.descend(dir_fd, name, path, st, rest)
            else:
                self.record(dir_fd, name, path, st)

    def descend(self, dir_fd: int, name: str, path: str, st: os.stat_result, rest: tuple[str, ...]) -> None:
        if stat.S_ISLNK(st.st_mode):
            self.symlinked_dirs += 1
            return
        if not stat.S_ISDIR(st.st_mode):
            return
        try:
            child = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # swapped for a link since the lstat
                self.symlinked_dirs += 1
                return
            if exc.errno in (errno.EACCES, errno.EPERM, errno.ENOENT):
                self.unreadable_dirs += 1
                return
            raise
        try:
            self.walk(child, path, rest)
        finally:
            os.close(child)

    def record(self, dir_fd: int, name: str, path: str, st: os.stat_result) -> None:
        if len(self.files) >= _FILE_LIMIT:
            self.truncated = True
            raise _Stop(f"stopped after {_FILE_LIMIT} lock files")
        style = ""
        if stat.S_ISREG(st.st_mode):
            head = None
            if lock_style(name, None, self.plan.baton_names) != "baton":
                head = _read_head(dir_fd, name)
            style = lock_style(name, head, self.plan.baton_names)
        self.files.append((path, st.st_mode, st.st_dev, st.st_ino, st.st_size, st.st_mtime, st.st_mtime_ns, style))

    def result(self, incomplete: str) -> dict[str, Any]:
        return {
            "files": self.files,
            "symlinked_dirs": self.symlinked_dirs,
            "unreadable_dirs": self.unreadable_dirs,
            "truncated": self.truncated,
            "incomplete": incomplete,
            "at": self.at if incomplete else "",
        }


def _read_head(dir_fd: int, name: str) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return os.read(fd, _HEAD_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)


def walk_in_child(plan: WalkPlan) -> dict[str, Any]:
    """Runs in a child: the plan's globs walked below its root. Returns {"globs": [per glob {"files":
    [(rel path, mode, dev, ino, size, mtime, mtime_ns, style)], "symlinked_dirs", "unreadable_dirs",
    "truncated", "incomplete" (why it stopped, "" when complete), "at" (the last entry looked at)}],
    "entries", "root_missing"}. A missing root is no lock at all; other errors at the root are raised."""
    shared: dict[str, Any] = {"entries": 0, "deadline": time.monotonic() + plan.soft_seconds}
    try:
        root_fd = os.open(plan.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return {"globs": [_Walk(plan, shared).result("") for _ in plan.globs], "entries": 0, "root_missing": True}
    results = []
    stopped = ""
    try:
        for parts in plan.globs:
            walk = _Walk(plan, shared)
            why = f"not walked: the walk {stopped}" if stopped else ""
            if not stopped:
                try:
                    walk.walk(root_fd, "", parts)
                except _Stop as stop:
                    stopped = why = str(stop)
            results.append(walk.result(why))
    finally:
        os.close(root_fd)
    return {"globs": results, "entries": shared["entries"], "root_missing": False}


def walk_namespace_in_child(proc_dir: str, pid: int, namespace: str, plan: WalkPlan) -> dict[str, Any]:
    """Runs in a child: walk a container's globs below `/proc/<pid>/root`, once the pid is seen to be still
    in the mount namespace it was chosen for ({"gone": True} when it exited or the pid was reused)."""
    try:
        if os.readlink(f"{proc_dir}/{pid}/ns/mnt") != namespace:
            return {"gone": True}
    except FileNotFoundError:
        return {"gone": True}
    return walk_in_child(plan)
