"""gpu.health, gpu.throttle, gpu.memory: the judgements on one GPU's state (pure functions of the model).

One finding per (check, GPU): every problem found goes into the message, the worst one leads (its reason,
status and hint). GPUs expected but not usable are gpu.health findings of their own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from probes.base import OBSERVED_HBM_FREE_MIB, Check, Finding, Reason, Status
from probes.gpu.config import GpuConfig
from probes.gpu.model import CLOCK_EVENT_BITS, MIB, GpuInventory, GpuState
from probes.gpu.reasons import (
    GPU_ECC_UNCORRECTABLE,
    GPU_INFOROM_CORRUPTED,
    GPU_MEMORY_LEAKED,
    GPU_MEMORY_LOW,
    GPU_MISSING,
    GPU_QUERY_FAILED,
    GPU_RECOVERY_REQUIRED,
    GPU_RETIREMENT_PENDING,
    GPU_ROW_REMAP_FAILED,
    GPU_THROTTLED,
    HEALTH,
    MEMORY,
    THROTTLE,
)

_STATUS_ORDER = {Status.OK: 0, Status.UNKNOWN: 1, Status.WARN: 2, Status.FAIL: 3}

# Clock event reasons that mean the hardware is slowing the GPU down, and the ones that are no problem
# (idle, application clocks, the SW power cap that every busy GPU touches, sync boost, display).
HW_THROTTLE_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
SW_THERMAL_REASON = "sw_thermal_slowdown"

RECOVERY_HINTS = {
    "Reset": "stop the GPU's processes and reset it (nvidia-smi -r -i {index}), or reboot the node",
    "Reboot": "the fault may have left the OS inconsistent: drain the node and reboot it",
    "System Reboot": "drain the node and reboot it",
    "Drain P2P": "drain the node's jobs (peer-to-peer traffic must stop), then the GPU recovers",
    "Drain and Reset": "drain the node's jobs, then reset the GPU (nvidia-smi -r -i {index})",
    "Bus Reset": "reset the GPU's PCIe bus: drain the node and reboot it",
    "Recover IMEX Domain": "recover the IMEX domain (restart nvidia-imex on the domain's nodes)",
}


@dataclass(frozen=True)
class Problem:
    reason: Reason
    message: str
    hint: str
    status: Status | None = None  # None: the reason's own status

    @property
    def effective_status(self) -> Status:
        return self.status or self.reason.status


def fold(check: Check, gpu: GpuState, problems: list[Problem], ok_message: str, observed: dict[str, Any]) -> Finding:
    """One finding per (check, GPU): the worst problem leads, every problem is in the message."""
    if not problems:
        return check.ok(gpu.subject, ok_message, observed, device=gpu.index)
    ordered = sorted(problems, key=lambda p: -_STATUS_ORDER[p.effective_status])  # stable: first listed wins ties
    lead = ordered[0]
    observed = {**observed, "reasons": sorted({p.reason.code for p in problems})}
    message = f"{gpu.subject}: " + "; ".join(p.message for p in ordered)
    return check.report(
        lead.reason, gpu.subject, message, observed, hint=lead.hint, status=lead.effective_status, device=gpu.index
    )


def _queried(gpu: GpuState, keys: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    keys = set(keys)
    return sorted(k for k in set(gpu.unsupported) if k in keys), {k: v for k, v in gpu.errors.items() if k in keys}


_HEALTH_QUERIES = (
    "ecc_uncorrected_volatile",
    "ecc_uncorrected_aggregate",
    "ecc_corrected_volatile",
    "ecc_corrected_aggregate",
    "retired_pages",
    "retired_pages_pending",
    "remapped_rows",
    "recovery_action",
    "inforom",
)


# --- health ----------------------------------------------------------------------------------------


def health_finding(gpu: GpuState, cfg: GpuConfig) -> Finding:
    unsupported, errors = _queried(gpu, _HEALTH_QUERIES)
    observed: dict[str, Any] = {
        "uuid": gpu.uuid,
        "bus_id": gpu.bus_id,
        "ecc_uncorrected_volatile": gpu.ecc_uncorrected_volatile,
        "ecc_uncorrected_aggregate": gpu.ecc_uncorrected_aggregate,
        "ecc_corrected_volatile": gpu.ecc_corrected_volatile,
        "retired_pages_sbe": gpu.retired_pages_sbe,
        "retired_pages_dbe": gpu.retired_pages_dbe,
        "retired_pages_pending": gpu.retired_pages_pending,
        "remapped_rows_uncorrectable": gpu.remapped_rows_uncorrectable,
        "remap_pending": gpu.remap_pending,
        "remap_failed": gpu.remap_failed,
        "recovery_action": gpu.recovery_action,
    }
    if unsupported:
        observed["not_supported"] = unsupported
    if errors:
        observed["errors"] = errors
    problems = [*_hardware_problems(gpu), *_ecc_problems(gpu, cfg), *_pending_problems(gpu, cfg)]
    if gpu.inforom_corrupted:
        message = "the infoROM is corrupted (ECC and retirement records may not persist)"
        problems.append(Problem(GPU_INFOROM_CORRUPTED, message, GPU_INFOROM_CORRUPTED.hint))
    if not problems and (errors or gpu.lost):
        detail = "; ".join(f"{k}: {v}" for k, v in sorted(errors.items()))
        problems.append(Problem(GPU_QUERY_FAILED, f"could not read its health: {detail}", GPU_QUERY_FAILED.hint))
    ok_message = f"{gpu.subject} ({gpu.name or 'GPU'}): no uncorrectable ECC errors, nothing pending"
    if unsupported:
        ok_message += f" (not supported: {', '.join(unsupported)})"
    return fold(HEALTH, gpu, problems, ok_message, observed)


def _hardware_problems(gpu: GpuState) -> list[Problem]:
    problems = []
    if gpu.lost:
        problems.append(
            Problem(
                GPU_MISSING,
                "the GPU has fallen off the bus (NVML: GPU is lost)",
                "the GPU stopped answering (XID 79): drain the node and reboot it; if it recurs, reseat or "
                "replace the GPU",
            )
        )
    if gpu.remap_failed:
        problems.append(
            Problem(
                GPU_ROW_REMAP_FAILED,
                "row remapping failed: the GPU has no spare memory rows left for a failing one",
                "the GPU needs replacement (RMA, XID 64): drain it and open a case with the vendor",
            )
        )
    if gpu.recovery_action not in (None, "None"):
        action = gpu.recovery_action or ""
        hint = RECOVERY_HINTS.get(action, "follow NVIDIA's recovery action for the GPU").format(index=gpu.index)
        problems.append(Problem(GPU_RECOVERY_REQUIRED, f"the driver asks for recovery action {action!r}", hint))
    return problems


def _ecc_problems(gpu: GpuState, cfg: GpuConfig) -> list[Problem]:
    problems = []
    hint = (
        f"the GPU hit uncorrectable memory errors (XID 48/94/95): drain it and reset it (nvidia-smi -r -i "
        f"{gpu.index}) or reboot; replace it if they recur"
    )
    if gpu.ecc_uncorrected_volatile:
        message = f"{gpu.ecc_uncorrected_volatile} uncorrectable ECC errors since the driver loaded"
        problems.append(Problem(GPU_ECC_UNCORRECTABLE, message, hint))
    if gpu.sram_threshold_exceeded:
        problems.append(
            Problem(
                GPU_ECC_UNCORRECTABLE,
                "SRAM uncorrectable errors exceeded NVIDIA's threshold",
                "the GPU is due for replacement (RMA): drain it and open a case with the vendor",
            )
        )
    aggregate = gpu.ecc_uncorrected_aggregate or 0
    limit = cfg.ecc_aggregate_uncorrectable_max
    if aggregate > limit:
        message = f"{aggregate} uncorrectable ECC errors over the GPU's life (above {limit})"
        hint = "the GPU keeps failing: drain it and open an RMA case with the vendor (nvidia-bug-report.sh)"
        problems.append(Problem(GPU_ECC_UNCORRECTABLE, message, hint))
    elif aggregate > 0 and not gpu.ecc_uncorrected_volatile:
        message = f"{aggregate} uncorrectable ECC errors over the GPU's life, none since the driver loaded"
        hint = "watch the count; past gpu.ecc_aggregate_uncorrectable_max the GPU is due for replacement"
        problems.append(Problem(GPU_ECC_UNCORRECTABLE, message, hint, Status.WARN))
    return problems


def _pending_problems(gpu: GpuState, cfg: GpuConfig) -> list[Problem]:
    pending = []
    if gpu.retired_pages_pending:
        pending.append("a page retirement")
    if gpu.remap_pending:
        pending.append("a row remap")
    if not pending:
        return []
    return [
        Problem(
            GPU_RETIREMENT_PENDING,
            f"{' and '.join(pending)} waits for a GPU reset (XID 63)",
            f"when the GPU is idle, reset it (nvidia-smi -r -i {gpu.index}) or reboot the node to apply it",
            Status(cfg.retirement_pending_status),
        )
    ]


# --- throttle --------------------------------------------------------------------------------------


def active_reasons(bits: int) -> list[str]:
    return [name for name, bit in CLOCK_EVENT_BITS.items() if bits & bit]


def throttle_finding(gpu: GpuState, cfg: GpuConfig) -> Finding:
    unsupported, errors = _queried(gpu, ("clock_event_reasons",))
    observed: dict[str, Any] = {"clock_event_reasons": gpu.clock_event_reasons}
    if gpu.clock_event_reasons is None:
        if unsupported:
            observed["not_supported"] = unsupported
            message = f"{gpu.subject}: clock event reasons not supported on this GPU"
            return THROTTLE.ok(gpu.subject, message, observed, device=gpu.index)
        observed["errors"] = errors
        detail = "; ".join(errors.values()) or "not reported"
        message = f"{gpu.subject}: could not read clock event reasons ({detail})"
        hint = "check the driver (nvidia-smi -q -d PERFORMANCE)"
        return THROTTLE.report(GPU_QUERY_FAILED, gpu.subject, message, observed, hint=hint, device=gpu.index)
    active = active_reasons(gpu.clock_event_reasons)
    observed["active"] = active
    problems = []
    hardware = [name for name in HW_THROTTLE_REASONS if name in active]
    if hardware:
        problems.append(
            Problem(
                GPU_THROTTLED,
                f"hardware is slowing the clocks ({', '.join(hardware)})",
                "HW slowdown means overheating, a power brake from the PSU or board, or a failing sensor: check "
                "cooling and power (nvidia-smi -q -d TEMPERATURE,POWER,PERFORMANCE)",
            )
        )
    if SW_THERMAL_REASON in active and cfg.sw_thermal_status != "ok":
        problems.append(
            Problem(
                GPU_THROTTLED,
                "the driver lowers clocks to stay under its temperature target (sw_thermal_slowdown)",
                "the GPU runs hot: check fans, airflow and the inlet temperature",
                Status(cfg.sw_thermal_status),
            )
        )
    benign = ", ".join(active) if active else "none"
    return fold(THROTTLE, gpu, problems, f"{gpu.subject}: no hardware slowdown (active: {benign})", observed)


# --- memory ----------------------------------------------------------------------------------------


def memory_finding(gpu: GpuState, cfg: GpuConfig, holder_pids: set[int] | None, ledger_note: str = "") -> Finding:
    """`ledger_note`: where the device plugin's ledger has the GPU (free, or the pod), for the leak message."""
    unsupported, errors = _queried(gpu, ("memory_info", "compute_processes", "graphics_processes"))
    if gpu.memory_free_bytes is None or gpu.memory_used_bytes is None:
        observed: dict[str, Any] = {"not_supported": unsupported, "errors": errors}
        if "memory_info" in unsupported and not errors:
            return MEMORY.ok(gpu.subject, f"{gpu.subject}: framebuffer usage not supported", observed, device=gpu.index)
        message = f"{gpu.subject}: framebuffer usage unreadable ({'; '.join(errors.values())})"
        hint = "check the driver (nvidia-smi -q -d MEMORY)"
        return MEMORY.report(GPU_QUERY_FAILED, gpu.subject, message, observed, hint=hint, device=gpu.index)
    free_mib = round(gpu.memory_free_bytes / MIB)
    used_mib = round(gpu.memory_used_bytes / MIB)
    total_mib = round((gpu.memory_total_bytes or 0) / MIB)
    processes = None if gpu.processes is None else sorted({p.pid for p in gpu.processes})
    observed = {OBSERVED_HBM_FREE_MIB: free_mib, "used_mib": used_mib, "total_mib": total_mib, "processes": processes}
    problems = []
    if processes == [] and not holder_pids and used_mib > cfg.memory_leak_min_mib:
        problems.append(
            Problem(
                GPU_MEMORY_LEAKED,
                f"{used_mib} MiB of framebuffer in use with no process on the GPU"
                + (f" ({ledger_note})" if ledger_note else ""),
                f"memory was not released (a killed job's context, or a process NVML cannot see): reset the GPU "
                f"(nvidia-smi -r -i {gpu.index}) or reboot the node",
            )
        )
    if free_mib < cfg.min_free_mib:
        problems.append(
            Problem(
                GPU_MEMORY_LOW,
                f"only {free_mib} MiB of {total_mib} MiB framebuffer free, below {cfg.min_free_mib:g} MiB",
                f"another process holds GPU memory: list them (nvidia-smi -q -d PIDS -i {gpu.index}) and stop "
                "leftovers of earlier jobs",
            )
        )
    return fold(MEMORY, gpu, problems, f"{gpu.subject}: {free_mib} MiB of {total_mib} MiB free", observed)


# --- GPUs expected but not usable ------------------------------------------------------------------


def missing_findings(inventory: GpuInventory, minors: list[int], expected_gpus: int | None) -> list[Finding]:
    """GPUs expected (gpu.expected_gpus, else one per /dev/nvidiaN) that the backend cannot open."""
    findings = []
    for failure in inventory.failures:
        subject = f"gpu{failure.index}" if failure.index is not None else f"pci {failure.bus_id}"
        where = f"GPU {failure.index}" if failure.index is not None else f"the GPU at {failure.bus_id}"
        findings.append(
            HEALTH.report(
                GPU_MISSING,
                subject,
                f"{inventory.source} cannot open {where}: {failure.error}",
                {"bus_id": failure.bus_id, "error": failure.error},
                hint="the GPU is not usable (fallen off the bus or hung): check dmesg for XID 79/NVRM errors, "
                "drain the node and reboot it; replace the GPU if it recurs",
                device=failure.index,
            )
        )
    seen = len(inventory.gpus) + len(inventory.failures)
    if expected_gpus is not None:
        if seen < expected_gpus:
            findings.append(_count_missing(inventory, expected_gpus, "gpu.expected_gpus"))
        return findings
    known_minors = {gpu.minor for gpu in inventory.gpus}
    if None in known_minors:  # the backend did not say which node is which GPU: compare counts
        if seen < len(minors):
            findings.append(_count_missing(inventory, len(minors), "/dev/nvidiaN nodes"))
        return findings
    missing = [minor for minor in minors if minor not in known_minors]
    if len(missing) <= len(inventory.failures):  # every absent node is a GPU already reported as unopenable
        return findings
    for minor in missing:
        findings.append(
            HEALTH.report(
                GPU_MISSING,
                f"nvidia{minor}",
                f"/dev/nvidia{minor} exists but {inventory.source} does not enumerate that GPU",
                {"minor": minor, "enumerated": len(inventory.gpus)},
                hint="a GPU the driver registered is gone (fallen off the bus): check dmesg for XID 79, drain the "
                "node and reboot it; replace the GPU if it recurs",
            )
        )
    return findings


def _count_missing(inventory: GpuInventory, expected: int, source: str) -> Finding:
    found = len(inventory.gpus)
    return HEALTH.report(
        GPU_MISSING,
        "",
        f"{expected} GPUs expected ({source}), {inventory.source} enumerates {found}",
        {"expected": expected, "enumerated": found},
        hint="a GPU is gone from the bus or the driver did not bind it: check lspci -d 10de: and dmesg (XID 79), "
        "drain the node and reboot it",
    )
