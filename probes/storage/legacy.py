"""Storage probes, one probe class per check so that one hung mount never delays another check.

- storage.space: blocks and inodes of configured paths (statvfs).
- storage.mounts: expected mounts against the host mount table, then stat + list in a child → hung, stale.
- storage.write: write N bytes as the job's uid/gid, fsync, close, unlink → quota, full, inodes, read-only.
- storage.locks: stale torch FileBaton / SoftFileLock files (no holder on this node), safe removal.
- storage.model_cache: Hugging Face hub snapshots complete (links, blobs, shards of *.index.json).

Every call that touches a possibly shared filesystem runs in a forked child with a deadline
(`ctx.host.child_call`, at most one child in flight per key). The functions named `*_in_child` run
there: only `os` and pure Python, no logging, no imports.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import glob
import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from probes.base import Event, Finding, Probe, ProbeContext, ProbeOutput, ProbeParseError, Sample, Status, register
from probes.runtime.host import ChildResult, statvfs_in_child
from probes.runtime.procfs import ScanError, list_pids, scan_open_files
from probes.runtime.pyspy import waiting_on_lock

log = logging.getLogger(__name__)

HINT_FULL = "clean caches and old checkpoints (du -xsh PATH/* | sort -h), or grow the disk"
HINT_INODES = "millions of small files: remove extracted datasets or caches with many files, or grow the inode table"


def child_error_finding(check: str, subject: str, result: ChildResult) -> Finding:
    """A filesystem call that did not answer or failed, in the vocabulary shared by the storage checks."""
    observed = {"duration_seconds": round(result.duration, 3)}
    if result.hung:
        return Finding(
            check,
            subject,
            Status.FAIL,
            "MountHung",
            f"{subject} did not answer: {result.error}",
            "the filesystem is hung (NFS server unreachable?): check `mount | grep PATH` and the "
            "server; a hard mount blocks every job touching it until it is remounted",
            observed,
        )
    if result.errno == errno.ESTALE:
        return Finding(
            check,
            subject,
            Status.FAIL,
            "MountStale",
            f"{subject}: stale file handle (ESTALE, errno 116)",
            "the server forgot the handle (export moved, failover): remount the filesystem",
            {**observed, "errno": result.errno},
        )
    if result.errno == errno.ENOENT:
        return Finding(
            check,
            subject,
            Status.FAIL,
            "PathMissing",
            f"{subject} does not exist",
            "create the path or fix the config; a missing shared disk shows up like this",
            {**observed, "errno": result.errno},
        )
    return Finding(
        check,
        subject,
        Status.UNKNOWN,
        "StatFailed",
        f"{subject}: {result.error}",
        "",
        {**observed, "errno": result.errno},
    )


def space_finding(
    path: str,
    st: dict[str, int],
    warn_percent: float,
    fail_percent: float,
    warn_inodes_percent: float,
    fail_inodes_percent: float,
) -> Finding:
    used_blocks = st["blocks"] - st["bfree"]
    usable = used_blocks + st["bavail"]
    used_percent = 100.0 * used_blocks / usable if usable else 0.0
    has_inodes = st["files"] > 0
    used_inodes_percent = 100.0 * (st["files"] - st["ffree"]) / st["files"] if has_inodes else 0.0
    observed = {
        "free_bytes": st["bavail"] * st["frsize"],
        "size_bytes": st["blocks"] * st["frsize"],
        "used_percent": round(used_percent, 1),
        "free_inodes": st["favail"],
        "inodes": st["files"],
        "used_inodes_percent": round(used_inodes_percent, 1),
    }
    if has_inodes and (st["favail"] == 0 or used_inodes_percent >= fail_inodes_percent):
        return Finding(
            "storage.space",
            path,
            Status.FAIL,
            "InodesExhausted",
            f"{path}: {used_inodes_percent:.1f}% of inodes used, {st['favail']} free "
            "(writes fail with ENOSPC although blocks are free)",
            HINT_INODES,
            observed,
        )
    if st["bavail"] == 0 or used_percent >= fail_percent:
        return Finding(
            "storage.space",
            path,
            Status.FAIL,
            "DiskFull",
            f"{path}: {used_percent:.1f}% used, {observed['free_bytes'] // (1 << 20)} MiB free",
            HINT_FULL,
            observed,
        )
    if used_percent >= warn_percent:
        return Finding(
            "storage.space",
            path,
            Status.WARN,
            "DiskLow",
            f"{path}: {used_percent:.1f}% used (warn at {warn_percent:g}%)",
            HINT_FULL,
            observed,
        )
    if has_inodes and used_inodes_percent >= warn_inodes_percent:
        return Finding(
            "storage.space",
            path,
            Status.WARN,
            "DiskLow",
            f"{path}: {used_inodes_percent:.1f}% of inodes used (warn at {warn_inodes_percent:g}%)",
            HINT_INODES,
            observed,
        )
    return Finding(
        "storage.space",
        path,
        Status.OK,
        "OK",
        f"{path}: {used_percent:.1f}% used, {used_inodes_percent:.1f}% inodes used",
        observed=observed,
    )


@register
class SpaceProbe(Probe):
    name = "storage.space"
    checks = ("storage.space",)
    default_interval = 60.0
    default_timeout = 10.0
    needs = "the configured paths (storage.space)"

    def applicable(self, ctx: ProbeContext) -> str | None:
        return None if ctx.config.storage.space else "no paths configured in storage.space"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        out: ProbeOutput = []
        per_path = ctx.config.storage.space_timeout_seconds
        for spec in ctx.config.storage.space:
            local = str(ctx.host.root_path(spec.path))
            result = ctx.host.child_call(
                f"statvfs:{local}", statvfs_in_child, local, timeout=min(per_path, ctx.remaining())
            )
            labels = {"path": spec.path}
            if not result.ok:
                out.append(child_error_finding("storage.space", spec.path, result))
                continue
            st = result.value
            out.append(
                space_finding(
                    spec.path,
                    st,
                    spec.warn_percent,
                    spec.fail_percent,
                    spec.warn_inodes_percent,
                    spec.fail_inodes_percent,
                )
            )
            out.append(
                Sample(
                    "nodehealth_storage_free_bytes",
                    "Bytes available to unprivileged users.",
                    st["bavail"] * st["frsize"],
                    labels,
                )
            )
            out.append(Sample("nodehealth_storage_size_bytes", "Filesystem size.", st["blocks"] * st["frsize"], labels))
            out.append(
                Sample(
                    "nodehealth_storage_free_inodes", "Inodes available to unprivileged users.", st["favail"], labels
                )
            )
            out.append(Sample("nodehealth_storage_inodes", "Inodes in the filesystem.", st["files"], labels))
            out.append(
                Sample(
                    "nodehealth_storage_statvfs_seconds",
                    "Time statvfs took in a child process.",
                    result.duration,
                    labels,
                )
            )
        return out


# --- shared helpers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChildCall:
    key: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    timeout: float  # the per-call limit; each call also stops at the probe's deadline


def run_child_calls(ctx: ProbeContext, calls: Sequence[ChildCall], max_parallel: int = 8) -> list[ChildResult]:
    """Run the calls' children side by side, so one hung filesystem costs one deadline, not one per entry.

    The threads only wait on a pipe with select (bounded by each call's deadline); the filesystem is
    touched by the forked children alone.
    """

    def one(call: ChildCall) -> ChildResult:
        return ctx.host.child_call(call.key, call.fn, *call.args, timeout=min(call.timeout, ctx.remaining()))

    if len(calls) <= 1:
        return [one(call) for call in calls]
    with ThreadPoolExecutor(max_workers=min(max_parallel, len(calls)), thread_name_prefix="storage-child") as pool:
        return list(pool.map(one, calls))


def errno_label(number: int | None) -> str:
    """`EDQUOT (errno 122, Disk quota exceeded)`."""
    if number is None:
        return "unknown error"
    name = errno.errorcode.get(number, f"E{number}")
    return f"{name} (errno {number}, {os.strerror(number)})"


# --- mount table -----------------------------------------------------------------------------------

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def decode_mount_field(text: str) -> str:
    """Undo the kernel's octal escapes in mountinfo fields (\\040 space, \\011 tab, \\012 newline, \\134 \\)."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), text)


@dataclass(frozen=True)
class MountEntry:
    mount_id: int
    parent_id: int
    major: int
    minor: int
    root: str
    mount_point: str
    options: str
    optional_fields: tuple[str, ...]
    fstype: str
    source: str
    super_options: str

    @property
    def dev(self) -> int:
        return os.makedev(self.major, self.minor)


def parse_mountinfo(text: str) -> list[MountEntry]:
    """/proc/PID/mountinfo → entries in file order (proc(5); kernel Documentation/filesystems/proc.rst 3.5).

    `id parent maj:min root mountpoint options [optional fields...] - fstype source superoptions`
    """
    entries: list[MountEntry] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split(" ")
        try:
            separator = fields.index("-", 6)
        except ValueError:
            raise ProbeParseError(f"mountinfo line {number}: no ' - ' separator: {line[:120]!r}") from None
        if len(fields) < separator + 3:
            raise ProbeParseError(f"mountinfo line {number}: {len(fields)} fields: {line[:120]!r}")
        major_minor = fields[2].split(":")
        try:
            mount_id, parent_id = int(fields[0]), int(fields[1])
            major, minor = int(major_minor[0]), int(major_minor[1])
        except (ValueError, IndexError):
            raise ProbeParseError(f"mountinfo line {number}: bad ids or maj:min: {line[:120]!r}") from None
        if len(major_minor) != 2:
            raise ProbeParseError(f"mountinfo line {number}: bad maj:min {fields[2]!r}")
        entries.append(
            MountEntry(
                mount_id=mount_id,
                parent_id=parent_id,
                major=major,
                minor=minor,
                root=decode_mount_field(fields[3]),
                mount_point=decode_mount_field(fields[4]),
                options=fields[5],
                optional_fields=tuple(fields[6:separator]),
                fstype=fields[separator + 1],
                source=decode_mount_field(fields[separator + 2]),
                super_options=" ".join(fields[separator + 3 :]),
            )
        )
    if not entries:
        raise ProbeParseError("mountinfo is empty")
    return entries


def read_mount_table(ctx: ProbeContext) -> list[MountEntry]:
    """The host's mount table (pid 1's mountinfo; hostPID in the DaemonSet). Never touches the mounts."""
    path = ctx.host.proc_path(1, "mountinfo")
    return parse_mountinfo(path.read_text(errors="surrogateescape"))


def normalize_path(path: str) -> str:
    return os.path.normpath("/" + path.lstrip("/")) if path else "/"


def mount_at(entries: Sequence[MountEntry], path: str) -> MountEntry | None:
    """The mount visible at exactly `path` (the last one mounted there: mounts stack)."""
    wanted = normalize_path(path)
    found = None
    for entry in entries:
        if entry.mount_point == wanted:
            found = entry
    return found


def mount_containing(entries: Sequence[MountEntry], path: str, dev: int | None = None) -> MountEntry | None:
    """The mount a host path lives on: by device number when one mount under the path's prefix has it,
    else the longest mount point that is a prefix of the path (the last mounted wins)."""
    wanted = normalize_path(path)

    def is_prefix(point: str) -> bool:
        return point == "/" or wanted == point or wanted.startswith(point + "/")

    candidates = [e for e in entries if is_prefix(e.mount_point)]
    if dev is not None:
        by_dev = [e for e in candidates if e.dev == dev]
        if by_dev:
            candidates = by_dev
    best: MountEntry | None = None
    for entry in candidates:
        if best is None or len(entry.mount_point) >= len(best.mount_point):
            best = entry
    return best


def fstype_matches(fstype: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(fstype, pattern) for pattern in patterns)


# --- storage.mounts --------------------------------------------------------------------------------


def stat_and_list_in_child(path: str) -> dict[str, Any]:
    """Runs in a child: stat the mount point and read one directory entry (both reach the server)."""
    st = os.stat(path)
    with os.scandir(path) as entries:
        first = next(entries, None)
    return {"dev": st.st_dev, "empty": first is None}


def mount_table_findings(spec_path: str, fstype: str, source: str | None, entry: MountEntry | None) -> Finding | None:
    """MountMissing / MountWrongType from the mount table alone; None when the entry is as expected."""
    if entry is None:
        return Finding(
            "storage.mounts",
            spec_path,
            Status.FAIL,
            "MountMissing",
            f"{spec_path} is not mounted (expected {fstype}{' from ' + source if source else ''})",
            "mount it (`mount PATH`, check /etc/fstab or the automounter); after maintenance shared disks "
            "are often left unmounted and jobs write into the empty directory instead",
            {"expected_fstype": fstype, "expected_source": source},
        )
    wrong_type = not fnmatch.fnmatchcase(entry.fstype, fstype)
    wrong_source = source is not None and not fnmatch.fnmatchcase(entry.source, source)
    if wrong_type or wrong_source:
        what = []
        if wrong_type:
            what.append(f"type {entry.fstype}, expected {fstype}")
        if wrong_source:
            what.append(f"source {entry.source}, expected {source}")
        return Finding(
            "storage.mounts",
            spec_path,
            Status.FAIL,
            "MountWrongType",
            f"{spec_path} is mounted with {'; '.join(what)}",
            "something else is mounted there (a local disk, the wrong export): unmount it and mount the "
            "expected filesystem",
            {"fstype": entry.fstype, "source": entry.source, "expected_fstype": fstype, "expected_source": source},
        )
    return None


@register
class MountsProbe(Probe):
    name = "storage.mounts"
    checks = ("storage.mounts",)
    default_interval = 30.0
    default_timeout = 10.0
    needs = "the host mount table (/proc/1/mountinfo, hostPID) and the configured mounts (storage.mounts)"

    def applicable(self, ctx: ProbeContext) -> str | None:
        return None if ctx.config.storage.mounts else "no mounts configured in storage.mounts"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        cfg = ctx.config.storage
        table = read_mount_table(ctx)
        out: ProbeOutput = []
        to_probe = []
        for spec in cfg.mounts:
            entry = mount_at(table, spec.path)
            problem = mount_table_findings(spec.path, spec.fstype, spec.source, entry)
            if problem is not None:
                out.append(problem)
                out.append(_mount_ok_sample(spec.path, False))
            else:
                assert entry is not None
                to_probe.append((spec, entry))
        calls = [
            ChildCall(
                f"mount:{normalize_path(spec.path)}",
                stat_and_list_in_child,
                (str(ctx.host.root_path(spec.path)),),
                cfg.mount_timeout_seconds,
            )
            for spec, _ in to_probe
        ]
        for (spec, entry), result in zip(to_probe, run_child_calls(ctx, calls), strict=True):
            out.append(_mount_ok_sample(spec.path, result.ok))
            if not result.ok:
                finding = child_error_finding("storage.mounts", spec.path, result)
                out.append(_with_observed(finding, fstype=entry.fstype, source=entry.source))
                continue
            out.append(
                Finding(
                    "storage.mounts",
                    spec.path,
                    Status.OK,
                    "OK",
                    f"{spec.path}: {entry.fstype} from {entry.source} answered in {result.duration * 1000:.0f} ms",
                    observed={
                        "fstype": entry.fstype,
                        "source": entry.source,
                        "latency_seconds": round(result.duration, 4),
                    },
                )
            )
            out.append(
                Sample(
                    "nodehealth_storage_mount_latency_seconds",
                    "Time a stat and a directory read of the mount point took, in a child process.",
                    result.duration,
                    {"path": spec.path},
                )
            )
        return out


def _mount_ok_sample(path: str, ok: bool) -> Sample:
    return Sample(
        "nodehealth_storage_mount_ok",
        "1 when the expected mount is present, of the right type, and answers in time.",
        1.0 if ok else 0.0,
        {"path": path},
    )


def _with_observed(finding: Finding, **extra: Any) -> Finding:
    return Finding(
        finding.check,
        finding.subject,
        finding.status,
        finding.reason,
        finding.message,
        finding.hint,
        {**finding.observed, **extra},
        finding.device,
        finding.category_override,
    )


# --- storage.write ---------------------------------------------------------------------------------

HINT_QUOTA = (
    "uid {uid} is over its quota here: delete your own old files (checkpoints, caches, logs) or ask the storage "
    "admins for more quota (`quota -s -u {uid}`, `lfs quota -u {uid} PATH`)"
)
HINT_READ_ONLY = (
    "the filesystem is read-only (often remounted so after I/O errors: check dmesg); fix the disk or export, "
    "then remount it read-write"
)
_WRITE_CHUNK = 1 << 20


def write_probe_in_child(directory: str, file_name: str, uid: int, gid: int, nbytes: int) -> dict[str, Any]:
    """Runs in a child: become uid/gid, write nbytes to a new file, fsync, close, unlink.

    Returns {"stage", "errno", "error", "statvfs"} (stage "done" and errno None on success). As the job's
    uid, not root: root bypasses quota hard limits (CAP_SYS_RESOURCE) and uses reserved blocks. NFS
    reports ENOSPC/EDQUOT late (at fsync or close), so each stage is checked. Random bytes, because
    compressing filesystems (ZFS, btrfs) store zeros without allocating anything.
    """
    stage = "switch to uid/gid"
    path = os.path.join(directory, file_name)
    fd = -1
    created = False
    try:
        if (uid, gid) != (os.geteuid(), os.getegid()):
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        stage = "open"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        created = True
        stage = "write"
        chunk = os.urandom(min(nbytes, _WRITE_CHUNK))
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[: min(left, len(chunk))])
        stage = "fsync"
        os.fsync(fd)
        stage = "close"
        closing, fd = fd, -1
        os.close(closing)  # Linux releases the fd even when close reports an error
        stage = "unlink"
        os.unlink(path)
        created = False
        return {"stage": "done", "errno": None, "error": "", "statvfs": None}
    except OSError as exc:
        result: dict[str, Any] = {"stage": stage, "errno": exc.errno, "error": exc.strerror or str(exc)}
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        if created:
            with contextlib.suppress(OSError):
                os.unlink(path)
        result["statvfs"] = None
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                st = os.statvfs(directory)
                result["statvfs"] = {"bavail": st.f_bavail, "files": st.f_files, "favail": st.f_favail}
            except OSError:
                pass
        return result


def write_finding(path: str, uid: int, gid: int, nbytes: int, outcome: dict[str, Any], duration: float) -> Finding:
    """Classify one write probe's outcome (from write_probe_in_child)."""
    number = outcome.get("errno")
    stage = outcome.get("stage", "?")
    st = outcome.get("statvfs")
    observed: dict[str, Any] = {"uid": uid, "gid": gid, "bytes": nbytes, "duration_seconds": round(duration, 4)}
    if number is None:
        return Finding(
            "storage.write",
            path,
            Status.OK,
            "OK",
            f"{path}: wrote, fsynced and removed {nbytes} bytes as uid {uid}:{gid} in {duration * 1000:.0f} ms",
            observed=observed,
        )
    observed.update({"errno": number, "errno_name": errno.errorcode.get(number, str(number)), "stage": stage})
    if st:
        observed.update({"free_inodes": st["favail"], "inodes": st["files"], "free_blocks": st["bavail"]})
    what = f"{path}: writing {nbytes} bytes as uid {uid}:{gid} failed at {stage} with {errno_label(number)}"

    def fail(reason: str, hint: str, status: Status = Status.FAIL) -> Finding:
        return Finding("storage.write", path, status, reason, what, hint, observed)

    if number == errno.EDQUOT:
        return fail("DiskQuotaExceeded", HINT_QUOTA.format(uid=uid))
    if number == errno.ENOSPC:
        if st and st["files"] > 0 and st["favail"] == 0:
            return fail("InodesExhausted", HINT_INODES)
        return fail("DiskFull", HINT_FULL)
    if number == errno.EROFS:
        return fail("ReadOnlyFilesystem", HINT_READ_ONLY)
    if number == errno.ESTALE:
        return fail("MountStale", "the server forgot the handle (export moved, failover): remount the filesystem")
    if number == errno.ENOENT and stage == "open":
        return fail(
            "PathMissing",
            f"create {path} writable by uid {uid}, or fix storage.write_probes; a missing shared disk looks like this",
        )
    if number in (errno.EACCES, errno.EPERM) and stage == "open":
        return fail(
            "WriteDenied",
            f"uid {uid}:{gid} may not create files in {path}: fix its owner or mode, or the probe's uid/gid",
            Status.WARN,
        )
    if stage == "switch to uid/gid":
        return Finding(
            "storage.write",
            path,
            Status.UNKNOWN,
            "WriteProbeFailed",
            what,
            "the agent needs CAP_SETUID and CAP_SETGID (a privileged pod) to write as the job's uid",
            observed,
        )
    return fail("WriteFailed", "the filesystem refused a plain write: check dmesg and the storage server")


def write_probe_file_name(node: str) -> str:
    """Per node, so nodes sharing a directory never trip over each other's probe file."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node) or "node"
    return f".node-health-write-probe.{safe}"


@register
class WriteProbe(Probe):
    """Findings use check storage.write, not storage.space as DESIGN's table lists DiskQuotaExceeded: a check
    belongs to one probe (state, freshness, `--only`), and this probe runs on its own schedule and paths.
    The reason codes are those of DESIGN."""

    name = "storage.write"
    checks = ("storage.write",)
    default_interval = 120.0
    default_timeout = 20.0
    needs = "the configured directories (storage.write_probes), CAP_SETUID/CAP_SETGID to write as the job"

    def applicable(self, ctx: ProbeContext) -> str | None:
        return None if ctx.config.storage.write_probes else "no directories configured in storage.write_probes"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        cfg = ctx.config.storage
        file_name = write_probe_file_name(ctx.config.resolved_node_name)
        calls = [
            ChildCall(
                f"write:{normalize_path(spec.path)}",
                write_probe_in_child,
                (str(ctx.host.root_path(spec.path)), file_name, spec.uid, spec.gid, spec.bytes),
                cfg.write_timeout_seconds,
            )
            for spec in cfg.write_probes
        ]
        out: ProbeOutput = []
        for spec, result in zip(cfg.write_probes, run_child_calls(ctx, calls), strict=True):
            labels = {"path": spec.path}
            if not result.ok:
                out.append(child_error_finding("storage.write", spec.path, result))
                out.append(_write_ok_sample(labels, False))
                continue
            finding = write_finding(spec.path, spec.uid, spec.gid, spec.bytes, result.value, result.duration)
            out.append(finding)
            out.append(_write_ok_sample(labels, finding.status == Status.OK))
            out.append(
                Sample(
                    "nodehealth_storage_write_seconds",
                    "Time the write probe (write, fsync, close, unlink) took, in a child process.",
                    result.duration,
                    labels,
                )
            )
        return out


def _write_ok_sample(labels: dict[str, str], ok: bool) -> Sample:
    return Sample(
        "nodehealth_storage_write_ok", "1 when the write probe succeeded as the job's uid.", float(ok), labels
    )


# --- storage.locks ---------------------------------------------------------------------------------


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
    """/proc/locks → records. Device numbers there are hex `MAJ:MIN:INODE` (major and minor in hex)."""
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
        kind = fields[1]
        # Leases and delegations print `LEASE  ACTIVE    READ` etc. with the same layout; `BREAKING` and
        # `BREAKER` variants too. Only the layout matters here.
        device = fields[5].split(":")
        try:
            pid = int(fields[4])
            major, minor, inode = int(device[0], 16), int(device[1], 16), int(device[2])
        except (ValueError, IndexError):
            raise ProbeParseError(f"/proc/locks line {number}: bad pid or MAJ:MIN:INODE: {line[:120]!r}") from None
        records.append(LockRecord(kind, fields[2], fields[3], pid, major, minor, inode, blocked))
    return records


def split_glob(pattern: str) -> tuple[str, str]:
    """`/a/b/*/x/lock` → (`/a/b`, `*/x/lock`): the non-wildcard root, and the rest (never empty)."""
    parts = normalize_path(pattern).split("/")[1:]
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


_LOCK_LIST_LIMIT = 5000
_HEAD_BYTES = 256


def list_lock_files_in_child(root: str, pattern: str, baton_names: list[str]) -> dict[str, Any]:
    """Runs in a child: the files matching `pattern` under `root`, lstat'ed (never followed).

    Returns {"files": [(relative path, mode, dev, ino, size, mtime, mtime_ns, head bytes or None)],
    "truncated": bool}. The head (first bytes) is read only where the style depends on it.
    """
    files = []
    truncated = False
    for rel in sorted(glob.glob(pattern, root_dir=root)):
        if len(files) >= _LOCK_LIST_LIMIT:
            truncated = True
            break
        full = os.path.join(root, rel)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            continue
        head = None
        name = os.path.basename(rel)
        if stat.S_ISREG(st.st_mode) and not any(fnmatch.fnmatchcase(name, p) for p in baton_names):
            try:
                fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                try:
                    head = os.read(fd, _HEAD_BYTES)
                finally:
                    os.close(fd)
            except OSError:
                head = None
        files.append((rel, st.st_mode, st.st_dev, st.st_ino, st.st_size, st.st_mtime, st.st_mtime_ns, head))
    return {"files": files, "truncated": truncated}


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


@dataclass
class _GlobVerdict:
    stale_local: list[dict[str, Any]]
    stale_shared: list[dict[str, Any]]
    held: int = 0
    young: int = 0
    flock_locked: int = 0
    flock_waiters: int = 0
    flock_unlocked: int = 0
    not_regular: int = 0


def _path_list(items: Sequence[dict[str, Any]], limit: int = 3) -> str:
    shown = ", ".join(item["path"] for item in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


# Process names of Python jobs as /proc/PID/comm shows them (torch renames its main thread pt_main_thread).
_PYTHON_COMMS = ("python", "pt_main_thread", "torchrun", "accelerate", "deepspeed")
# Kernel wait channels of a process sleeping in time.sleep() between checks of the lock.
_SLEEP_WCHANS = ("hrtimer_nanosleep", "do_nanosleep", "clock_nanosleep", "0", "")


def read_text_or_empty(path: Any) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(4096).decode("utf-8", "replace")
    except OSError:
        return ""


def lock_waiter_candidates(proc: Any, limit: int) -> list[int]:
    """Sleeping Python processes that may be polling a lock file (FileBaton.wait sleeps between checks)."""
    found = []
    me = os.getpid()
    for pid in list_pids(proc):
        if pid == me:
            continue
        comm = read_text_or_empty(os.path.join(proc, str(pid), "comm")).strip()
        if not comm.startswith(_PYTHON_COMMS):
            continue
        wchan = read_text_or_empty(os.path.join(proc, str(pid), "wchan")).strip()
        if wchan not in _SLEEP_WCHANS:
            continue
        found.append(pid)
        if len(found) >= limit:
            break
    return found


def match_waited_lock(waited: str, stale: list[tuple[str, dict[str, Any]]]) -> tuple[str | None, dict[str, Any]]:
    """The stale lock a waiter waits on. The waiter may see the path through its own mount namespace
    (a container), so a path that ends with the lock's path below its glob root counts too. A waiter
    whose frames do not show the path ("") is matched when there is only one stale lock."""
    for pattern, item in stale:
        if waited and (waited == item["path"] or waited.endswith("/" + item["rel"])):
            return pattern, item
    if waited == "" and len(stale) == 1:
        return stale[0]
    return None, {}


@register
class LocksProbe(Probe):
    name = "storage.locks"
    checks = ("storage.locks",)
    default_interval = 60.0
    default_timeout = 20.0
    needs = "the lock directories (storage.lock_globs), /proc/locks, every /proc/*/fd (hostPID, CAP_SYS_PTRACE)"

    def __init__(self) -> None:
        self._removed_total: dict[str, int] = {}

    def applicable(self, ctx: ProbeContext) -> str | None:
        return None if ctx.config.storage.lock_globs else "no lock globs configured in storage.lock_globs"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        cfg = ctx.config.storage
        splits = [split_glob(pattern) for pattern in cfg.lock_globs]
        calls = [
            ChildCall(
                f"locks:{pattern}",
                list_lock_files_in_child,
                (str(ctx.host.root_path(root)), rest, list(cfg.baton_lock_names)),
                cfg.locks_timeout_seconds,
            )
            for pattern, (root, rest) in zip(cfg.lock_globs, splits, strict=True)
        ]
        results = run_child_calls(ctx, calls)
        table = read_mount_table(ctx)
        proc_locks = parse_proc_locks(ctx.host.proc_path("locks").read_text(errors="replace"))
        locked = {r.file_key for r in proc_locks if not r.blocked}
        waiting = {r.file_key for r in proc_locks if r.blocked}
        now = time.time()

        # Old existence-style locks need the (costly) fd scan: one pass for all of them.
        listed: dict[str, list[dict[str, Any]]] = {}
        candidates: set[tuple[int, int]] = set()
        for pattern, (root, _), result in zip(cfg.lock_globs, splits, results, strict=True):
            if not result.ok:
                continue
            items = []
            for rel, mode, dev, ino, size, mtime, mtime_ns, head in result.value["files"]:
                style = lock_style(os.path.basename(rel), head, cfg.baton_lock_names) if stat.S_ISREG(mode) else ""
                item = {
                    "path": os.path.join(root, rel),
                    "rel": rel,
                    "root": root,
                    "regular": stat.S_ISREG(mode),
                    "dev": dev,
                    "ino": ino,
                    "size": size,
                    "mtime_ns": mtime_ns,
                    "age_seconds": round(max(0.0, now - mtime)),
                    "style": style,
                }
                items.append(item)
                if style in ("baton", "soft") and now - mtime >= cfg.stale_lock_age_seconds:
                    candidates.add((dev, ino))
            listed[pattern] = items
        holders: dict[tuple[int, int], list[int]] = {}
        scan_error = ""
        unreadable = 0
        if candidates:
            try:
                scan = scan_open_files(ctx.host, inodes=candidates, timeout=ctx.remaining())
            except ScanError as exc:
                scan_error = str(exc)
            else:
                unreadable = scan.permission_denied
                for match in scan.matches:
                    holders.setdefault((match.key[1], match.key[2]), []).append(match.pid)

        out: ProbeOutput = []
        stale_items: list[tuple[str, dict[str, Any]]] = []
        total_stale = {"local": 0, "shared": 0}
        for pattern, result in zip(cfg.lock_globs, results, strict=True):
            if not result.ok:
                out.append(child_error_finding("storage.locks", pattern, result))
                continue
            verdict = _GlobVerdict([], [])
            needs_scan = False
            for item in listed[pattern]:
                if not item["regular"]:
                    verdict.not_regular += 1  # a symlink named like a lock is never followed nor judged
                    continue
                file_key = (os.major(item["dev"]), os.minor(item["dev"]), item["ino"])
                if item["style"] == "flock":
                    if file_key in locked:
                        verdict.flock_locked += 1
                    else:
                        verdict.flock_unlocked += 1  # a leftover of a finished or killed holder: harmless
                    if file_key in waiting:
                        verdict.flock_waiters += 1
                    continue
                if (item["dev"], item["ino"]) not in candidates:
                    verdict.young += 1
                    continue
                if scan_error:
                    needs_scan = True
                    continue
                pids = holders.get((item["dev"], item["ino"]))
                if pids:
                    verdict.held += 1
                    continue
                host_path = item["path"]
                mount = mount_containing(table, host_path, item["dev"])
                item["fstype"] = mount.fstype if mount else "unknown"
                shared = mount is None or fstype_matches(mount.fstype, cfg.shared_fstypes)
                (verdict.stale_shared if shared else verdict.stale_local).append(item)
            total_stale["local"] += len(verdict.stale_local)
            total_stale["shared"] += len(verdict.stale_shared)
            removed: list[dict[str, Any]] = []
            kept: list[dict[str, Any]] = []
            if cfg.remove_stale_locks and verdict.stale_local:
                removed, kept = self._remove(ctx, pattern, verdict.stale_local)
            else:
                kept = verdict.stale_local
            stale_items.extend((pattern, item) for item in kept + verdict.stale_shared)
            out.append(self._finding(ctx, pattern, verdict, removed, kept, needs_scan, scan_error, unreadable))
            out.append(
                Sample(
                    "nodehealth_storage_stale_locks",
                    "Stale lock files (no holder on this node, older than the threshold) left after removal.",
                    len(kept) + len(verdict.stale_shared),
                    {"glob": pattern},
                )
            )
        if stale_items and cfg.lock_waiter_max_processes:
            out.extend(self._waiters(ctx, stale_items))
        for pattern in cfg.lock_globs:
            out.append(
                Sample(
                    "nodehealth_storage_stale_locks_removed_total",
                    "Stale node-local lock files the agent removed (storage.remove_stale_locks).",
                    self._removed_total.get(pattern, 0),
                    {"glob": pattern},
                    kind="counter",
                )
            )
        return out

    def _waiters(self, ctx: ProbeContext, stale: list[tuple[str, dict[str, Any]]]) -> list[Finding]:
        """Processes stuck waiting on a stale lock, found with py-spy (the diagnose classification)."""
        cfg = ctx.config.storage
        waiters: dict[str, list[dict[str, Any]]] = {}
        for pid in lock_waiter_candidates(ctx.host.proc, cfg.lock_waiter_max_processes):
            if ctx.remaining(0) < 2.0:
                break
            py_spy = cfg.py_spy_command[0] if cfg.py_spy_command else "py-spy"
            path = waiting_on_lock(pid, min(3.0, ctx.remaining() - 1.0), py_spy=py_spy, proc=ctx.host.proc)
            if path is None:
                continue
            pattern, item = match_waited_lock(path, stale)
            if pattern is None:
                continue
            command = read_text_or_empty(ctx.host.proc_path(pid, "cmdline")).replace("\0", " ").strip()
            waiters.setdefault(pattern, []).append({"pid": pid, "command": command[:200], "lock": item["path"]})
        findings = []
        for pattern, found in waiters.items():
            names = ", ".join(f"pid {w['pid']} ({w['command'][:60] or '?'})" for w in found[:5])
            findings.append(
                Finding(
                    "storage.locks",
                    f"{pattern} waiters",
                    Status.FAIL,
                    "ProcessWaitingOnFileBaton",
                    f"{len(found)} process(es) waiting on a stale lock: {names}",
                    f"the lock has no holder: remove it (rm {found[0]['lock']}) and the waiting job continues; "
                    "node-health diagnose PID shows the stack",
                    {"waiters": found[:20]},
                )
            )
        return findings

    def _remove(
        self, ctx: ProbeContext, pattern: str, stale: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        removed, kept = [], []
        for item in stale:
            result = ctx.host.child_call(
                f"locks-remove:{pattern}",
                remove_lock_if_unchanged,
                str(ctx.host.root_path(item["root"])),
                item["rel"],
                item["dev"],
                item["ino"],
                item["mtime_ns"],
                timeout=min(ctx.config.storage.locks_timeout_seconds, ctx.remaining()),
            )
            outcome = result.value if result.ok else f"failed: {result.error or result.state}"
            if outcome == "removed":
                log.warning(
                    "removed stale lock %s (age %ss, inode %s, no holder on this node)",
                    item["path"],
                    item["age_seconds"],
                    item["ino"],
                )
                self._removed_total[pattern] = self._removed_total.get(pattern, 0) + 1
                removed.append(item)
            else:
                log.warning("did not remove stale lock %s: %s", item["path"], outcome)
                kept.append({**item, "not_removed": outcome})
        return removed, kept

    def _finding(
        self,
        ctx: ProbeContext,
        pattern: str,
        verdict: _GlobVerdict,
        removed: list[dict[str, Any]],
        kept: list[dict[str, Any]],
        needs_scan: bool,
        scan_error: str,
        unreadable: int,
    ) -> Finding:
        age = ctx.config.storage.stale_lock_age_seconds

        def brief(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
            keys = ("path", "age_seconds", "ino", "style", "fstype", "not_removed")
            return [{k: item[k] for k in keys if k in item} for item in items[:20]]

        observed: dict[str, Any] = {
            "held": verdict.held,
            "young": verdict.young,
            "flock_locked": verdict.flock_locked,
            "flock_waiters": verdict.flock_waiters,
            "flock_unlocked": verdict.flock_unlocked,
            "not_regular": verdict.not_regular,
            "stale_local": brief(kept),
            "stale_shared": brief(verdict.stale_shared),
            "removed": brief(removed),
            "unreadable_processes": unreadable,
        }
        if kept:
            return Finding(
                "storage.locks",
                pattern,
                Status.FAIL,
                "StaleFileBaton",
                f"{len(kept)} stale lock(s) with no holder on this node, older than {age:g}s: {_path_list(kept)}",
                "every job that builds or loads this torch extension (or model) waits on it forever: remove "
                "the file (rm PATH) or set storage.remove_stale_locks: true",
                observed,
            )
        if needs_scan:
            return Finding(
                "storage.locks",
                pattern,
                Status.UNKNOWN,
                "LockScanFailed",
                f"old lock files found but the scan of open files failed: {scan_error}",
                "a hung filesystem can stall the /proc/*/fd scan: check storage.mounts",
                observed,
            )
        if verdict.stale_shared:
            return Finding(
                "storage.locks",
                pattern,
                Status.WARN,
                "StaleLockShared",
                f"{len(verdict.stale_shared)} lock(s) on a shared filesystem older than {age:g}s with no holder "
                f"on this node: {_path_list(verdict.stale_shared)}",
                "a holder on another node is invisible from here: check that no job on any node is building or "
                "downloading into it (lsof/fuser there), then remove the file",
                observed,
            )
        if removed:
            return Finding(
                "storage.locks",
                pattern,
                Status.WARN,
                "StaleLockRemoved",
                f"removed {len(removed)} stale node-local lock(s): {_path_list(removed)}",
                "nothing to do; jobs that waited on it proceed. Frequent removals mean jobs get killed while "
                "building extensions",
                observed,
                # The reconciler turns this into a Kubernetes event on the Node: a deletion is always told.
                event=Event("StaleLockRemoved", f"removed {_path_list(removed)}"),
            )
        return Finding(
            "storage.locks",
            pattern,
            Status.OK,
            "OK",
            f"no stale locks ({verdict.held} held, {verdict.young} recent, {verdict.flock_locked} flock-locked, "
            f"{verdict.flock_unlocked} unlocked flock files)",
            observed=observed,
        )


# --- storage.model_cache ---------------------------------------------------------------------------

_COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")
_LIST_LIMIT = 50


def hub_repo_folder(repo_id: str) -> str:
    """huggingface_hub's folder name of a model repo: `org/name` → `models--org--name`."""
    return "models--" + repo_id.replace("/", "--")


def inspect_model_cache_in_child(cache_dir: str, repo_id: str, revision: str) -> dict[str, Any]:
    """Runs in a child: is the snapshot of repo_id@revision complete in a Hugging Face hub cache?

    Layout: <cache>/models--org--name/{refs/<branch> → commit, snapshots/<commit>/<file> → ../../blobs/<hash>,
    blobs/<hash>[.incomplete]}. Returns {"missing": why} or the lists of problems found.
    """
    repo_dir = os.path.join(cache_dir, hub_repo_folder(repo_id))
    if not os.path.isdir(repo_dir):
        return {"missing": f"no {hub_repo_folder(repo_id)} in the cache"}
    commit = revision
    try:
        with open(os.path.join(repo_dir, "refs", revision)) as handle:
            commit = handle.read().strip()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        if not _COMMIT_HASH.match(revision):
            return {"missing": f"no ref {revision!r} (refs/{revision})"}
    snapshot = os.path.join(repo_dir, "snapshots", commit)
    if not os.path.isdir(snapshot):
        return {"missing": f"no snapshot {commit}", "commit": commit}
    files = 0
    dangling: list[str] = []
    incomplete: list[str] = []
    present: set[str] = set()
    index_files: list[str] = []
    for dirpath, _dirnames, filenames in os.walk(snapshot):
        for name in filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, snapshot)
            files += 1
            if os.path.islink(full) and not os.path.exists(full):
                target = os.path.normpath(os.path.join(dirpath, os.readlink(full)))
                (incomplete if os.path.exists(target + ".incomplete") else dangling).append(rel)
                continue
            present.add(rel)
            if name.endswith(".index.json"):
                index_files.append(rel)
    missing_shards: list[str] = []
    bad_indexes: list[str] = []
    for rel in index_files:
        try:
            with open(os.path.join(snapshot, rel)) as handle:
                weight_map = json.load(handle)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            bad_indexes.append(rel)
            continue
        base = os.path.dirname(rel)
        for shard in shards:
            shard_rel = os.path.normpath(os.path.join(base, str(shard)))
            if shard_rel not in present and shard_rel not in dangling and shard_rel not in incomplete:
                missing_shards.append(shard_rel)
    partial_blobs: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        partial_blobs = sorted(n for n in os.listdir(os.path.join(repo_dir, "blobs")) if n.endswith(".incomplete"))
    return {
        "missing": None,
        "commit": commit,
        "files": files,
        "dangling": sorted(dangling)[:_LIST_LIMIT],
        "incomplete": sorted(incomplete)[:_LIST_LIMIT],
        "missing_shards": sorted(set(missing_shards))[:_LIST_LIMIT],
        "bad_indexes": bad_indexes[:_LIST_LIMIT],
        "partial_blobs": partial_blobs[:_LIST_LIMIT],
    }


def model_cache_finding(subject: str, repo_id: str, revision: str, cache_dir: str, info: dict[str, Any]) -> Finding:
    download = f"huggingface-cli download {repo_id} --revision {revision} --cache-dir {cache_dir}"
    if info.get("missing"):
        return Finding(
            "storage.model_cache",
            subject,
            Status.FAIL,
            "ModelCacheMissing",
            f"{repo_id}@{revision} is not in {cache_dir}: {info['missing']}",
            f"download it before the jobs need it ({download}), or fix storage.model_caches",
            {"detail": info["missing"], "commit": info.get("commit")},
        )
    problems = []
    labels = (
        ("missing_shards", "missing shards"),
        ("dangling", "links to missing blobs"),
        ("incomplete", "interrupted downloads"),
        ("partial_blobs", "partial blobs"),
        ("bad_indexes", "unreadable shard indexes"),
    )
    for key, label in labels:
        if info[key]:
            problems.append(f"{label}: {', '.join(info[key][:5])}" + (" ..." if len(info[key]) > 5 else ""))
    observed = {key: info[key] for key, _ in labels}
    observed.update({"commit": info["commit"], "files": info["files"]})
    if problems:
        return Finding(
            "storage.model_cache",
            subject,
            Status.FAIL,
            "ModelCacheIncomplete",
            f"{repo_id}@{revision} in {cache_dir} is incomplete: {'; '.join(problems)}",
            f"resume the download ({download}); if it keeps failing delete the snapshot and the .incomplete "
            "blobs and download again. Jobs in offline mode fail on this cache",
            observed,
        )
    return Finding(
        "storage.model_cache",
        subject,
        Status.OK,
        "OK",
        f"{repo_id}@{revision} in {cache_dir}: {info['files']} files, complete",
        observed=observed,
    )


@register
class ModelCacheProbe(Probe):
    name = "storage.model_cache"
    checks = ("storage.model_cache",)
    default_interval = 300.0
    default_timeout = 30.0
    needs = "the model caches (storage.model_caches)"

    def applicable(self, ctx: ProbeContext) -> str | None:
        return None if ctx.config.storage.model_caches else "no caches configured in storage.model_caches"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        cfg = ctx.config.storage
        subjects = [f"{spec.cache_dir}:{spec.repo_id}@{spec.revision}" for spec in cfg.model_caches]
        calls = [
            ChildCall(
                f"model-cache:{subject}",
                inspect_model_cache_in_child,
                (str(ctx.host.root_path(spec.cache_dir)), spec.repo_id, spec.revision),
                cfg.model_cache_timeout_seconds,
            )
            for spec, subject in zip(cfg.model_caches, subjects, strict=True)
        ]
        out: ProbeOutput = []
        for spec, subject, result in zip(cfg.model_caches, subjects, run_child_calls(ctx, calls), strict=True):
            if result.ok:
                finding = model_cache_finding(subject, spec.repo_id, spec.revision, spec.cache_dir, result.value)
            else:
                finding = child_error_finding("storage.model_cache", subject, result)
            out.append(finding)
            out.append(
                Sample(
                    "nodehealth_storage_model_cache_complete",
                    "1 when the model snapshot is present and complete in the cache.",
                    float(finding.status == Status.OK),
                    {"cache_dir": spec.cache_dir, "repo_id": spec.repo_id, "revision": spec.revision},
                )
            )
        return out
