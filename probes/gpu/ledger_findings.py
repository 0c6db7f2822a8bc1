"""gpu.ledger, and the ledger's part in gpu.holders and gpu.memory: the GPUs as the device plugin's ledger has them.

The ledger (the kubelet's PodResources API, `probes.runtime.podresources`) names a GPU by `GPU-<uuid>`, a MIG
device by `MIG-<uuid>` (its GPU's), an index under the plugin's index strategy, and a time-sliced or MPS replica
by `<id>::N`: several pods on one GPU by design, never GpuSharedByPods. MPS server processes hold the GPU for
their clients and are not judged against it.

- gpu.ledger, node-wide: the read (ok, skip without a socket, unknown / PodResourcesUnavailable).
- gpu.ledger per GPU: the pod it is allocated to, or free; a GPU the plugin no longer offers →
  DevicePluginUnhealthy (warn by default) beside the agent's own gpu.health verdict on it.
- gpu.holders per GPU: a pod holding a GPU the ledger gave to no pod, or to another → GpuHeldOutsideAllocation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from probes.base import OBSERVED_ALLOCATED_TO, OBSERVED_DEVICE_IDS, Finding, Status
from probes.gpu.model import GpuState
from probes.gpu.reasons import GPU_DEVICE_PLUGIN_UNHEALTHY, LEDGER
from probes.ledger import unread_ledger
from probes.runtime.holders import Holder, matches_command
from probes.runtime.podresources.client import LedgerRead
from probes.runtime.podresources.compare import DeviceVerdict, Granted, judge
from probes.runtime.podresources.ledger import NVIDIA_PREFIX, Allocation, describe_pods, nvidia_ref
from probes.runtime.podresources.pods import PodDirectory, PodIndex


@dataclass
class GpuLedger:
    read: LedgerRead
    granted: dict[int, list[Granted]] = field(default_factory=dict)  # GPU index → grants
    offered: set[int] | None = None  # None: no nvidia.com resource offered at all
    index: PodIndex | None = None
    directory: PodDirectory | None = None
    unmatched: int = 0  # ids naming no GPU of this node

    def allocations(self, gpu: int) -> list[Allocation]:
        return [g.allocation for g in self.granted.get(gpu, [])]


def ascii_index(key: str) -> int | None:
    """A device index written in ASCII digits (str.isdigit() accepts `²`, which int() refuses), at most 5."""
    return int(key) if 0 < len(key) <= 5 and key.isascii() and key.isdigit() else None


def gpu_of(key: str, gpus: Sequence[GpuState]) -> int | None:
    """The index of the GPU a ledger id's base names: its UUID, one of its MIG devices, or its index."""
    index = ascii_index(key)
    for gpu in gpus:
        if key == gpu.uuid or key in gpu.mig_uuids or (index is not None and index == gpu.index):
            return gpu.index
    return None


def gpu_indices(findings: Iterable[Finding]) -> tuple[dict[str, int], set[int]]:
    """The GPUs the results know (pure): their ids (OBSERVED_DEVICE_IDS, lower case) → device index, and the
    indices."""
    ids: dict[str, int] = {}
    indices: set[int] = set()
    for finding in findings:
        if finding.device is None or finding.category != "gpu":
            continue
        indices.add(finding.device)
        for ident in finding.observed.get(OBSERVED_DEVICE_IDS) or ():
            if isinstance(ident, str):
                ids.setdefault(ident.lower(), finding.device)
    return ids, indices


def gpu_of_id(device_id: str, ids: Mapping[str, int], indices: Iterable[int]) -> int | None:
    """The device index of an `nvidia.com/...` ledger id (`GPU-<uuid>`, `MIG-<uuid>`, `<id>::N` replicas, an
    index) through `gpu_indices`; None when no result names it."""
    key = nvidia_ref(device_id).key
    index = ascii_index(key)
    if index is not None and index in indices:
        return index
    return ids.get(key.lower())


def gpu_ledger(read: LedgerRead, gpus: Sequence[GpuState], directory: PodDirectory | None) -> GpuLedger:
    view = GpuLedger(read, index=directory.current() if directory is not None else None, directory=directory)
    if not read.ok or read.ledger is None:
        return view
    offered = read.ledger.offered(NVIDIA_PREFIX)
    if offered:
        found = (gpu_of(nvidia_ref(i).key, gpus) for ids in offered.values() for i in ids)
        view.offered = {index for index in found if index is not None}
    for allocation in read.ledger.of_resources(NVIDIA_PREFIX):
        ref = nvidia_ref(allocation.device_id)
        index = gpu_of(ref.key, gpus)
        if index is None:
            view.unmatched += 1
            continue
        view.granted.setdefault(index, []).append(Granted(allocation, ref))
    return view


def ledger_verdict(
    view: GpuLedger, gpu: GpuState, holders: Sequence[Holder], mps_commands: Sequence[str]
) -> DeviceVerdict | None:
    if view.read.ledger is None:
        return None
    tenants = [h for h in holders if not matches_command(h.info, mps_commands)]
    verdict = judge(view.granted.get(gpu.index, []), tenants, view.read.ledger, view.index)
    if verdict.unnamed and view.directory is not None:
        view.directory.want_fresh()  # a holder pod neither its OCI bundle nor the pod list names yet
    return verdict


def ledger_findings(view: GpuLedger, gpus: Sequence[GpuState], own: Sequence[Finding], status: str) -> list[Finding]:
    read = view.read
    unread = unread_ledger(LEDGER, read)
    if unread is not None or read.ledger is None:
        return unread or []
    observed: dict[str, Any] = read.observed()
    observed.update(read.ledger.to_dict(NVIDIA_PREFIX), ids_naming_no_gpu=view.unmatched)
    allocated = sum(1 for grants in view.granted.values() if grants)
    offered = "no nvidia.com resource offered" if view.offered is None else f"{len(view.offered)} GPUs offered"
    out = [LEDGER.ok("", f"ledger read: {len(read.ledger.pods)} pods, {allocated} GPUs allocated, {offered}", observed)]
    health = {f.subject: f for f in own if f.check == "gpu.health" and f.subject}
    out.extend(_gpu_ledger(view, gpu, health, status) for gpu in gpus)
    return out


def _gpu_ledger(view: GpuLedger, gpu: GpuState, health: Mapping[str, Finding], status: str) -> Finding:
    allocations = view.allocations(gpu.index)
    observed: dict[str, Any] = {OBSERVED_ALLOCATED_TO: [a.to_dict() for a in allocations[:10]]}
    where = "free in the ledger" if not allocations else f"allocated to {describe_pods(allocations)}"
    if view.offered is not None and gpu.index not in view.offered:
        own = health.get(gpu.subject)
        verdict = f"gpu.health {own.status.value} ({own.message})" if own else "no gpu.health verdict"
        observed["offered"] = False
        message = (
            f"{gpu.subject} ({gpu.uuid or 'no UUID'}): the device plugin no longer offers it (absent from "
            f"GetAllocatableResources), {where}; the agent's own verdict: {verdict}"
        )
        return LEDGER.report(
            GPU_DEVICE_PLUGIN_UNHEALTHY, gpu.subject, message, observed, status=Status(status), device=gpu.index
        )
    observed["offered"] = view.offered is not None
    return LEDGER.ok(gpu.subject, f"{gpu.subject}: {where}", observed, device=gpu.index)


def ledger_note(view: GpuLedger, gpu: GpuState) -> str:
    """For gpu.memory's leak message: `free in the ledger`, or the pod it is allocated to; "" when unknown."""
    if not view.read.ok:
        return ""
    allocations = view.allocations(gpu.index)
    return "free in the ledger" if not allocations else f"allocated to {describe_pods(allocations)} in the ledger"
