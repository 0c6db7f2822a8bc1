"""npu.holders: who holds each chip's /dev/davinciN (and the shared nodes), judged per chip and node-wide.

A chip held by a process outside any pod → NpuHeldOutOfBand (fail); a chip held by processes of two or more
pods → NpuSharedByPods (fail): the device plugin gave it to one pod, and a second scheduler (or a pod that
mounts /dev by hand) put another job on it. Holders of only the shared nodes (davinci_manager, devmm_svm,
hisi_hdc) outside pods → NpuHeldOutOfBand (warn). A scan that could not read some processes leaves the chips
it found no holder of unknown (NpuHolderScanFailed), naming what it could not read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from probes.base import NOT_APPLICABLE, Finding, Reason, Status
from probes.npu.findings import chip_subject
from probes.npu.info_table import NpuChip
from probes.npu.reasons import (
    HOLDERS,
    NPU_ALLOCATION_DISAGREES,
    NPU_HELD_OUT_OF_BAND,
    NPU_HELD_OUTSIDE_ALLOCATION,
    NPU_HOLDER_SCAN_FAILED,
    NPU_SHARED_BY_PODS,
)
from probes.runtime.holders import (
    Holder,
    HolderScan,
    describe_holders,
    describe_pods,
    matches_command,
    pods_of,
    stop_hint,
)
from probes.runtime.podresources.compare import DeviceVerdict, outside_message

DAVINCI = re.compile(r"^davinci(\d+)$")


def chip_number(node: str) -> int | None:
    match = DAVINCI.match(node)
    return int(match.group(1)) if match else None


def numbers_held_by_fd(scan: HolderScan | None) -> set[int]:
    """N of every /dev/davinciN some process holds open or mapped (for npu.hbm: memory in use by a holder is no
    leak)."""
    held: set[int] = set()
    for holder in scan.holders if scan else ():
        if holder.sources & {"fd", "mmap"}:
            held.update(n for n in map(chip_number, holder.things) if n is not None)
    return held


def holder_findings(
    chips: Sequence[NpuChip],
    davinci: Sequence[int],
    scan: HolderScan | None,
    ignore_commands: Sequence[str],
    redact: bool,
    where: str = "",
    verdicts: Mapping[int, DeviceVerdict] | None = None,
) -> tuple[list[Finding], dict[int, int], int]:
    """npu.holders per chip and node-wide; (findings, out-of-band holders per device number, out-of-band
    holders of only the shared nodes). `where` names the device nodes looked for, for the skip message;
    `verdicts` are the device plugin ledger's, per device number (npu.ledger), when it was read."""
    by_number = {c.device_number: c for c in chips if c.device_number is not None}
    numbers = sorted(set(by_number) | set(davinci))
    out_of_band = dict.fromkeys(numbers, 0)
    if scan is None:
        skip = HOLDERS.report(NOT_APPLICABLE, "", f"no NPU device nodes ({where}) and no NPU processes")
        return [skip], out_of_band, 0
    kept = [h for h in scan.holders if not matches_command(h.info, ignore_commands)]
    per_chip: dict[int, list[Holder]] = {n: [] for n in numbers}
    shared_only: list[Holder] = []
    for holder in kept:
        held = [n for n in map(chip_number, holder.things) if n is not None]
        for number in held:
            per_chip.setdefault(number, []).append(holder)
        if not held:
            shared_only.append(holder)
    findings = []
    for number in sorted(per_chip):
        holders = per_chip[number]
        out_of_band[number] = sum(1 for h in holders if not h.in_pod)
        verdict = verdicts.get(number) if verdicts else None
        findings.append(_chip_finding(number, by_number.get(number), holders, scan, redact, verdict))
    outside_shared = [h for h in shared_only if not h.in_pod]
    findings.append(_shared_nodes_finding(outside_shared, scan, len(kept), len(scan.holders) - len(kept), redact))
    return findings, out_of_band, len(outside_shared)


def _chip_finding(
    number: int,
    chip: NpuChip | None,
    holders: list[Holder],
    scan: HolderScan,
    redact: bool,
    verdict: DeviceVerdict | None = None,
) -> Finding:
    subject = chip_subject(chip) if chip else f"npu{number}"
    device = chip.logical_id if chip else number
    node = f"/dev/davinci{number}"
    outside = [h for h in holders if not h.in_pod]
    pods = pods_of(holders)
    observed: dict[str, Any] = {
        **scan.observed(),
        "device_node": f"davinci{number}",
        "holders_in_pods": len(holders) - len(outside),
        "holders_out_of_band": len(outside),
        "pods": len(pods),
        "holders": [h.to_dict(redact) for h in holders[:10]],
    }
    problems: list[tuple[Reason, str, str]] = []  # in order of precedence: the first one's reason leads
    if outside:
        problems.append(
            (
                NPU_HELD_OUT_OF_BAND,
                f"{node} is held outside Kubernetes by {describe_holders(outside, redact)}",
                f"{stop_hint(outside)}; or run it through Kubernetes so the device plugin accounts for the NPU",
            )
        )
    problems.extend(_ledger_problems(node, verdict, redact))
    outside_allocation = verdict is not None and verdict.held_outside
    by_design = verdict is not None and bool(verdict.shared_by_design)
    if len(pods) >= 2 and not outside_allocation and not by_design:
        firsts = [members[0] for members in pods.values()]
        problems.append(
            (
                NPU_SHARED_BY_PODS,
                f"{node} is held by {len(pods)} pods: {describe_pods(pods, redact)}",
                f"two jobs share one chip: delete one of the pods ({stop_hint(firsts)}) and let one scheduler "
                "own the NPUs (Volcano or the default scheduler with the device plugin, not both)",
            )
        )
    if verdict is not None:
        observed.update(verdict.observed())
    if problems:
        if len(problems) >= 2:
            observed["reasons"] = [reason.code for reason, _, _ in problems]
        message = "; ".join(message for _, message, _ in problems)
        hint = "; ".join(hint for _, _, hint in problems)
        return HOLDERS.report(problems[0][0], subject, message, observed, hint=hint, device=device)
    if not scan.complete:
        message = f"could not see every holder of {node}: {scan.shortfall()}; none outside Kubernetes among the rest"
        return HOLDERS.report(NPU_HOLDER_SCAN_FAILED, subject, message, observed, device=device)
    in_pods = f", {len(holders)} in {'a pod' if len(pods) == 1 else 'pods'}" if holders else ""
    return HOLDERS.ok(subject, f"{node}: no holder outside Kubernetes{in_pods}", observed, device=device)


def _ledger_problems(node: str, verdict: DeviceVerdict | None, redact: bool) -> list[tuple[Reason, str, str]]:
    """A pod holding the chip although the device plugin's ledger gave it to no pod, or to another."""
    if verdict is None:
        return []
    disagreements = [
        (
            NPU_ALLOCATION_DISAGREES,
            f"{node} is held by {pod.describe()} ({describe_holders(members, redact)}), which the kubelet's ledger "
            f"allocated it to, while the pod's huawei.com/AscendReal names {said or 'other chips'}: the holder scan "
            "is believed",
            NPU_ALLOCATION_DISAGREES.hint,
        )
        for pod, members, said in verdict.disagrees
    ]
    if not verdict.held_outside:
        return disagreements
    wrong = [members[0] for _, members in verdict.outside]
    hint = (
        f"delete the pod that holds it without an allocation ({stop_hint(wrong)}): the next job the device plugin "
        "gives the chip to fails with -8020 / davinci already in use"
    )
    return [(NPU_HELD_OUTSIDE_ALLOCATION, outside_message(node, verdict, redact), hint), *disagreements]


def _shared_nodes_finding(outside: list[Holder], scan: HolderScan, kept: int, ignored: int, redact: bool) -> Finding:
    observed: dict[str, Any] = {
        **scan.observed(),
        "holders_ignored": ignored,
        "shared_holders_out_of_band": len(outside),
        "holders": [h.to_dict(redact) for h in outside[:10]],
    }
    if outside:
        nodes = ", ".join(f"/dev/{n}" for n in sorted({t for h in outside for t in h.things}))
        message = f"{nodes} held outside Kubernetes by {describe_holders(outside, redact)}"
        hint = (
            f"{stop_hint(outside)}; or run it through Kubernetes; if it is a node daemon that must stay, add its "
            "executable to npu.holder_ignore_commands"
        )
        return HOLDERS.report(NPU_HELD_OUT_OF_BAND, "", message, observed, hint=hint, status=Status.WARN)
    if not scan.complete:
        message = f"could not see every NPU device holder: {scan.shortfall()}"
        return HOLDERS.report(NPU_HOLDER_SCAN_FAILED, "", message, observed)
    return HOLDERS.ok("", f"no NPU device held outside Kubernetes ({kept} holders, {ignored} ignored)", observed)


def where_looked(dev_dir: Path | str, patterns: Sequence[str]) -> str:
    return f"{', '.join(patterns)} under {dev_dir}"
