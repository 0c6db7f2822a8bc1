"""Holders judged against the ledger, for one device (pure): npu.holders and gpu.holders share it.

A pod holds a device (a process in its cgroup has the device node open, or the vendor tool lists it) and the
ledger says which pods the device plugin gave that device to. A holder pod is judged only when it is known
by name (the runtime's OCI bundle, else the node's pod list by its UID) and the kubelet lists it: a pod the
ledger does not list may have started after the read, and is left alone. Then:

- the pod has an allocation of the device: fine, even beside other pods when the allocation is shared by design
  (time-slicing or MPS replicas `::N`, vNPUs);
- the device is allocated to no pod: held outside the allocation, "allocated to no pod";
- the device is allocated to another pod: held outside the allocation, both pods named.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from probes.runtime.holders import Holder, PodRef, list_processes
from probes.runtime.podresources.ledger import Allocation, DeviceRef, Ledger, describe_pods
from probes.runtime.podresources.pods import PodIndex


@dataclass(frozen=True)
class Granted:
    """One allocation of one device, and what its id says about sharing."""

    allocation: Allocation
    ref: DeviceRef


@dataclass
class DeviceVerdict:
    allocated_to: list[Allocation] = field(default_factory=list)
    shared_by_design: str = ""  # why several pods may hold it ("" when not shared)
    outside: list[tuple[PodRef, list[Holder]]] = field(default_factory=list)  # holder pods without an allocation
    unnamed: list[Holder] = field(default_factory=list)  # in a pod known by UID only: not judged
    not_listed: list[PodRef] = field(default_factory=list)  # named pods the ledger does not list: not judged
    # Holder pods the kubelet-side ids allocated this device to, whose annotation (Volcano's AscendReal) names
    # others: the holder scan is believed (never a fail on the annotation alone); with what the annotation says.
    disagrees: list[tuple[PodRef, list[Holder], str]] = field(default_factory=list)

    @property
    def held_outside(self) -> bool:
        return bool(self.outside)

    def allocated_phrase(self) -> str:
        """`pod a/b container c`, or `no pod`."""
        return describe_pods(self.allocated_to)

    def observed(self) -> dict[str, object]:
        out: dict[str, object] = {"allocated_to": [a.to_dict() for a in self.allocated_to[:10]]}
        if self.shared_by_design:
            out["shared_by_design"] = self.shared_by_design
        if self.outside:
            out["held_outside_allocation"] = [pod.to_dict() for pod, _ in self.outside[:10]]
        if self.unnamed:
            out["holders_not_named"] = len(self.unnamed)
        if self.not_listed:
            out["pods_not_in_ledger"] = [pod.to_dict() for pod in self.not_listed[:10]]
        if self.disagrees:
            out["annotation_disagrees"] = [
                {**pod.to_dict(), "annotation": said} for pod, _, said in self.disagrees[:10]
            ]
        return out

    def believe_holders(self, kubelet_side: Sequence[Granted], annotations: Mapping[tuple[str, str], str]) -> None:
        """Holder pods outside the allocation that the kubelet-side ids did allocate this device to (an annotation
        moved their grant elsewhere): moved from `outside` to `disagrees`."""
        given = {g.allocation.pod_key for g in kubelet_side}
        kept = []
        for pod, members in self.outside:
            key = (pod.namespace, pod.name)
            if key in given:
                self.disagrees.append((pod, members, annotations.get(key, "")))
            else:
                kept.append((pod, members))
        self.outside = kept


def named(pod: PodRef, index: PodIndex | None) -> PodRef:
    """The pod with its namespace/name from the node's pod list when the OCI bundle did not say."""
    if pod.name or index is None:
        return pod
    meta = index.by_uid(pod.uid)
    return PodRef(pod.uid, meta.namespace, meta.name, pod.container) if meta else pod


def judge(
    granted: Sequence[Granted], holders: Iterable[Holder], ledger: Ledger, index: PodIndex | None
) -> DeviceVerdict:
    """One device: its allocations in the ledger against the pods holding it (holders outside pods are the
    holder checks' business already)."""
    verdict = DeviceVerdict(allocated_to=[g.allocation for g in granted])
    reasons = sorted({g.ref.why_shared for g in granted if g.ref.shared})
    verdict.shared_by_design = "; ".join(reasons)
    allocated_pods = {g.allocation.pod_key for g in granted}
    by_pod: dict[str, list[Holder]] = {}
    for holder in holders:
        if holder.in_pod and holder.pod is not None:
            by_pod.setdefault(holder.pod.uid, []).append(holder)
    for members in by_pod.values():
        pod = named(members[0].pod or PodRef(""), index)
        if not pod.name:
            verdict.unnamed.extend(members)
        elif (pod.namespace, pod.name) not in ledger.pods:
            verdict.not_listed.append(pod)
        elif (pod.namespace, pod.name) not in allocated_pods:
            verdict.outside.append((pod, members))
    return verdict


def outside_message(node: str, verdict: DeviceVerdict, redact: bool) -> str:
    """`/dev/davinci3 is held by pod a/b (PID 12 (python)) but the ledger allocated it to no pod`."""
    holders = "; ".join(
        f"{pod.describe()}{f' container {pod.container}' if pod.container else ''} ({list_processes(members, redact)})"
        for pod, members in verdict.outside
    )
    return f"{node} is held by {holders} but the device plugin's ledger allocated it to {verdict.allocated_phrase()}"
