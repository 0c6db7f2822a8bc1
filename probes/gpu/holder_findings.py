"""gpu.holders: who holds each GPU (its /dev/nvidiaN by device number, and NVML's process lists), judged per GPU.

A holder outside any pod that gpu.allowed_holders does not name → GpuHeldOutOfBand (fail). Holders of two
or more pods on one GPU → GpuSharedByPods (fail) unless gpu.shared_ok allows it for that GPU; MPS server
processes hold the GPU for their clients and count as one holder together, whatever pods they run in.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from probes.base import Finding, ProbeContext, Reason
from probes.gpu.config import GpuConfig
from probes.gpu.model import GpuState
from probes.gpu.reasons import (
    GPU_HELD_OUT_OF_BAND,
    GPU_HELD_OUTSIDE_ALLOCATION,
    GPU_HOLDER_SCAN_FAILED,
    GPU_SHARED_BY_PODS,
    HOLDERS,
)
from probes.runtime.holders import (
    Holder,
    HolderScan,
    PodNames,
    describe_holders,
    device_holders,
    device_nodes,
    list_processes,
    matches_command,
    scan_devices,
    stop_hint,
)
from probes.runtime.podresources.compare import DeviceVerdict, outside_message


def gpu_node(gpu: GpuState) -> str:
    """What a GPU's holders hold: its device node (`nvidia3`), or `gpu3` when the backend gave no minor."""
    return f"nvidia{gpu.minor}" if gpu.minor is not None else gpu.subject


def scan_gpu_holders(ctx: ProbeContext, cfg: GpuConfig, gpus: Sequence[GpuState], pod_names: PodNames) -> HolderScan:
    """One /proc/*/fd scan for the GPUs' device nodes, merged with NVML's (or nvidia-smi's) process lists."""
    wanted = {gpu_node(gpu) for gpu in gpus}
    nodes = {rdev: name for rdev, name in device_nodes(ctx.host.dev, cfg.holder_devices).items() if name in wanted}
    scan = scan_devices(ctx.host, nodes, timeout=max(0.5, ctx.remaining() - 0.5)) if nodes else None
    listed: dict[int, set[str]] = {}
    for gpu in gpus:
        for process in gpu.processes or ():
            listed.setdefault(process.pid, set()).add(gpu_node(gpu))
    return device_holders(
        ctx.host,
        scan,
        listed=listed,
        listed_source="nvml",
        pod_names=pod_names,
        exclude=(os.getpid(),),
        read_commands=not ctx.redact_cmdlines,
    )


def holders_of(gpu: GpuState, scan: HolderScan) -> list[Holder]:
    node = gpu_node(gpu)
    return [holder for holder in scan.holders if node in holder.things]


def out_of_band_holders(holders: Sequence[Holder], cfg: GpuConfig) -> list[Holder]:
    return [h for h in holders if not h.in_pod and not matches_command(h.info, cfg.allowed_holders)]


def holder_finding(
    gpu: GpuState,
    holders: list[Holder],
    scan: HolderScan,
    cfg: GpuConfig,
    redact: bool,
    verdict: DeviceVerdict | None = None,
) -> Finding:
    """`verdict`: the device plugin ledger's (gpu.ledger), when it was read."""
    out_of_band = out_of_band_holders(holders, cfg)
    allowed = [h for h in holders if not h.in_pod and h not in out_of_band]
    in_pods = [h for h in holders if h.in_pod]
    tenants = tenants_of(in_pods, cfg.mps_server_commands)
    outside_allocation = verdict is not None and verdict.held_outside
    by_design = verdict is not None and bool(verdict.shared_by_design)
    shared = len(tenants) >= 2 and not cfg.sharing_allowed(gpu.index) and not by_design and not outside_allocation
    observed: dict[str, Any] = {
        **scan.observed(),
        "out_of_band": [h.to_dict(redact) for h in out_of_band[:10]],
        "in_pods": [h.to_dict(redact) for h in in_pods[:10]],
        "allowed": [h.to_dict(redact) for h in allowed[:10]],
        "pods": len(tenants),
        "sharing_allowed": cfg.sharing_allowed(gpu.index),
        **(verdict.observed() if verdict is not None else {}),
    }
    problems: list[tuple[Reason, str, str]] = []  # in order of precedence: the first one's reason leads
    if out_of_band:
        problems.append(
            (
                GPU_HELD_OUT_OF_BAND,
                f"{gpu.subject} is held outside Kubernetes by {describe_holders(out_of_band, redact)}",
                "pods placed here fail with 'CUDA-capable device(s) is/are busy or unavailable' or run out of "
                f"memory: {stop_hint(out_of_band)}; or run it as a pod",
            )
        )
    if outside_allocation and verdict is not None:
        wrong = [members[0] for _, members in verdict.outside]
        problems.append(
            (
                GPU_HELD_OUTSIDE_ALLOCATION,
                outside_message(gpu.subject, verdict, redact),
                f"delete the pod that holds it without an allocation ({stop_hint(wrong)}): the next job the device "
                "plugin gives the GPU to finds it busy",
            )
        )
    if shared:
        firsts = [members[0] for members in tenants.values()]
        problems.append(
            (
                GPU_SHARED_BY_PODS,
                f"{gpu.subject} is held by {len(tenants)} pods: {describe_tenants(tenants, redact)}",
                f"two jobs share one GPU: delete one of the pods ({stop_hint(firsts)}); if the GPU is shared on "
                f"purpose (time-slicing, MPS), set gpu.shared_ok: true or list index {gpu.index} in it",
            )
        )
    if problems:
        if len(problems) >= 2:
            observed["reasons"] = [reason.code for reason, _, _ in problems]
        message = "; ".join(message for _, message, _ in problems)
        hint = "; ".join(hint for _, _, hint in problems)
        return HOLDERS.report(problems[0][0], gpu.subject, message, observed, hint=hint, device=gpu.index)
    if not scan.complete:
        message = f"{gpu.subject}: could not see every holder: {scan.shortfall()}; none outside a pod among the rest"
        return HOLDERS.report(GPU_HOLDER_SCAN_FAILED, gpu.subject, message, observed, device=gpu.index)
    message = f"{gpu.subject}: no holder outside a pod ({len(in_pods)} in pods)"
    return HOLDERS.ok(gpu.subject, message, observed, device=gpu.index)


MPS = "mps"


def tenants_of(in_pods: Sequence[Holder], mps_commands: Sequence[str]) -> dict[str, list[Holder]]:
    """In-pod holders grouped by pod UID, with every MPS server process in one group of its own."""
    out: dict[str, list[Holder]] = {}
    for holder in in_pods:
        key = MPS if matches_command(holder.info, mps_commands) else (holder.owner.pod_uid or "")
        out.setdefault(key, []).append(holder)
    return out


def describe_tenants(tenants: dict[str, list[Holder]], redact: bool) -> str:
    parts = []
    for key, members in tenants.items():
        where = "MPS server" if key == MPS else members[0].where()
        parts.append(f"{where}: {list_processes(members, redact)}")
    return "; ".join(parts)
