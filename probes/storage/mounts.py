"""storage.mounts: the expected mounts against the host mount table, then a stat and a directory read of
each mount point in a child → missing, wrong type, hung, stale."""

from __future__ import annotations

import fnmatch
import os
from typing import Any

from probes.base import Check, Finding, Probe, ProbeContext, ProbeOutput, Reason, Sample, Status, register
from probes.runtime.paths import normalize_host_path
from probes.storage.common import CHILD_REASONS, ChildCall, child_error_finding, run_child_calls
from probes.storage.config import MountSpec, StorageConfig
from probes.storage.mounttable import MountEntry, mount_at, read_mount_table

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


def stat_and_list_in_child(path: str) -> dict[str, Any]:
    """Runs in a child: stat the mount point and read one directory entry (both reach the server)."""
    st = os.stat(path)
    with os.scandir(path) as entries:
        first = next(entries, None)
    return {"dev": st.st_dev, "empty": first is None}


def mount_table_finding(spec: MountSpec, entry: MountEntry | None) -> Finding | None:
    """MountMissing / MountWrongType from the mount table alone; None when the entry is as expected."""
    expected = {"expected_fstype": spec.fstype, "expected_source": spec.source}
    if entry is None:
        source = f" from {spec.source}" if spec.source else ""
        return MOUNTS.report(
            MOUNT_MISSING, spec.path, f"{spec.path} is not mounted (expected {spec.fstype}{source})", expected
        )
    wrong = []
    if not fnmatch.fnmatchcase(entry.fstype, spec.fstype):
        wrong.append(f"type {entry.fstype}, expected {spec.fstype}")
    if spec.source is not None and not fnmatch.fnmatchcase(entry.source, spec.source):
        wrong.append(f"source {entry.source}, expected {spec.source}")
    if not wrong:
        return None
    observed = {"fstype": entry.fstype, "source": entry.source, **expected}
    return MOUNTS.report(MOUNT_WRONG_TYPE, spec.path, f"{spec.path} is mounted with {'; '.join(wrong)}", observed)


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
        out: ProbeOutput = []
        to_probe: list[tuple[MountSpec, MountEntry]] = []
        for spec in settings.mounts:
            entry = mount_at(table, spec.path)
            problem = mount_table_finding(spec, entry)
            if problem is not None:
                out += [problem, mount_ok_sample(spec.path, False)]
            elif entry is not None:
                to_probe.append((spec, entry))
        calls = [
            ChildCall(
                f"mount:{normalize_host_path(spec.path)}",
                stat_and_list_in_child,
                (str(ctx.host.root_path(spec.path)),),
                settings.mount_timeout_seconds,
            )
            for spec, _ in to_probe
        ]
        for (spec, entry), result in zip(to_probe, run_child_calls(ctx, calls), strict=True):
            out.append(mount_ok_sample(spec.path, result.ok))
            mount = {"fstype": entry.fstype, "source": entry.source}
            if not result.ok:
                out.append(child_error_finding(MOUNTS, spec.path, result, mount))
                continue
            message = f"{spec.path}: {entry.fstype} from {entry.source} answered in {result.duration * 1000:.0f} ms"
            out.append(MOUNTS.ok(spec.path, message, {**mount, "latency_seconds": round(result.duration, 4)}))
            out.append(
                Sample(
                    "nodehealth_storage_mount_latency_seconds",
                    "Time a stat and a directory read of the mount point took, in a child process.",
                    result.duration,
                    {"path": spec.path},
                )
            )
        return out


def mount_ok_sample(path: str, ok: bool) -> Sample:
    return Sample(
        "nodehealth_storage_mount_ok",
        "1 when the expected mount is present, of the right type, and answers in time.",
        1.0 if ok else 0.0,
        {"path": path},
    )
