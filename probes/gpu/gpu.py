"""gpu.health, gpu.throttle, gpu.memory, gpu.holders: NVIDIA GPUs through NVML, nvidia-smi as the fallback.

One run reads every GPU once (probes/gpu/backends.py: one NVML pass, or `nvidia-smi -q` plus one CSV query),
then scans /proc/*/fd for holders of /dev/nvidiaN, while a child reads the device plugin's ledger from the run's
start (gpu.ledger, probes/gpu/ledger_findings.py; unknown for the run when the kubelet has not answered by then).
NVML calls run in this probe's thread: a wedged GPU can block one for a long time, and the scheduler's probe
timeout is what bounds the run (docs/probes/gpu.md, Backends).

Every finding about one GPU carries its UUID and its MIG devices' UUIDs in observed["device_ids"], so
`/ready?devices=GPU-…` works; every run publishes the GPUs' PCI Bus-Ids to the host's device inventory.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

from probes.base import (
    NOT_APPLICABLE,
    OBSERVED_DEVICE_IDS,
    OBSERVED_DEVICE_MINOR,
    OBSERVED_PCI_BUS_ID,
    Finding,
    Probe,
    ProbeContext,
    ProbeOutput,
    Sample,
    Status,
    register,
)
from probes.gpu.backends import Tools, Unavailable, find_tools, read_inventory
from probes.gpu.config import GpuConfig
from probes.gpu.findings import health_finding, memory_finding, missing_findings, throttle_finding
from probes.gpu.holder_findings import holder_finding, holders_of, out_of_band_holders, scan_gpu_holders
from probes.gpu.ledger_findings import gpu_ledger, ledger_findings, ledger_note, ledger_verdict
from probes.gpu.metrics import gpu_samples
from probes.gpu.model import GpuInventory, GpuState
from probes.gpu.reasons import (
    CHECKS,
    GPU_DRIVER_UNAVAILABLE,
    GPU_MISSING,
    GPU_TOOL_MISSING,
    HEALTH,
    REASONS,
)
from probes.runtime.holders import PodNames
from probes.runtime.podresources.client import PendingRead, ledger_source

NO_DRIVER = "no NVIDIA driver on this host"
_DEVICE_NODE = re.compile(r"^nvidia(\d+)$")


def device_minors(dev_dir: Path) -> list[int]:
    """N of every /dev/nvidiaN character device (one per GPU the driver registered)."""
    try:
        names = os.listdir(dev_dir)
    except OSError:
        return []
    return sorted(int(m[1]) for name in names if (m := _DEVICE_NODE.match(name)) and _is_char_device(dev_dir / name))


def _is_char_device(path: Path) -> bool:
    try:
        return path.is_char_device()
    except OSError:
        return False


@register
class GpuProbe(Probe):
    name = "gpu"
    checks = tuple(check.name for check in CHECKS)
    reasons = REASONS
    default_interval = 30.0
    default_timeout = 20.0
    needs = (
        "NVIDIA driver (libnvidia-ml.so.1 via nvidia-ml-py, or nvidia-smi; on the host or under gpu.driver_root); "
        "/dev/nvidiaN; /proc/*/fd for holders"
    )

    def __init__(self) -> None:
        self._pod_names: PodNames | None = None

    def applicable(self, ctx: ProbeContext) -> str | None:
        cfg = ctx.settings(GpuConfig)
        if cfg.expected_gpus or device_minors(ctx.host.dev) or find_tools(ctx, cfg).any:
            return None
        return NO_DRIVER

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        cfg = ctx.settings(GpuConfig)
        minors = device_minors(ctx.host.dev)
        expected = cfg.expected_gpus if cfg.expected_gpus is not None else len(minors)
        tools = find_tools(ctx, cfg)
        if not tools.any:
            return required_when_unreadable(_tool_missing(expected, minors, tools), expected, cfg)
        # The device plugin's ledger is read in a child while the GPUs are read and their holders scanned.
        pending = ledger_source(ctx.kubelet.socket).start(ctx.kubelet.timeout)
        inventory = read_inventory(ctx, cfg, tools)
        if isinstance(inventory, Unavailable):
            return required_when_unreadable(_unavailable(expected, inventory), expected, cfg)
        if not inventory.gpus and not inventory.failures and expected == 0:
            message = f"{inventory.source} reports no NVIDIA GPU on this host"
            return [check.report(NOT_APPLICABLE, "", message) for check in CHECKS]
        ctx.host.devices.publish("gpu", [(g.index, g.subject, g.bus_id) for g in inventory.gpus if g.bus_id])
        return self._judge(ctx, cfg, inventory, minors, pending)

    def _judge(
        self, ctx: ProbeContext, cfg: GpuConfig, inventory: GpuInventory, minors: list[int], pending: PendingRead
    ) -> ProbeOutput:
        if self._pod_names is None or self._pod_names.root != ctx.host.root:
            self._pod_names = PodNames(ctx.host.root)
        findings: list[Finding] = list(missing_findings(inventory, minors, cfg.expected_gpus))
        samples: list[Sample] = []
        scan = scan_gpu_holders(ctx, cfg, inventory.gpus, self._pod_names)
        # What the ledger read has by now: a kubelet that has not answered leaves it unknown, never the run late.
        view = gpu_ledger(pending.collect(ctx.deadline - 0.5), inventory.gpus, ctx.kubelet.pods)
        for gpu in inventory.gpus:
            holders = holders_of(gpu, scan)
            verdict = ledger_verdict(view, gpu, holders, cfg.mps_server_commands)
            findings.append(health_finding(gpu, cfg))
            findings.append(throttle_finding(gpu, cfg))
            findings.append(memory_finding(gpu, cfg, {h.pid for h in holders}, ledger_note(view, gpu)))
            findings.append(holder_finding(gpu, holders, scan, cfg, ctx.redact_cmdlines, verdict))
            # A partial scan gives a lower bound: worth a sample once it is above zero.
            out_of_band = len(out_of_band_holders(holders, cfg))
            allocations = view.allocations(gpu.index) if view.read.ok else None
            samples.extend(gpu_samples(gpu, out_of_band if scan.complete or out_of_band else None, allocations))
        findings.extend(ledger_findings(view, inventory.gpus, findings, cfg.device_plugin_unhealthy_status))
        samples.append(
            Sample(
                "nodehealth_gpu_devices",
                "GPUs the backend enumerates (label source: nvml or nvidia-smi).",
                len(inventory.gpus),
                {"source": inventory.source},
            )
        )
        by_index = {gpu.index: gpu for gpu in inventory.gpus}
        return [*(_with_identity(f, by_index) for f in findings), *samples]


def _with_identity(finding: Finding, gpus: dict[int, GpuState]) -> Finding:
    """The GPU's UUID and MIG UUIDs on a finding about one GPU, so /ready?devices= takes what jobs know; its
    Bus-Id and /dev/nvidiaN minor, so the cluster's device APIs find the same GPU."""
    if finding.device is None:
        return finding
    gpu = gpus.get(finding.device)
    observed = {**finding.observed, OBSERVED_DEVICE_IDS: gpu.device_ids if gpu else []}
    if gpu is not None and gpu.bus_id:
        observed[OBSERVED_PCI_BUS_ID] = gpu.bus_id
    if gpu is not None and gpu.minor is not None:
        observed[OBSERVED_DEVICE_MINOR] = gpu.minor
    return replace(finding, observed=observed)


def required_when_unreadable(output: ProbeOutput, expected: int, cfg: GpuConfig) -> ProbeOutput:
    """Never ready on a guess: where GPUs are expected (/dev/nvidiaN nodes, gpu.expected_gpus) and cannot be read,
    the unknown findings block readiness whatever health.required_checks says, unless the operator opted out
    (gpu.unreadable_blocks_ready: false)."""
    if expected == 0 or not cfg.unreadable_blocks_ready:
        return output
    return [
        replace(item, required=True) if isinstance(item, Finding) and item.status == Status.UNKNOWN else item
        for item in output
    ]


def _tool_missing(expected: int, minors: list[int], tools: Tools) -> ProbeOutput:
    """GPUs expected but no NVIDIA tool anywhere: what the GPUs are like cannot be known (not a failed GPU)."""
    if expected == 0:
        return [check.report(NOT_APPLICABLE, "", NO_DRIVER) for check in CHECKS]
    nodes = f"{len(minors)} /dev/nvidiaN nodes" if minors else "gpu.expected_gpus"
    message = f"{expected} GPUs expected ({nodes}) but no NVIDIA tool to read them: {tools.looked}"
    observed = {"expected": expected, "device_nodes": len(minors)}
    return [check.report(GPU_TOOL_MISSING, "", message, observed) for check in CHECKS]


def _unavailable(expected: int, why: Unavailable) -> ProbeOutput:
    if expected == 0 and why.smi_not_found:
        return [check.report(NOT_APPLICABLE, "", NO_DRIVER) for check in CHECKS]
    out: ProbeOutput = []
    if expected > 0:
        message = f"{expected} GPUs expected but the driver cannot be reached ({why.detail})"
        out.append(HEALTH.report(GPU_MISSING, "", message, {"expected": expected}, hint=GPU_DRIVER_UNAVAILABLE.hint))
    checks = CHECKS[1:] if expected > 0 else CHECKS
    out += [check.report(GPU_DRIVER_UNAVAILABLE, "", f"cannot read GPUs: {why.detail}") for check in checks]
    return out
