"""storage.space: blocks and inodes of the configured paths (statvfs in a child)."""

from __future__ import annotations

from probes.base import Check, Finding, Probe, ProbeContext, ProbeOutput, Reason, Sample, Status, register
from probes.runtime.paths import normalize_host_path
from probes.storage.common import (
    CHILD_REASONS,
    DISK_FULL,
    HINT_FULL,
    HINT_INODES,
    INODES_EXHAUSTED,
    ChildCall,
    path_failure_finding,
    run_child_calls,
    statvfs_resolved_in_child,
)
from probes.storage.config import SpaceSpec, StorageConfig

SPACE = Check("storage.space")
DISK_LOW = Reason(
    "DiskLow",
    Status.WARN,
    "blocks or inodes used at or above the warn watermark (warn_percent, warn_inodes_percent)",
    HINT_FULL,
)


def space_finding(path: str, st: dict[str, int], spec: SpaceSpec) -> Finding:
    """Judge one statvfs result against the path's watermarks."""
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
    if has_inodes and (st["favail"] == 0 or used_inodes_percent >= spec.fail_inodes_percent):
        message = (
            f"{path}: {used_inodes_percent:.1f}% of inodes used, {st['favail']} free "
            "(writes fail with ENOSPC although blocks are free)"
        )
        return SPACE.report(INODES_EXHAUSTED, path, message, observed)
    if st["bavail"] == 0 or used_percent >= spec.fail_percent:
        message = f"{path}: {used_percent:.1f}% used, {observed['free_bytes'] // (1 << 20)} MiB free"
        return SPACE.report(DISK_FULL, path, message, observed)
    if used_percent >= spec.warn_percent:
        return SPACE.report(
            DISK_LOW, path, f"{path}: {used_percent:.1f}% used (warn at {spec.warn_percent:g}%)", observed
        )
    if has_inodes and used_inodes_percent >= spec.warn_inodes_percent:
        message = f"{path}: {used_inodes_percent:.1f}% of inodes used (warn at {spec.warn_inodes_percent:g}%)"
        return SPACE.report(DISK_LOW, path, message, observed, hint=HINT_INODES)
    message = f"{path}: {used_percent:.1f}% used, {used_inodes_percent:.1f}% inodes used"
    return SPACE.ok(path, message, observed)


def space_samples(path: str, st: dict[str, int], duration: float) -> list[Sample]:
    labels = {"path": path}
    return [
        Sample(
            "nodehealth_storage_free_bytes",
            "Bytes available to unprivileged users.",
            st["bavail"] * st["frsize"],
            labels,
        ),
        Sample("nodehealth_storage_size_bytes", "Filesystem size.", st["blocks"] * st["frsize"], labels),
        Sample("nodehealth_storage_free_inodes", "Inodes available to unprivileged users.", st["favail"], labels),
        Sample("nodehealth_storage_inodes", "Inodes in the filesystem.", st["files"], labels),
        Sample("nodehealth_storage_statvfs_seconds", "Time statvfs took in a child process.", duration, labels),
    ]


@register
class SpaceProbe(Probe):
    name = "storage.space"
    checks = ("storage.space",)
    reasons = (DISK_LOW, DISK_FULL, INODES_EXHAUSTED, *CHILD_REASONS)
    default_interval = 60.0
    default_timeout = 10.0
    needs = "the configured paths (storage.space)"
    skip_when_empty = ("space",)

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(StorageConfig)
        calls = [
            ChildCall(
                f"statvfs:{normalize_host_path(spec.path)}",
                statvfs_resolved_in_child,
                (str(ctx.host.root), normalize_host_path(spec.path)),
                settings.space_timeout_seconds,
            )
            for spec in settings.space
        ]
        out: ProbeOutput = []
        for spec, result in zip(settings.space, run_child_calls(ctx, calls), strict=True):
            if not result.ok:
                out.append(path_failure_finding(ctx, SPACE, spec.path, spec.path, result))
                continue
            out.append(space_finding(spec.path, result.value, spec))
            out.extend(space_samples(spec.path, result.value, result.duration))
        return out
