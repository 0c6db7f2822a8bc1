"""What the storage probes share: the reasons of a filesystem call that hung or failed, child calls run side
by side within the probe's deadline, and small helpers (errno labels, path containment, safe text).

Every call that touches a possibly shared filesystem runs in a forked child with a deadline
(`ctx.host.child_call`, at most one child in flight per key). The functions named `*_in_child` run
there: only `os` and pure Python, no logging, no imports.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from probes.base import Check, Finding, ProbeContext, ProbeParseError, Reason, Status
from probes.runtime.children import ChildResult, statvfs_in_child
from probes.runtime.paths import normalize_host_path, resolve_under
from probes.storage.mounttable import MountEntry, mount_containing, read_mount_table
from probes.text import escape

HINT_FULL = "clean caches and old checkpoints (du -xsh PATH/* | sort -h), or grow the disk"
HINT_INODES = "millions of small files: remove extracted datasets or caches with many files, or grow the inode table"
HINT_REMOUNT = "the server forgot the handle (export moved, failover): remount the filesystem"

MOUNT_HUNG = Reason(
    "MountHung",
    Status.FAIL,
    "the filesystem did not answer within the deadline, or the previous check's child is still stuck",
    "the filesystem is hung (NFS server unreachable?): check `mount | grep PATH` and the server; a hard mount "
    "blocks every job touching it until it is remounted",
)
MOUNT_STALE = Reason("MountStale", Status.FAIL, "stale file handle (ESTALE, errno 116)", HINT_REMOUNT)
HINT_DEAD = (
    "the FUSE daemon serving {path} is gone (killed, OOM-killed or crashed) and the kernel cannot reach it: "
    "detach the dead mount (fusermount -uz {path}, or umount -l {path}), then remount the share (mount {path}, or "
    "restart its mount service: juicefs, s3fs, sshfs, the CSI node plugin); jobs with files open under it must "
    "restart"
)
# EIO from a FUSE filesystem is the daemon's own answer: the kernel says ENOTCONN (ECONNABORTED for a request in
# flight) once the daemon's /dev/fuse is closed, so a daemon that answers EIO is alive and has lost what it
# serves from (JuiceFS its metadata engine or object store, s3fs its bucket, sshfs its server).
HINT_ERRORS = (
    "the FUSE daemon serving {path} runs but answers every access with an error: it lost its backend (JuiceFS: "
    "the metadata engine (Redis, TiKV, MySQL) or the object store; s3fs: the bucket's endpoint or credentials; "
    "sshfs: the server): read the daemon's log and restore the backend; a share that does not recover then must "
    "be remounted (fusermount -uz {path}, or umount -l {path}, then mount {path} or restart its mount service); "
    "jobs with files open under it must restart"
)
MOUNT_DEAD = Reason(
    "MountDead",
    Status.FAIL,
    "the filesystem cannot be used: ENOTCONN (errno 107, 'Transport endpoint is not connected') or "
    "ECONNABORTED, its FUSE daemon is gone; or EIO from a FUSE filesystem, its daemon runs and answers every "
    "access with an error (a lost backend)",
    HINT_DEAD.format(path="PATH") + "; when it answers EIO it is alive: " + HINT_ERRORS.format(path="PATH"),
)
PATH_MISSING = Reason(
    "PathMissing",
    Status.FAIL,
    "a configured path does not exist (ENOENT)",
    "create the path or fix the config; a missing shared disk shows up like this",
)
STAT_FAILED = Reason(
    "StatFailed",
    Status.UNKNOWN,
    "a filesystem call on the path failed with an unexpected error (the message names the errno)",
    "check the path's permissions and the agent log; the agent needs to run privileged",
)
DEADLINE_EXHAUSTED = Reason(
    "DeadlineExhausted",
    Status.UNKNOWN,
    "the probe's deadline ran out before this item could be checked",
    "raise the probe's timeout (probes.<name>.timeout_seconds) or check fewer items per probe",
)
DISK_FULL = Reason(
    "DiskFull",
    Status.FAIL,
    "no space left: blocks used at or above fail_percent (storage.space), or ENOSPC writing with inodes left "
    "(storage.write)",
    HINT_FULL,
)
INODES_EXHAUSTED = Reason(
    "InodesExhausted",
    Status.FAIL,
    "no inodes left (statvfs f_favail == 0, or at or above fail_inodes_percent): writes fail with ENOSPC "
    "although blocks are free",
    HINT_INODES,
)
# Every probe that runs filesystem calls in children can say these.
CHILD_REASONS: tuple[Reason, ...] = (
    MOUNT_HUNG,
    MOUNT_STALE,
    MOUNT_DEAD,
    PATH_MISSING,
    STAT_FAILED,
    DEADLINE_EXHAUSTED,
)
# The errnos of a filesystem whose server side is gone: a dead FUSE daemon (ENOTCONN once the connection is
# aborted, ECONNABORTED for a request in flight at that moment).
DEAD_ERRNOS = frozenset({errno.ENOTCONN, errno.ECONNABORTED})


def is_dead_mount(number: int | None, fstype: str | None) -> bool:
    """Whether an errno says the filesystem's daemon is gone: ENOTCONN/ECONNABORTED anywhere, or EIO on a FUSE
    filesystem (a daemon that died mid-request, or one whose backend connection is lost, answers EIO)."""
    if number in DEAD_ERRNOS:
        return True
    return number == errno.EIO and fstype is not None and fstype_is_fuse(fstype)


def fstype_is_fuse(fstype: str) -> bool:
    return fstype in ("fuse", "fuseblk") or fstype.startswith("fuse.")


def dead_mount_finding(
    check: Check, subject: str, path: str, number: int | None, fstype: str | None, observed: Mapping[str, Any]
) -> Finding:
    """MountDead: what failed, on which filesystem, and how to detach and remount it (`path`: the mount point
    when known, else the configured path). ENOTCONN/ECONNABORTED: the daemon is gone; EIO on FUSE: the daemon
    lives and answers errors (HINT_ERRORS), which no remount alone fixes."""
    on = f" ({fstype})" if fstype else ""
    head = f"{safe_text(subject)}: {errno_label(number)} on {safe_text(path)}{on}"
    if number in DEAD_ERRNOS:
        message = f"{head}: the filesystem's daemon is gone, every access fails"
        return check.report(MOUNT_DEAD, subject, message, observed, hint=HINT_DEAD.format(path=safe_text(path)))
    message = f"{head}: the filesystem's daemon runs but answers every access with an error (its backend lost?)"
    observed = {**observed, "daemon": "answering errors"}
    return check.report(MOUNT_DEAD, subject, message, observed, hint=HINT_ERRORS.format(path=safe_text(path)))


def child_error_finding(
    check: Check,
    subject: str,
    result: ChildResult,
    extra: Mapping[str, Any] | None = None,
    *,
    mount: tuple[str, str] | None = None,
) -> Finding:
    """A filesystem call that did not answer or failed, in the vocabulary shared by the storage checks.

    `mount` is (mount point, fstype) of the filesystem the call went to, when known: EIO there is MountDead
    only on FUSE, and the hint names the mount point to detach."""
    observed: dict[str, Any] = {"duration_seconds": round(result.duration, 3), **(extra or {})}
    shown = safe_text(subject)
    if result.state == "deadline":
        return check.report(DEADLINE_EXHAUSTED, subject, f"{shown}: not checked, {result.error}", observed)
    if result.hung:
        return check.report(MOUNT_HUNG, subject, f"{shown} did not answer: {result.error}", observed)
    observed["errno"] = result.errno
    if is_dead_mount(result.errno, mount[1] if mount else None):
        point, fstype = mount if mount else (subject, None)
        return dead_mount_finding(check, subject, point, result.errno, fstype, observed)
    if result.errno == errno.ESTALE:
        return check.report(MOUNT_STALE, subject, f"{shown}: stale file handle (ESTALE, errno 116)", observed)
    if result.errno == errno.ENOENT:
        return check.report(PATH_MISSING, subject, f"{shown} does not exist", observed)
    return check.report(STAT_FAILED, subject, f"{shown}: {result.error}", observed)


def path_failure_finding(
    ctx: ProbeContext,
    check: Check,
    subject: str,
    path: str,
    result: ChildResult,
    extra: Mapping[str, Any] | None = None,
) -> Finding:
    """child_error_finding for a call on the host path `path`: when the errno may mean a dead filesystem, the
    host mount table tells which mount it is on (and whether it is FUSE)."""
    mount = None
    if result.state == "error" and (result.errno in DEAD_ERRNOS or result.errno == errno.EIO):
        entry = mount_entry_of(ctx, path)
        mount = (entry.mount_point, entry.fstype) if entry else None
    return child_error_finding(check, subject, result, extra, mount=mount)


def mount_entry_of(ctx: ProbeContext, path: str) -> MountEntry | None:
    """The host mount `path` lies on, from the mount table (never touching the mount); None when the table
    cannot be read."""
    try:
        return mount_containing(read_mount_table(ctx), path)
    except (OSError, ProbeParseError):
        return None


# --- child calls within the probe's deadline -------------------------------------------------------

# Threads only wait on pipes; the children do the filesystem work. Enough of them that every item of a
# probe gets its own deadline at once (20 hung mounts cost one mount timeout, not 20), bounded so that a
# misconfigured list cannot fork hundreds of children at once.
MAX_PARALLEL_CHILDREN = 64
# A child given less time than this would only ever "time out": such an item is reported DeadlineExhausted.
MIN_CHILD_SECONDS = 0.05
# Children are forked one at a time (ChildCalls holds a lock around fork), each deadline counting from its
# own fork: the last of N starts about N forks late. A fork of the agent takes a few milliseconds.
FORK_SECONDS = 0.01
# A child that did not answer is killed and given this long to be reaped before the call returns.
KILL_SECONDS = 0.05


def reserve_seconds(ctx: ProbeContext, children: int = 1) -> float:
    """Time kept back from `children` side-by-side children, for their forks, their reaping and building the
    findings, so that the probe returns before its deadline."""
    return min(1.0, max(0.2, 0.1 * ctx.timeout)) + KILL_SECONDS + FORK_SECONDS * children


def item_timeout(ctx: ProbeContext, configured: float, reserve: float | None = None) -> float:
    """A per-item deadline clamped to what the probe run has left (minus the reserve); may be <= 0."""
    held_back = reserve_seconds(ctx) if reserve is None else reserve
    return min(configured, ctx.remaining(0.0) - held_back)


@dataclass(frozen=True)
class ChildCall:
    key: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    timeout: float  # the per-item limit; each call is also clamped to the probe's deadline


def run_child_call(ctx: ProbeContext, call: ChildCall, reserve: float | None = None) -> ChildResult:
    held_back = reserve_seconds(ctx) if reserve is None else reserve
    timeout = item_timeout(ctx, call.timeout, held_back)
    if timeout < MIN_CHILD_SECONDS:
        return ChildResult("deadline", error="the probe's deadline ran out before this check could start")
    # The deadline also caps the wait from the child's fork, which may come late behind other items' forks.
    deadline = ctx.deadline - held_back
    return ctx.host.child_call(call.key, call.fn, *call.args, timeout=timeout, deadline=deadline)


def run_child_calls(ctx: ProbeContext, calls: Sequence[ChildCall], reserve: float | None = None) -> list[ChildResult]:
    """Run the calls' children side by side, so N hung filesystems cost one deadline, not N.

    Each call's deadline is its own limit clamped to what the probe has left, so a probe deadline shorter
    than the per-item one still gives one specific finding per item instead of an opaque probe timeout.
    """
    if reserve is None:
        reserve = reserve_seconds(ctx, min(len(calls), MAX_PARALLEL_CHILDREN))
    if len(calls) <= 1:
        return [run_child_call(ctx, call, reserve) for call in calls]
    workers = min(MAX_PARALLEL_CHILDREN, len(calls))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="storage-child") as pool:
        return list(pool.map(lambda call: run_child_call(ctx, call, reserve), calls))


# --- small helpers ---------------------------------------------------------------------------------


def agent_path_in_child(root: str, path: str) -> str:
    """Runs in a child: where the agent reaches the host path `path`, its symlinks resolved inside the host root
    `root` (an absolute link target is the host's, not the agent's)."""
    return os.path.join(root, resolve_under(root, path).lstrip("/"))


def statvfs_resolved_in_child(root: str, path: str) -> dict[str, int]:
    """Runs in a child: statvfs of a host path, resolved inside the host root."""
    return statvfs_in_child(agent_path_in_child(root, path))


def errno_label(number: int | None) -> str:
    """`EDQUOT (errno 122, Disk quota exceeded)`."""
    if number is None:
        return "unknown error"
    name = errno.errorcode.get(number, f"E{number}")
    return f"{name} (errno {number}, {os.strerror(number)})"


def path_is_under(path: str, top: str) -> bool:
    """Whether `path` is `top` or below it (both normalised; no filesystem access)."""
    path, top = normalize_host_path(path), normalize_host_path(top)
    return top == "/" or path == top or path.startswith(top + "/")


# A file name chosen by anyone who can write a lock directory cannot forge log lines or messages.
safe_text = escape
