"""Storage probes. storage.space: blocks and inodes of configured paths, statvfs in a child with a deadline."""

from __future__ import annotations

import errno

from agent.host import ChildResult, statvfs_in_child
from probes.base import Finding, Probe, ProbeContext, ProbeOutput, Sample, Status, register

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
