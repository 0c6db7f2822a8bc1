"""npu.ledger, and the ledger's part in npu.holders and npu.hbm: the chips as the device plugin's ledger has them.

The ledger (the kubelet's PodResources API, `probes.runtime.podresources`) says which pod was given which chip
(`Ascend910-<phy id>`: /dev/davinci<phy id>; a vNPU `Ascend910-2c-<vdev>-<phy id>`: a share of that chip) and
which chips the plugin still offers. Under Volcano the kubelet-side ids are not the chips mounted: the pod's
`huawei.com/AscendReal` annotation is, read from the node's pod list (the agent's Kubernetes side). Without that
list, or while a pod's entry predates its allocation, chips are not compared with their holders (a Volcano pod
would look like it holds a chip it was not given); what the plugin offers is still reported.

- npu.ledger, node-wide: the read (ok, skip without a socket, unknown / PodResourcesUnavailable).
- npu.ledger per chip: the pod it is allocated to, or free; a chip the plugin no longer offers →
  DevicePluginUnhealthy (warn by default) beside the agent's own npu.health verdict on it.
- npu.holders per chip: a pod holding a chip the ledger gave to no pod, or to another pod →
  NpuHeldOutsideAllocation (`holder_findings`, from the verdicts made here).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from probes.base import OBSERVED_ALLOCATED_TO, OBSERVED_PHYSICAL_ID, Finding, Status
from probes.ledger import unread_ledger
from probes.npu.findings import chip_subject
from probes.npu.info_table import NpuChip
from probes.npu.reasons import LEDGER, NPU_DEVICE_PLUGIN_UNHEALTHY
from probes.runtime.holders import Holder, HolderScan, matches_command
from probes.runtime.podresources.client import LedgerRead
from probes.runtime.podresources.compare import DeviceVerdict, Granted, judge
from probes.runtime.podresources.ledger import (
    ASCEND_PREFIX,
    ASCEND_REAL_ANNOTATION,
    Allocation,
    ascend_real,
    ascend_ref,
    by_pod,
    describe_pods,
)
from probes.runtime.podresources.pods import PodDirectory, PodIndex

_DAVINCI_PREFIX = "davinci"
MAX_TRACKED_PODS = 4096
# observed key of the npu findings about one chip: the device node it is (`davinci3`).
OBSERVED_DEVICE_NODE = "device_node"


def davinci_number(name: str) -> int | None:
    """N of `davinciN`, ASCII digits only (str.isdigit() accepts `²`, which int() refuses), at most 5 of them."""
    digits = name[len(_DAVINCI_PREFIX) :] if name.startswith(_DAVINCI_PREFIX) else ""
    return int(digits) if 0 < len(digits) <= 5 and digits.isascii() and digits.isdigit() else None


def chip_indices(findings: Iterable[Finding]) -> dict[int, int]:
    """/dev/davinciN's N → the device index (logical id) of the npu findings about that chip (pure). npu.ledger
    names the node (OBSERVED_DEVICE_NODE), npu.health the chip's physical id, which is its N; where no physical id
    is known, N is the logical id (npu-smi on a full host view)."""
    named: dict[int, int] = {}
    logical: dict[int, int] = {}
    for finding in findings:
        if finding.device is None or finding.category != "npu":
            continue
        node, physical = finding.observed.get(OBSERVED_DEVICE_NODE), finding.observed.get(OBSERVED_PHYSICAL_ID)
        number = davinci_number(node) if isinstance(node, str) else None
        if number is not None:
            named.setdefault(number, finding.device)
        elif isinstance(physical, int) and not isinstance(physical, bool):
            named.setdefault(physical, finding.device)
        else:
            logical.setdefault(finding.device, finding.device)
    return {**logical, **named}


def chip_of(device_id: str, chips: Mapping[int, int]) -> int | None:
    """The device index of a ledger id (`Ascend910-<phy>`, a vNPU's `Ascend910-2c-<vdev>-<phy>`) through
    `chip_indices`; None when it names no chip the results know."""
    ref = ascend_ref(device_id)
    if ref is None or not (ref.key.isascii() and ref.key.isdigit()):
        return None
    return chips.get(int(ref.key))


@dataclass
class NpuLedger:
    """One run's ledger for the chips: grants per device number, what is offered, whether to compare."""

    read: LedgerRead
    granted: dict[int, list[Granted]] = field(default_factory=dict)
    offered: set[int] | None = None  # None: no huawei.com resource offered at all (no plugin, or DRA)
    index: PodIndex | None = None
    directory: PodDirectory | None = None
    compare: bool = False
    why_not_compared: str = ""
    # Where an annotation moved a pod's grant: the kubelet-side grants per device number, and what it said.
    kubelet_side: dict[int, list[Granted]] = field(default_factory=dict)
    annotations: dict[tuple[str, str], str] = field(default_factory=dict)

    def allocations(self, number: int) -> list[Allocation]:
        return [g.allocation for g in self.granted.get(number, [])]


class FirstSeen:
    """When this agent first saw each pod with Ascend devices in the ledger: a pod list older than that may
    predate the pod's allocation (and Volcano's AscendReal annotation, written at allocation)."""

    def __init__(self) -> None:
        self.at: dict[tuple[str, str], float] = {}

    def update(self, pods: Sequence[tuple[str, str]], now: float) -> None:
        current = set(pods)
        self.at = {pod: seen for pod, seen in self.at.items() if pod in current}
        for pod in pods:
            if len(self.at) < MAX_TRACKED_PODS:
                self.at.setdefault(pod, now)


def npu_ledger(read: LedgerRead, directory: PodDirectory | None, seen: FirstSeen) -> NpuLedger:
    view = NpuLedger(read, directory=directory)
    if not read.ok or read.ledger is None:
        return view
    ledger = read.ledger
    offered = {ref.key for ids in ledger.offered(ASCEND_PREFIX).values() for i in ids if (ref := ascend_ref(i))}
    view.offered = {int(key) for key in offered} if ledger.offered(ASCEND_PREFIX) else None
    grants = by_pod(ledger.of_resources(ASCEND_PREFIX))
    seen.update(list(grants), read.read_at or time.time())
    view.index = directory.current() if directory is not None else None
    view.compare, view.why_not_compared = True, ""
    for pod, allocations in grants.items():
        real, why = real_chips(pod, allocations, view.index, seen, directory)
        if why:
            view.compare, view.why_not_compared = False, why
        if real is not allocations:  # Volcano's AscendReal in place of the kubelet-side ids
            view.annotations[pod] = ", ".join(a.device_id for a in real[:8])
            for allocation in allocations:
                if (ref := ascend_ref(allocation.device_id)) is not None:
                    view.kubelet_side.setdefault(int(ref.key), []).append(Granted(allocation, ref))
        for allocation in real:
            ref = ascend_ref(allocation.device_id)
            if ref is not None:
                view.granted.setdefault(int(ref.key), []).append(Granted(allocation, ref))
    return view


def real_chips(
    pod: tuple[str, str],
    allocations: list[Allocation],
    index: PodIndex | None,
    seen: FirstSeen,
    directory: PodDirectory | None,
) -> tuple[list[Allocation], str]:
    """The pod's allocations with Volcano's real chips in place of the kubelet-side ids; (.., why) when the
    node's pod list cannot tell them (yet)."""
    if index is None:
        return allocations, "the node's pod list is not available (Kubernetes off): Volcano's real chips unknown"
    meta = index.by_name(*pod)
    if meta is None or index.fetched_at < seen.at.get(pod, 0.0):
        if directory is not None:
            directory.want_fresh()
        return allocations, f"pod {pod[0]}/{pod[1]} is newer than the node's pod list: its real chips not known yet"
    annotation = meta.annotations.get(ASCEND_REAL_ANNOTATION, "")
    if not annotation:
        return allocations, ""
    first = allocations[0]
    return [
        Allocation(first.namespace, first.pod, first.container, first.resource, i) for i in ascend_real(annotation)
    ], ""


def chip_numbers_of(holder: Holder) -> list[int]:
    return [n for t in holder.things if (n := davinci_number(t)) is not None]


def ledger_verdicts(
    view: NpuLedger, scan: HolderScan | None, numbers: Sequence[int], ignore_commands: Sequence[str]
) -> dict[int, DeviceVerdict]:
    """npu.holders' ledger verdict per chip; {} when the ledger cannot be compared this run."""
    if not view.compare or view.read.ledger is None or scan is None:
        return {}
    per_chip: dict[int, list[Holder]] = {n: [] for n in numbers}
    for holder in scan.holders:
        if not matches_command(holder.info, ignore_commands):
            for number in chip_numbers_of(holder):
                per_chip.setdefault(number, []).append(holder)
    verdicts = {n: judge(view.granted.get(n, []), held, view.read.ledger, view.index) for n, held in per_chip.items()}
    for number, verdict in verdicts.items():
        verdict.believe_holders(view.kubelet_side.get(number, []), view.annotations)
    if view.directory is not None and any(v.unnamed for v in verdicts.values()):
        view.directory.want_fresh()  # a holder pod neither its OCI bundle nor the pod list names yet
    return verdicts


def ledger_findings(
    view: NpuLedger, chips: Sequence[NpuChip], davinci: Sequence[int], own: Sequence[Finding], status: str
) -> list[Finding]:
    """npu.ledger: node-wide, then per chip when the ledger was read."""
    read = view.read
    unread = unread_ledger(LEDGER, read)
    if unread is not None or read.ledger is None:
        return unread or []
    observed: dict[str, Any] = read.observed()
    observed.update(read.ledger.to_dict(ASCEND_PREFIX))
    observed["compared_with_holders"] = view.compare
    if view.why_not_compared:
        observed["not_compared"] = view.why_not_compared
    allocated = sum(1 for grants in view.granted.values() if grants)
    offered = "no huawei.com resource offered" if view.offered is None else f"{len(view.offered)} chips offered"
    message = f"ledger read: {len(read.ledger.pods)} pods, {allocated} chips allocated, {offered}" + (
        f"; not compared with the holders: {view.why_not_compared}" if view.why_not_compared else ""
    )
    out = [LEDGER.ok("", message, observed)]
    by_number = {c.device_number: c for c in chips if c.device_number is not None}
    health = {f.subject: f for f in own if f.check == "npu.health" and f.subject}
    for number in sorted(set(by_number) | set(davinci)):
        out.append(_chip_ledger(view, number, by_number.get(number), health, status))
    return out


def _chip_ledger(
    view: NpuLedger, number: int, chip: NpuChip | None, health: Mapping[str, Finding], status: str
) -> Finding:
    subject = chip_subject(chip) if chip else f"npu{number}"
    device = chip.logical_id if chip else number
    allocations = view.allocations(number)
    observed: dict[str, Any] = {
        OBSERVED_DEVICE_NODE: f"davinci{number}",
        OBSERVED_ALLOCATED_TO: [a.to_dict() for a in allocations[:10]],
    }
    where = "free in the ledger" if not allocations else f"allocated to {_pods(allocations)}"
    if view.offered is not None and number not in view.offered:
        own = health.get(subject)
        verdict = (
            f"npu.health {own.status.value} ({own.message})"
            if own
            else "no npu.health verdict (npu-smi lists no such chip)"
        )
        observed["offered"] = False
        message = (
            f"{subject} (/dev/davinci{number}): the device plugin no longer offers it (absent from "
            f"GetAllocatableResources), {where}; the agent's own verdict: {verdict}"
        )
        return LEDGER.report(
            NPU_DEVICE_PLUGIN_UNHEALTHY, subject, message, observed, status=Status(status), device=device
        )
    observed["offered"] = view.offered is not None
    return LEDGER.ok(subject, f"{subject} (/dev/davinci{number}): {where}", observed, device=device)


def _pods(allocations: Sequence[Allocation]) -> str:
    return describe_pods(allocations)


def ledger_note(view: NpuLedger, number: int | None) -> str:
    """For npu.hbm's leak message: `free in the ledger` or `allocated to pod a/b in the ledger`, "" unknown."""
    if number is None or not view.read.ok:
        return ""
    allocations = view.allocations(number)
    return "free in the ledger" if not allocations else f"allocated to {_pods(allocations)} in the ledger"
