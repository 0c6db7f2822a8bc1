"""storage.mounts: each expected mount's path resolved inside the host root (a configured `/data` may be a
symlink to the mount point), then the host mount table at that target, and a stat and a directory read of it,
all in one child per mount → missing, wrong type, hung, stale, dead."""

from __future__ import annotations

import errno
import fnmatch
import os
from typing import Any

from probes.base import Check, Finding, Probe, ProbeContext, ProbeOutput, Reason, Sample, Status, register
from probes.runtime.children import ChildResult
from probes.runtime.paths import normalize_host_path, resolve_under
from probes.storage.common import CHILD_REASONS, ChildCall, child_error_finding, run_child_calls, safe_text
from probes.storage.config import MountSpec, StorageConfig
from probes.storage.mounttable import MountEntry, mount_at, mount_containing, read_mount_table

MOUNTS = Check("storage.mounts")
MOUNT_MISSING = Reason(
    "MountMissing",
    Status.FAIL,
    "the path is not a mount point in the host mount table",
    "mount it (`mount PATH`, check /etc/fstab or the automounter); after maintenance shared disks are often "
    "left unmounted and jobs write into the empty directory instead",
)
MOUNT_WRONG_TYPE = Reason(
    "MountWrongType",
    Status.FAIL,
    "mounted, but the fstype or source differ from the config",
    "something else is mounted there (a local disk, the wrong export): unmount it and mount the expected filesystem",
)


def locate_and_stat_in_child(root: str, path: str) -> dict[str, Any]:
    """Runs in a child: resolve the path's symlinks inside the host root, then stat the target and read one
    directory entry (both reach the server). A failing stat comes back with the target, so the mount table
    is consulted for the path the host really means; a failing resolution (a dead mount on the way) raises."""
    target = resolve_under(root, path)
    full = os.path.join(root, target.lstrip("/"))
    try:
        st = os.stat(full)
        with os.scandir(full) as entries:
            first = next(entries, None)
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        return {"target": target, "errno": exc.errno, "error": f"{exc.strerror or exc} ({name})"}
    return {"target": target, "errno": None, "dev": st.st_dev, "empty": first is None}


def shown_path(path: str, target: str | None) -> str:
    """`/data`, or `/data (a symlink to /mnt/disk)` when the host resolves it elsewhere."""
    if target is None or target == normalize_host_path(path):
        return safe_text(path)
    return f"{safe_text(path)} (a symlink to {safe_text(target)})"


def mount_table_finding(spec: MountSpec, entry: MountEntry | None, target: str | None = None) -> Finding | None:
    """MountMissing / MountWrongType from the mount table alone; None when the entry is as expected.
    `target` is the path with its symlinks resolved, when it differs."""
    if entry is None:
        return missing_finding(spec, target)
    return wrong_type_finding(spec, entry, target)


def _expected(spec: MountSpec, target: str | None) -> dict[str, Any]:
    expected: dict[str, Any] = {"expected_fstype": spec.fstype, "expected_source": spec.source}
    if target is not None and target != normalize_host_path(spec.path):
        expected["target"] = target
    return expected


def missing_finding(spec: MountSpec, target: str | None) -> Finding:
    source = f" from {spec.source}" if spec.source else ""
    message = f"{shown_path(spec.path, target)} is not mounted (expected {spec.fstype}{source})"
    return MOUNTS.report(MOUNT_MISSING, spec.path, message, _expected(spec, target))


def wrong_type_finding(spec: MountSpec, entry: MountEntry, target: str | None) -> Finding | None:
    wrong = []
    if not fnmatch.fnmatchcase(entry.fstype, spec.fstype):
        wrong.append(f"type {entry.fstype}, expected {spec.fstype}")
    if spec.source is not None and not fnmatch.fnmatchcase(entry.source, spec.source):
        wrong.append(f"source {safe_text(entry.source)}, expected {spec.source}")
    if not wrong:
        return None
    observed = {"fstype": entry.fstype, "source": entry.source, **_expected(spec, target)}
    message = f"{shown_path(spec.path, target)} is mounted with {'; '.join(wrong)}"
    return MOUNTS.report(MOUNT_WRONG_TYPE, spec.path, message, observed)


def located_mount_findings(spec: MountSpec, table: list[MountEntry], result: ChildResult) -> list[Finding | Sample]:
    """The findings of one expected mount from its child's answer: the mount table judged at the resolved
    target, then the stat's outcome."""
    literal = mount_at(table, spec.path)
    if not result.ok:
        near = literal or mount_containing(table, spec.path)
        point = (near.mount_point, near.fstype) if near else None
        extra = {"fstype": near.fstype, "source": near.source} if near else {}
        return [child_error_finding(MOUNTS, spec.path, result, extra, mount=point), mount_ok_sample(spec.path, False)]
    answer = result.value
    target = answer["target"]
    entry = mount_at(table, target)
    if entry is None:
        return [missing_finding(spec, target), mount_ok_sample(spec.path, False)]
    problem = wrong_type_finding(spec, entry, target)
    if problem is not None:
        return [problem, mount_ok_sample(spec.path, False)]
    shown = shown_path(spec.path, target)
    mount = {"fstype": entry.fstype, "source": entry.source}
    if target != normalize_host_path(spec.path):
        mount["target"] = target
    if answer["errno"] is not None:
        failed = ChildResult("error", errno=answer["errno"], error=answer["error"], duration=result.duration)
        finding = child_error_finding(MOUNTS, spec.path, failed, mount, mount=(entry.mount_point, entry.fstype))
        return [finding, mount_ok_sample(spec.path, False)]
    message = f"{shown}: {entry.fstype} from {safe_text(entry.source)} answered in {result.duration * 1000:.0f} ms"
    latency = Sample(
        "nodehealth_storage_mount_latency_seconds",
        "Time a stat and a directory read of the mount point took, in a child process.",
        result.duration,
        {"path": spec.path},
    )
    ok = MOUNTS.ok(spec.path, message, {**mount, "latency_seconds": round(result.duration, 4)})
    return [ok, mount_ok_sample(spec.path, True), latency]


@register
class MountsProbe(Probe):
    name = "storage.mounts"
    checks = ("storage.mounts",)
    reasons = (MOUNT_MISSING, MOUNT_WRONG_TYPE, *CHILD_REASONS)
    default_interval = 30.0
    default_timeout = 10.0
    needs = "the host mount table (/proc/1/mountinfo, hostPID) and the configured mounts (storage.mounts)"
    skip_when_empty = ("mounts",)

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(StorageConfig)
        table = read_mount_table(ctx)
        calls = [
            ChildCall(
                f"mount:{normalize_host_path(spec.path)}",
                locate_and_stat_in_child,
                (str(ctx.host.root), normalize_host_path(spec.path)),
                settings.mount_timeout_seconds,
            )
            for spec in settings.mounts
        ]
        out: ProbeOutput = []
        for spec, result in zip(settings.mounts, run_child_calls(ctx, calls), strict=True):
            out += located_mount_findings(spec, table, result)
        return out


def mount_ok_sample(path: str, ok: bool) -> Sample:
    return Sample(
        "nodehealth_storage_mount_ok",
        "1 when the expected mount is present, of the right type, and answers in time.",
        1.0 if ok else 0.0,
        {"path": path},
    )
