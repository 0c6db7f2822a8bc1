"""storage.write: write N bytes as the job's uid/gid, fsync, close, unlink → quota, full, inodes, read-only.

Quota findings (DiskQuotaExceeded) use check storage.write, not storage.space: a check belongs to one probe
(state, freshness, `--only`), and this probe runs on its own schedule and paths. Both are in the storage
category, so the taint and condition are the same.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from typing import Any

from probes.base import (
    Check,
    Finding,
    Probe,
    ProbeContext,
    ProbeOutput,
    Reason,
    Sample,
    Status,
    register,
)
from probes.runtime.paths import normalize_host_path
from probes.storage.common import (
    CHILD_REASONS,
    DISK_FULL,
    INODES_EXHAUSTED,
    MOUNT_STALE,
    PATH_MISSING,
    ChildCall,
    agent_path_in_child,
    dead_mount_finding,
    errno_label,
    is_dead_mount,
    mount_entry_of,
    path_failure_finding,
    run_child_calls,
)
from probes.storage.config import StorageConfig, WriteProbeSpec
from probes.storage.mounttable import MountEntry
from probes.storage.quota import QuotaKind, quota_facts_in_child, quota_kind

WRITE = Check("storage.write")
DISK_QUOTA_EXCEEDED = Reason(
    "DiskQuotaExceeded",
    Status.FAIL,
    "EDQUOT (errno 122) writing as the job's uid, at write, fsync or close; the hint says which quota (user, "
    "group, project, btrfs qgroup) where the filesystem tells, else how to see each",
    "a quota is used up for the job's uid, gid or the directory's project: delete your own old files "
    "(checkpoints, caches, logs) or ask the storage admins for more; see which with `quota -s -u UID`, "
    "`quota -s -g GID`, `repquota -P -s MOUNT` or `xfs_quota -x -c 'report -p -h' MOUNT` (project), "
    "`btrfs qgroup show -reF PATH` (btrfs), `lfs quota -u/-g/-p` (Lustre)",
)
READ_ONLY_FILESYSTEM = Reason(
    "ReadOnlyFilesystem",
    Status.FAIL,
    "EROFS (errno 30): the filesystem is read-only",
    "the filesystem is read-only (often remounted so after I/O errors: check dmesg); fix the disk or export, "
    "then remount it read-write",
)
WRITE_DENIED = Reason(
    "WriteDenied",
    Status.WARN,
    "EACCES/EPERM creating the probe file as the job's uid/gid",
    "fix the directory's owner or mode, or the probe's uid/gid (storage.write_probes, storage.write_uid / write_gid)",
)
WRITE_FAILED = Reason(
    "WriteFailed",
    Status.FAIL,
    "the write failed with another errno (EIO...)",
    "the filesystem refused a plain write: check dmesg and the storage server",
)
WRITE_PROBE_FAILED = Reason(
    "WriteProbeFailed",
    Status.UNKNOWN,
    "the agent could not switch to the job's uid/gid",
    "the agent needs CAP_SETUID and CAP_SETGID (a privileged pod) to write as the job's uid",
)
_WRITE_CHUNK = 1 << 20


def write_probe_in_child(root: str, host_path: str, file_name: str, uid: int, gid: int, nbytes: int) -> dict[str, Any]:
    """Runs in a child: resolve the host path inside the host root, become uid/gid, write nbytes to a new
    file, fsync, close, unlink.

    Returns {"stage", "errno", "error", "statvfs", "quota"} (stage "done" and errno None on success). As the
    job's uid, not root: root bypasses quota hard limits (CAP_SYS_RESOURCE) and uses reserved blocks. NFS
    reports ENOSPC/EDQUOT late (at fsync or close), so each stage is checked. Random bytes, because
    compressing filesystems (ZFS, btrfs) store zeros without allocating anything.
    """
    stage = "resolve the path"
    directory = path = ""
    fd = -1
    created = False
    try:
        directory = agent_path_in_child(root, host_path)
        path = os.path.join(directory, file_name)
        stage = "switch to uid/gid"
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
        return {"stage": "done", "errno": None, "error": "", "statvfs": None, "quota": None}
    except OSError as exc:
        return _write_failure(exc, stage, directory, path, fd, created)


def _write_failure(exc: OSError, stage: str, directory: str, path: str, fd: int, created: bool) -> dict[str, Any]:
    """Runs in the child: clean up after a failed stage and describe it (with statvfs after ENOSPC/EDQUOT)."""
    result: dict[str, Any] = {
        "stage": stage,
        "errno": exc.errno,
        "error": exc.strerror or str(exc),
        "statvfs": None,
        "quota": None,
    }
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
    if created:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        with contextlib.suppress(OSError):
            st = os.statvfs(directory)
            result["statvfs"] = {"bavail": st.f_bavail, "files": st.f_files, "favail": st.f_favail}
    if exc.errno == errno.EDQUOT:
        result["quota"] = quota_facts_in_child(directory)
    return result


def write_finding(
    spec: WriteProbeSpec,
    outcome: dict[str, Any],
    duration: float,
    *,
    ids: tuple[int, int] | None = None,
    mount: MountEntry | None = None,
) -> Finding:
    """Classify one write probe's outcome (from write_probe_in_child). `ids`: the uid and gid it ran as
    (default: the spec's); `mount`: the host mount the directory is on, when known (which quota, FUSE)."""
    path = spec.path
    uid, gid = ids if ids is not None else (spec.uid or 0, spec.gid or 0)
    number = outcome.get("errno")
    stage = outcome.get("stage", "?")
    st = outcome.get("statvfs")
    observed: dict[str, Any] = {"uid": uid, "gid": gid, "bytes": spec.bytes, "duration_seconds": round(duration, 4)}
    if number is None:
        message = (
            f"{path}: wrote, fsynced and removed {spec.bytes} bytes as uid {uid}:{gid} in {duration * 1000:.0f} ms"
        )
        return WRITE.ok(path, message, observed)
    observed.update({"errno": number, "errno_name": errno.errorcode.get(number, str(number)), "stage": stage})
    if st:
        observed.update({"free_inodes": st["favail"], "inodes": st["files"], "free_blocks": st["bavail"]})
    if is_dead_mount(number, mount.fstype if mount else None):
        point = mount.mount_point if mount else path
        return dead_mount_finding(WRITE, path, point, number, mount.fstype if mount else None, observed)
    what = f"{path}: writing {spec.bytes} bytes as uid {uid}:{gid} failed at {stage} with {errno_label(number)}"
    if number == errno.EDQUOT:
        kind = quota_of(path, uid, gid, outcome.get("quota") or {}, mount)
        observed.update({"quota_kind": kind.kind or "unknown", "quota": kind.what})
        return WRITE.report(DISK_QUOTA_EXCEEDED, path, f"{what}: {kind.what}", observed, hint=kind.hint())
    reason, hint = _classify(spec, uid, gid, number, stage, st)
    return WRITE.report(reason, path, what, observed, hint=hint)


def quota_of(path: str, uid: int, gid: int, facts: dict[str, Any], mount: MountEntry | None) -> QuotaKind:
    options = f"{mount.options},{mount.super_options}" if mount else ""
    return quota_kind(
        path,
        mount.mount_point if mount else path,
        mount.fstype if mount else "",
        options,
        uid,
        gid,
        facts.get("project_id"),
        facts.get("btrfs_subvolume"),
    )


def _classify(
    spec: WriteProbeSpec, uid: int, gid: int, number: int, stage: str, st: dict[str, int] | None
) -> tuple[Reason, str | None]:
    """The reason of a failed write, and a hint naming this probe's path and uid where that helps."""
    if stage == "switch to uid/gid":
        return WRITE_PROBE_FAILED, None
    if number == errno.ENOSPC:
        if st and st["files"] > 0 and st["favail"] == 0:
            return INODES_EXHAUSTED, None
        return DISK_FULL, None
    if number == errno.EROFS:
        return READ_ONLY_FILESYSTEM, None
    if number == errno.ESTALE:
        return MOUNT_STALE, None
    if number == errno.ENOENT and stage == "open":
        hint = (
            f"create {spec.path} writable by uid {uid}, or fix storage.write_probes; a missing shared disk "
            "looks like this"
        )
        return PATH_MISSING, hint
    if number in (errno.EACCES, errno.EPERM) and stage == "open":
        hint = (
            f"uid {uid}:{gid} may not create files in {spec.path}: fix its owner or mode, or the "
            "probe's uid/gid (storage.write_probes, storage.write_uid / write_gid)"
        )
        return WRITE_DENIED, hint
    return WRITE_FAILED, None


def write_probe_file_name(node: str) -> str:
    """Per node, so nodes sharing a directory never trip over each other's probe file."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node) or "node"
    return f".node-health-write-probe.{safe}"


@register
class WriteProbe(Probe):
    name = "storage.write"
    checks = ("storage.write",)
    reasons = (
        DISK_QUOTA_EXCEEDED,
        DISK_FULL,
        INODES_EXHAUSTED,
        READ_ONLY_FILESYSTEM,
        WRITE_DENIED,
        WRITE_FAILED,
        WRITE_PROBE_FAILED,
        *CHILD_REASONS,
    )
    default_interval = 120.0
    default_timeout = 20.0
    needs = "the configured directories (storage.write_probes), CAP_SETUID/CAP_SETGID to write as the job"
    skip_when_empty = ("write_probes",)

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(StorageConfig)
        file_name = write_probe_file_name(ctx.node_name)
        root = str(ctx.host.root)
        calls = [
            ChildCall(
                f"write:{normalize_host_path(spec.path)}",
                write_probe_in_child,
                (root, normalize_host_path(spec.path), file_name, *settings.write_ids(spec), spec.bytes),
                settings.write_timeout_seconds,
            )
            for spec in settings.write_probes
        ]
        out: ProbeOutput = []
        for spec, result in zip(settings.write_probes, run_child_calls(ctx, calls), strict=True):
            labels = {"path": spec.path}
            if not result.ok:
                out += [path_failure_finding(ctx, WRITE, spec.path, spec.path, result), write_ok_sample(labels, False)]
                continue
            ids = settings.write_ids(spec)
            mount = mount_entry_of(ctx, spec.path) if result.value.get("errno") is not None else None
            finding = write_finding(spec, result.value, result.duration, ids=ids, mount=mount)
            out += [finding, write_ok_sample(labels, finding.status == Status.OK)]
            out.append(
                Sample(
                    "nodehealth_storage_write_seconds",
                    "Time the write probe (write, fsync, close, unlink) took, in a child process.",
                    result.duration,
                    labels,
                )
            )
        return out


def write_ok_sample(labels: dict[str, str], ok: bool) -> Sample:
    return Sample(
        "nodehealth_storage_write_ok", "1 when the write probe succeeded as the job's uid.", float(ok), labels
    )
