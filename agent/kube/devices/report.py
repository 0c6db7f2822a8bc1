"""What the device isolation shows: its part of `/status` (`kubernetes.devices`) and its metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from agent.kube.client import ERROR_KINDS
from agent.kube.devices.budget import DeviceGrant
from agent.kube.devices.dra import Discovery
from agent.kube.devices.isolation import MECHANISMS, Isolation
from agent.kube.devices.publicfault import PublicFaults
from probes.base import Sample


@dataclass(frozen=True)
class IsolatorView:
    """What the isolator shows, copied under its lock (`DeviceIsolator.view`)."""

    discovery: Discovery | None
    slice_notes: tuple[str, ...]
    faults: PublicFaults | None
    isolations: tuple[Isolation, ...]
    held: frozenset[str] | None
    grant: DeviceGrant | None
    would_write: tuple[dict[str, Any], ...]
    errors: Counter[str]
    last_error: str


def device_status(view: IsolatorView) -> dict[str, Any]:
    discovery, grant, faults = view.discovery, view.grant, view.faults
    return {
        "dra": {"rules_version": discovery.rules, "slices_version": discovery.slices} if discovery else None,
        "slice_notes": list(view.slice_notes),
        "public_fault": f"{faults.namespace}/{faults.name}" if faults else None,
        "isolated": [i.to_dict() for i in view.isolations],
        "budget": {
            "held": sorted(view.held or ()),
            "used": grant.used if grant else None,
            "limit": grant.limit if grant else None,
            "devices": grant.devices if grant else None,
        },
        "would_write": list(view.would_write),
        "errors": {kind: n for kind, n in view.errors.items() if n},
        "last_error": view.last_error,
    }


def device_samples(view: IsolatorView) -> list[Sample]:
    counts = Counter(i.mechanism for i in view.isolations)
    out = [
        Sample(
            "nodehealth_devices_isolated",
            "Devices of this node with a problem, by how they are isolated (dra, public_fault: on the device; "
            "node, prefer: the node taint; none: the pre-flight only; withheld: the device budget is spent)",
            float(counts[mechanism]),
            {"mechanism": mechanism},
        )
        for mechanism in MECHANISMS
    ]
    out += [
        Sample(
            "nodehealth_device_isolation",
            "1 per device with a problem: how it is isolated, and (why) what kept it from a finer mechanism",
            1.0,
            {
                "category": i.ref.category,
                "device": i.device,
                "reason": i.reason,
                "mechanism": i.mechanism,
                "why": i.why_code,
            },
        )
        for i in view.isolations
    ]
    out.append(
        Sample(
            "nodehealth_device_budget_slots_held",
            "Device budget slots this node holds (its devices isolated by a DeviceTaintRule or a public fault)",
            float(len(view.held or ())),
        )
    )
    out += [
        Sample(
            "nodehealth_kube_device_errors_total",
            "Device isolation API errors, by kind; they never fail a reconcile pass (the device falls back to "
            "the node taint)",
            float(view.errors[kind]),
            {"kind": kind},
            "counter",
        )
        for kind in ERROR_KINDS
    ]
    return out
