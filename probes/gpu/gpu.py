"""gpu.health, gpu.throttle, gpu.memory, gpu.holders: NVIDIA GPUs through NVML, nvidia-smi as the fallback.

One run reads every GPU once (probes/_nvml.py: one NVML pass, or `nvidia-smi -q` plus one CSV query), then
scans /proc/*/fd for holders of /dev/nvidiaN. NVML calls run in this probe's thread: a wedged GPU can block
one for a long time, and the scheduler's probe timeout is what bounds the run (see README.md, Probes, NVIDIA GPU).
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probes.base import (
    OBSERVED_HBM_FREE_MIB,
    Finding,
    Probe,
    ProbeContext,
    ProbeOutput,
    Sample,
    Status,
    register,
)
from probes.gpu.nvml import CLOCK_EVENT_BITS, MIB, GpuInventory, GpuState, NvmlUnavailable, library_loadable, read_nvml
from probes.runtime import procfs as _procfs

CHECKS = ("gpu.health", "gpu.throttle", "gpu.memory", "gpu.holders")
NO_DRIVER = "no NVIDIA driver on this host"
_DEVICE_NODE = re.compile(r"^nvidia(\d+)$")
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


def device_minors(dev_dir: Path) -> list[int]:
    """N of every /dev/nvidiaN character device (one per GPU the driver registered)."""
    minors = []
    try:
        names = os.listdir(dev_dir)
    except OSError:
        return []
    for name in names:
        match = _DEVICE_NODE.match(name)
        if match and _is_char_device(dev_dir / name):
            minors.append(int(match[1]))
    return sorted(minors)


def _is_char_device(path: Path) -> bool:
    try:
        return path.is_char_device()
    except OSError:
        return False


# --- judging one GPU -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    status: Status
    reason: str
    message: str
    hint: str


def fold(check: str, gpu: GpuState, problems: list[Problem], ok_message: str, observed: dict[str, Any]) -> Finding:
    """One finding per (check, GPU): the worst problem leads, every problem is in the message."""
    if not problems:
        return Finding(check, gpu.subject, Status.OK, "OK", ok_message, observed=observed, device=gpu.index)
    ordered = sorted(problems, key=lambda p: -_STATUS_ORDER[p.status])  # stable: first listed wins a tie
    lead = ordered[0]
    observed = {**observed, "reasons": sorted({p.reason for p in problems})}
    message = f"{gpu.subject}: " + "; ".join(p.message for p in ordered)
    return Finding(check, gpu.subject, lead.status, lead.reason, message, lead.hint, observed, device=gpu.index)


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


def health_finding(gpu: GpuState, cfg: Any) -> Finding:
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
    index = gpu.index
    problems: list[Problem] = []
    if gpu.lost:
        problems.append(
            Problem(
                Status.FAIL,
                "GpuMissing",
                "the GPU has fallen off the bus (NVML: GPU is lost)",
                "the GPU stopped answering (XID 79): drain the node and reboot it; if it recurs, reseat or "
                "replace the GPU",
            )
        )
    if gpu.remap_failed:
        problems.append(
            Problem(
                Status.FAIL,
                "GpuRowRemapFailed",
                "row remapping failed: the GPU has no spare memory rows left for a failing one",
                "the GPU needs replacement (RMA, XID 64): drain it and open a case with the vendor",
            )
        )
    if gpu.recovery_action not in (None, "None"):
        action = gpu.recovery_action or ""
        problems.append(
            Problem(
                Status.FAIL,
                "GpuRecoveryRequired",
                f"the driver asks for recovery action {action!r}",
                RECOVERY_HINTS.get(action, "follow NVIDIA's recovery action for the GPU").format(index=index),
            )
        )
    ecc_hint = (
        f"the GPU hit uncorrectable memory errors (XID 48/94/95): drain it and reset it (nvidia-smi -r -i {index}) "
        "or reboot; replace it if they recur"
    )
    if gpu.ecc_uncorrected_volatile:
        problems.append(
            Problem(
                Status.FAIL,
                "GpuEccUncorrectable",
                f"{gpu.ecc_uncorrected_volatile} uncorrectable ECC errors since the driver loaded",
                ecc_hint,
            )
        )
    if gpu.sram_threshold_exceeded:
        problems.append(
            Problem(
                Status.FAIL,
                "GpuEccUncorrectable",
                "SRAM uncorrectable errors exceeded NVIDIA's threshold",
                "the GPU is due for replacement (RMA): drain it and open a case with the vendor",
            )
        )
    aggregate = gpu.ecc_uncorrected_aggregate or 0
    if aggregate > cfg.ecc_aggregate_uncorrectable_max:
        problems.append(
            Problem(
                Status.FAIL,
                "GpuEccUncorrectable",
                f"{aggregate} uncorrectable ECC errors over the GPU's life "
                f"(above {cfg.ecc_aggregate_uncorrectable_max})",
                "the GPU keeps failing: drain it and open an RMA case with the vendor (nvidia-bug-report.sh)",
            )
        )
    elif aggregate > 0 and not gpu.ecc_uncorrected_volatile:
        problems.append(
            Problem(
                Status.WARN,
                "GpuEccUncorrectable",
                f"{aggregate} uncorrectable ECC errors over the GPU's life, none since the driver loaded",
                "watch the count; past gpu.ecc_aggregate_uncorrectable_max the GPU is due for replacement",
            )
        )
    pending = []
    if gpu.retired_pages_pending:
        pending.append("a page retirement")
    if gpu.remap_pending:
        pending.append("a row remap")
    if pending:
        problems.append(
            Problem(
                Status(cfg.retirement_pending_status),
                "GpuRetirementPending",
                f"{' and '.join(pending)} waits for a GPU reset (XID 63)",
                f"when the GPU is idle, reset it (nvidia-smi -r -i {index}) or reboot the node to apply it",
            )
        )
    if gpu.inforom_corrupted:
        problems.append(
            Problem(
                Status.WARN,
                "GpuInfoRomCorrupted",
                "the infoROM is corrupted (ECC and retirement records may not persist)",
                "reflash the infoROM with NVIDIA support, or replace the GPU",
            )
        )
    if not problems and (errors or gpu.lost):
        problems.append(
            Problem(
                Status.UNKNOWN,
                "GpuQueryFailed",
                "could not read its health: " + "; ".join(f"{k}: {v}" for k, v in sorted(errors.items())),
                "check the driver (dmesg | grep -i nvrm; nvidia-smi -q -i N)",
            )
        )
    ok_message = f"{gpu.subject} ({gpu.name or 'GPU'}): no uncorrectable ECC errors, nothing pending"
    if unsupported:
        ok_message += f" (not supported: {', '.join(unsupported)})"
    return fold("gpu.health", gpu, problems, ok_message, observed)


def active_reasons(bits: int) -> list[str]:
    return [name for name, bit in CLOCK_EVENT_BITS.items() if bits & bit]


def throttle_finding(gpu: GpuState, cfg: Any) -> Finding:
    unsupported, errors = _queried(gpu, ("clock_event_reasons",))
    observed: dict[str, Any] = {"clock_event_reasons": gpu.clock_event_reasons}
    if gpu.clock_event_reasons is None:
        if unsupported:
            observed["not_supported"] = unsupported
            message = f"{gpu.subject}: clock event reasons not supported on this GPU"
            return Finding("gpu.throttle", gpu.subject, Status.OK, "OK", message, observed=observed, device=gpu.index)
        observed["errors"] = errors
        detail = "; ".join(errors.values()) or "not reported"
        return Finding(
            "gpu.throttle",
            gpu.subject,
            Status.UNKNOWN,
            "GpuQueryFailed",
            f"{gpu.subject}: could not read clock event reasons ({detail})",
            "check the driver (nvidia-smi -q -d PERFORMANCE)",
            observed,
            device=gpu.index,
        )
    active = active_reasons(gpu.clock_event_reasons)
    observed["active"] = active
    problems = []
    hardware = [name for name in HW_THROTTLE_REASONS if name in active]
    if hardware:
        problems.append(
            Problem(
                Status.FAIL,
                "GpuThrottled",
                f"hardware is slowing the clocks ({', '.join(hardware)})",
                "HW slowdown means overheating, a power brake from the PSU or board, or a failing sensor: check "
                "cooling and power (nvidia-smi -q -d TEMPERATURE,POWER,PERFORMANCE)",
            )
        )
    if SW_THERMAL_REASON in active and cfg.sw_thermal_status != "ok":
        problems.append(
            Problem(
                Status(cfg.sw_thermal_status),
                "GpuThrottled",
                "the driver lowers clocks to stay under its temperature target (sw_thermal_slowdown)",
                "the GPU runs hot: check fans, airflow and the inlet temperature",
            )
        )
    benign = ", ".join(active) if active else "none"
    return fold("gpu.throttle", gpu, problems, f"{gpu.subject}: no hardware slowdown (active: {benign})", observed)


def memory_finding(gpu: GpuState, cfg: Any, holder_pids: set[int] | None) -> Finding:
    unsupported, errors = _queried(gpu, ("memory_info", "compute_processes", "graphics_processes"))
    if gpu.memory_free_bytes is None or gpu.memory_used_bytes is None:
        status = Status.OK if "memory_info" in unsupported and not errors else Status.UNKNOWN
        return Finding(
            "gpu.memory",
            gpu.subject,
            status,
            "OK" if status == Status.OK else "GpuQueryFailed",
            f"{gpu.subject}: framebuffer usage "
            + ("not supported" if status == Status.OK else f"unreadable ({'; '.join(errors.values())})"),
            "" if status == Status.OK else "check the driver (nvidia-smi -q -d MEMORY)",
            {"not_supported": unsupported, "errors": errors},
            device=gpu.index,
        )
    free_mib = round(gpu.memory_free_bytes / MIB)
    used_mib = round(gpu.memory_used_bytes / MIB)
    total_mib = round((gpu.memory_total_bytes or 0) / MIB)
    processes = None if gpu.processes is None else sorted({p.pid for p in gpu.processes})
    observed: dict[str, Any] = {
        OBSERVED_HBM_FREE_MIB: free_mib,
        "used_mib": used_mib,
        "total_mib": total_mib,
        "processes": processes,
    }
    problems = []
    no_process = processes == [] and not holder_pids
    if no_process and used_mib > cfg.memory_leak_min_mib:
        problems.append(
            Problem(
                Status.FAIL,
                "GpuMemoryLeaked",
                f"{used_mib} MiB of framebuffer in use with no process on the GPU",
                f"memory was not released (a killed job's context, or a process NVML cannot see): reset the GPU "
                f"(nvidia-smi -r -i {gpu.index}) or reboot the node",
            )
        )
    if free_mib < cfg.min_free_mib:
        problems.append(
            Problem(
                Status.FAIL,
                "GpuMemoryLow",
                f"only {free_mib} MiB of {total_mib} MiB framebuffer free, below {cfg.min_free_mib:g} MiB",
                f"another process holds GPU memory: list them (nvidia-smi -q -d PIDS -i {gpu.index}) and stop "
                "leftovers of earlier jobs",
            )
        )
    ok_message = f"{gpu.subject}: {free_mib} MiB of {total_mib} MiB free"
    return fold("gpu.memory", gpu, problems, ok_message, observed)


def missing_findings(inventory: GpuInventory, minors: list[int], expected_gpus: int | None) -> list[Finding]:
    """GPUs expected (gpu.expected_gpus, else one per /dev/nvidiaN) that the backend cannot open."""
    findings = []
    for failure in inventory.failures:
        subject = f"gpu{failure.index}" if failure.index is not None else f"pci {failure.bus_id}"
        where = f"GPU {failure.index}" if failure.index is not None else f"the GPU at {failure.bus_id}"
        findings.append(
            Finding(
                "gpu.health",
                subject,
                Status.FAIL,
                "GpuMissing",
                f"{inventory.source} cannot open {where}: {failure.error}",
                "the GPU is not usable (fallen off the bus or hung): check dmesg for XID 79/NVRM errors, drain "
                "the node and reboot it; replace the GPU if it recurs",
                {"bus_id": failure.bus_id, "error": failure.error},
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
            Finding(
                "gpu.health",
                f"nvidia{minor}",
                Status.FAIL,
                "GpuMissing",
                f"/dev/nvidia{minor} exists but {inventory.source} does not enumerate that GPU",
                "a GPU the driver registered is gone (fallen off the bus): check dmesg for XID 79, drain the "
                "node and reboot it; replace the GPU if it recurs",
                {"minor": minor, "enumerated": len(inventory.gpus)},
            )
        )
    return findings


def _count_missing(inventory: GpuInventory, expected: int, source: str) -> Finding:
    found = len(inventory.gpus)
    return Finding(
        "gpu.health",
        "",
        Status.FAIL,
        "GpuMissing",
        f"{expected} GPUs expected ({source}), {inventory.source} enumerates {found}",
        "a GPU is gone from the bus or the driver did not bind it: check lspci -d 10de: and dmesg (XID 79), "
        "drain the node and reboot it",
        {"expected": expected, "enumerated": found},
    )


# --- holders ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    pid: int
    command: str
    owner: str
    in_pod: bool
    allowed: bool
    sources: tuple[str, ...]  # "fd" (holds /dev/nvidiaN open), "nvml" (in the driver's process list)

    @property
    def out_of_band(self) -> bool:
        return not self.in_pod and not self.allowed

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "command": self.command[:120], "owner": self.owner, "sources": list(self.sources)}


def is_allowed(command: str, comm: str, patterns: list[str]) -> bool:
    executable = os.path.basename(command.split(" ", 1)[0]) if command else ""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns for name in (executable, comm) if name)


def collect_holders(ctx: ProbeContext, gpus: list[GpuState]) -> tuple[dict[int, list[Holder]], dict[str, Any]]:
    """GPU index → processes holding it (fd scan by device number, merged with NVML's process lists)."""
    cfg = ctx.config.gpu
    by_minor = {gpu.minor: gpu for gpu in gpus if gpu.minor is not None}
    rdevs = _procfs.device_rdevs(ctx.host.dev, cfg.holder_devices)
    # The GPU a device node stands for, by its name (nvidiaN: N is the GPU's minor number).
    rdev_gpu = {}
    for rdev, path in rdevs.items():
        match = _DEVICE_NODE.match(os.path.basename(path))
        if match and int(match[1]) in by_minor:
            rdev_gpu[rdev] = by_minor[int(match[1])].index
    sources: dict[int, dict[int, set[str]]] = {gpu.index: {} for gpu in gpus}
    stats: dict[str, Any] = {"device_nodes": len(rdev_gpu)}
    if rdev_gpu:
        scan = _procfs.scan_open_files(ctx.host, rdevs=list(rdev_gpu), timeout=max(0.5, ctx.remaining() - 0.5))
        stats.update(processes_scanned=scan.processes, permission_denied=scan.permission_denied)
        for match in scan.matches:
            index = rdev_gpu.get(match.key[1]) if match.key[0] == "rdev" else None
            if index is not None:
                sources[index].setdefault(match.pid, set()).add("fd")
    for gpu in gpus:
        for process in gpu.processes or []:
            sources[gpu.index].setdefault(process.pid, set()).add("nvml")
    own_pid = os.getpid()
    holders: dict[int, list[Holder]] = {}
    infos: dict[int, Any] = {}
    for index, pids in sources.items():
        holders[index] = []
        for pid, where in sorted(pids.items()):
            if pid == own_pid:
                continue
            if pid not in infos:
                infos[pid] = _procfs.process_info(ctx.host.proc, pid)
            info = infos[pid]
            if info is None:  # exited since
                continue
            holders[index].append(
                Holder(
                    pid,
                    info.command,
                    info.cgroup.describe(),
                    info.cgroup.in_pod,
                    is_allowed(info.command, info.comm, cfg.allowed_holders),
                    tuple(sorted(where)),
                )
            )
    return holders, stats


def holder_finding(gpu: GpuState, holders: list[Holder], stats: dict[str, Any]) -> Finding:
    out_of_band = [h for h in holders if h.out_of_band]
    in_pods = [h for h in holders if h.in_pod]
    observed: dict[str, Any] = {
        "out_of_band": [h.to_dict() for h in out_of_band[:10]],
        "in_pods": [h.to_dict() for h in in_pods[:10]],
        "allowed": [h.to_dict() for h in holders if h.allowed and not h.in_pod][:10],
        **stats,
    }
    if out_of_band:
        who = ", ".join(f"pid {h.pid} ({h.command[:60]}, {h.owner})" for h in out_of_band[:3])
        more = f" and {len(out_of_band) - 3} more" if len(out_of_band) > 3 else ""
        first = out_of_band[0]
        return Finding(
            "gpu.holders",
            gpu.subject,
            Status.FAIL,
            "GpuHeldOutOfBand",
            f"{gpu.subject} is held outside Kubernetes by {who}{more}",
            f"pods placed here fail with 'CUDA-capable device(s) is/are busy or unavailable' or run out of memory: "
            f"stop it (kill {first.pid}, or docker/nerdctl stop the container) or run it as a pod",
            observed,
            device=gpu.index,
        )
    message = f"{gpu.subject}: no holder outside a pod ({len(in_pods)} in pods)"
    return Finding("gpu.holders", gpu.subject, Status.OK, "OK", message, observed=observed, device=gpu.index)


# --- metrics ---------------------------------------------------------------------------------------


def gpu_samples(gpu: GpuState, out_of_band: int | None) -> list[Sample]:
    labels = {"gpu": str(gpu.index), "uuid": gpu.uuid, "name": gpu.name}
    out: list[Sample] = []

    def add(name: str, help_text: str, value: float | int | bool | None, kind: str = "gauge", **extra: str) -> None:
        if value is not None:
            out.append(Sample(name, help_text, float(value), {**labels, **extra}, kind))  # type: ignore[arg-type]

    for kind, counter, value in (
        ("corrected", "volatile", gpu.ecc_corrected_volatile),
        ("uncorrected", "volatile", gpu.ecc_uncorrected_volatile),
        ("corrected", "aggregate", gpu.ecc_corrected_aggregate),
        ("uncorrected", "aggregate", gpu.ecc_uncorrected_aggregate),
    ):
        add(
            "nodehealth_gpu_ecc_errors_total",
            "ECC errors (volatile: since the driver loaded; aggregate: over the GPU's life).",
            value,
            "counter",
            type=kind,
            counter=counter,
        )
    add(
        "nodehealth_gpu_retired_pages_total",
        "Retired framebuffer pages.",
        gpu.retired_pages_sbe,
        "counter",
        cause="sbe",
    )
    add(
        "nodehealth_gpu_retired_pages_total",
        "Retired framebuffer pages.",
        gpu.retired_pages_dbe,
        "counter",
        cause="dbe",
    )
    add(
        "nodehealth_gpu_retired_pages_pending",
        "1 while a page retirement waits for a reset.",
        gpu.retired_pages_pending,
    )
    add(
        "nodehealth_gpu_remapped_rows_total",
        "Remapped memory rows.",
        gpu.remapped_rows_correctable,
        "counter",
        type="correctable",
    )
    add(
        "nodehealth_gpu_remapped_rows_total",
        "Remapped memory rows.",
        gpu.remapped_rows_uncorrectable,
        "counter",
        type="uncorrectable",
    )
    add("nodehealth_gpu_row_remap_pending", "1 while a row remap waits for a reset.", gpu.remap_pending)
    add("nodehealth_gpu_row_remap_failed", "1 when a row remap failed.", gpu.remap_failed)
    if gpu.recovery_action is not None:
        add(
            "nodehealth_gpu_recovery_action_required",
            "1 while the driver asks for a recovery action (label action).",
            gpu.recovery_action != "None",
            action=gpu.recovery_action,
        )
    if gpu.clock_event_reasons is not None:
        for name, bit in CLOCK_EVENT_BITS.items():
            add(
                "nodehealth_gpu_clock_event_reason_active",
                "1 while this clock event (throttle) reason is active.",
                bool(gpu.clock_event_reasons & bit),
                reason=name,
            )
    add("nodehealth_gpu_memory_used_bytes", "Framebuffer memory in use.", gpu.memory_used_bytes)
    add("nodehealth_gpu_memory_total_bytes", "Framebuffer memory size.", gpu.memory_total_bytes)
    add("nodehealth_gpu_temperature_celsius", "GPU core temperature.", gpu.temperature_celsius)
    add("nodehealth_gpu_power_watts", "GPU power draw.", gpu.power_watts)
    add("nodehealth_gpu_out_of_band_holders", "Processes outside any pod holding the GPU.", out_of_band)
    return out


# --- the nvidia-smi fallback -----------------------------------------------------------------------


class SmiUnavailable(Exception):
    def __init__(self, message: str, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


def read_smi(ctx: ProbeContext) -> GpuInventory:
    """`nvidia-smi -q` (+ one CSV query for indices and the recovery action); `-L` when `-q` fails."""
    from probes.gpu import nvidia_smi as smi

    cfg = ctx.config.gpu

    def run(*args: str) -> Any:
        return ctx.host.run([*cfg.smi_command, *args], timeout=min(cfg.smi_timeout_seconds, ctx.remaining()))

    result = run("-q")
    if result.not_found:
        raise SmiUnavailable(f"{cfg.smi_command[0]} not found", not_found=True)
    if result.timed_out:
        raise SmiUnavailable(f"nvidia-smi -q did not answer within {cfg.smi_timeout_seconds:g}s")
    if result.returncode != 0:
        listing = run("-L")
        if listing.returncode != 0 or listing.timed_out:
            first = (result.output.strip().splitlines() or [f"exit status {result.returncode}"])[0]
            raise SmiUnavailable(f"nvidia-smi failed: {first}")
        listed, failures = smi.parse_list(listing.output)
        inventory = GpuInventory("nvidia-smi", failures=failures)
        inventory.gpus = [GpuState(index=g.index, uuid=g.uuid, name=g.name) for g in listed]
        why = f"nvidia-smi -q failed (exit {result.returncode})"
        for gpu in inventory.gpus:  # listed, so present, but nothing else is known: the checks are unknown
            gpu.errors.update(dict.fromkeys(("ecc_uncorrected_volatile", "clock_event_reasons", "memory_info"), why))
        inventory.notes.append(f"nvidia-smi -q failed (exit {result.returncode}); only nvidia-smi -L was read")
        return inventory
    query = smi.parse_query(result.output)
    inventory = GpuInventory("nvidia-smi", query.driver_version, query.gpus, query.failures)
    fields = ["index", "pci.bus_id", "gpu_recovery_action"]
    csv = run("--query-gpu=" + ",".join(fields), "--format=csv,noheader")
    if csv.returncode != 0:
        inventory.notes.append("this driver's nvidia-smi does not report gpu_recovery_action")
        fields = fields[:2]
        csv = run("--query-gpu=" + ",".join(fields), "--format=csv,noheader")
    if csv.returncode == 0:
        rows = smi.parse_csv(csv.stdout, fields)
        by_bus = {smi.short_bus_id(row["pci.bus_id"] or ""): row for row in rows}
        for gpu in inventory.gpus:
            row = by_bus.get(smi.short_bus_id(gpu.bus_id))
            if row is None:
                continue
            gpu.index = int(row["index"] or gpu.index)
            if "gpu_recovery_action" in row and row["gpu_recovery_action"] is not None:
                gpu.recovery_action = row["gpu_recovery_action"]
            elif "gpu_recovery_action" in row:
                gpu.unsupported.append("recovery_action")
    else:
        inventory.notes.append("GPU indices are the order of nvidia-smi -q (the CSV query failed)")
    for gpu in inventory.gpus:
        if gpu.recovery_action is None and "recovery_action" not in gpu.unsupported:
            gpu.unsupported.append("recovery_action")
        if gpu.processes is None:
            gpu.unsupported.append("compute_processes")
    return inventory


# --- the probe -------------------------------------------------------------------------------------


def _command_exists(argv0: str) -> bool:
    return os.access(argv0, os.X_OK) if "/" in argv0 else shutil.which(argv0) is not None


@register
class GpuProbe(Probe):
    name = "gpu"
    checks = CHECKS
    default_interval = 30.0
    default_timeout = 20.0
    needs = "NVIDIA driver (libnvidia-ml.so.1 via nvidia-ml-py, or nvidia-smi); /dev/nvidiaN; /proc/*/fd for holders"

    def applicable(self, ctx: ProbeContext) -> str | None:
        cfg = ctx.config.gpu
        if cfg.expected_gpus or device_minors(ctx.host.dev):
            return None
        if _command_exists(cfg.smi_command[0]) or library_loadable(cfg.nvml_library):
            return None
        return NO_DRIVER

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        cfg = ctx.config.gpu
        minors = device_minors(ctx.host.dev)
        expected = cfg.expected_gpus if cfg.expected_gpus is not None else len(minors)
        inventory: GpuInventory | None = None
        nvml_error = "libnvidia-ml.so.1 not found"
        # dlopen first: on a host without the library, pynvml (several MiB) is never imported.
        if library_loadable(cfg.nvml_library):
            try:
                inventory = read_nvml(cfg.nvml_library)
            except NvmlUnavailable as exc:
                nvml_error = str(exc)
        if inventory is None:
            try:
                inventory = read_smi(ctx)
            except SmiUnavailable as exc:
                return self._unavailable(expected, nvml_error, exc)
        if not inventory.gpus and not inventory.failures and expected == 0:
            message = f"{inventory.source} reports no NVIDIA GPU on this host"
            return [Finding(check, "", Status.SKIP, "NotApplicable", message) for check in CHECKS]
        return self._judge(ctx, inventory, minors)

    def _unavailable(self, expected: int, nvml_error: str, exc: SmiUnavailable) -> ProbeOutput:
        if expected == 0 and exc.not_found:
            return [Finding(check, "", Status.SKIP, "NotApplicable", NO_DRIVER) for check in CHECKS]
        detail = f"NVML: {nvml_error}; nvidia-smi: {exc}"
        hint = (
            "the NVIDIA driver is not loaded or does not match its library: check `lsmod | grep nvidia`, "
            "dmesg (NVRM), and that the driver and libnvidia-ml versions agree; reboot after a driver upgrade"
        )
        out: ProbeOutput = []
        if expected > 0:
            out.append(
                Finding(
                    "gpu.health",
                    "",
                    Status.FAIL,
                    "GpuMissing",
                    f"{expected} GPUs expected but the driver cannot be reached ({detail})",
                    hint,
                    {"expected": expected},
                )
            )
        checks = CHECKS[1:] if expected > 0 else CHECKS
        out += [
            Finding(check, "", Status.UNKNOWN, "GpuDriverUnavailable", f"cannot read GPUs: {detail}", hint)
            for check in checks
        ]
        return out

    def _judge(self, ctx: ProbeContext, inventory: GpuInventory, minors: list[int]) -> ProbeOutput:
        cfg = ctx.config.gpu
        out: ProbeOutput = list(missing_findings(inventory, minors, cfg.expected_gpus))
        holders: dict[int, list[Holder]] | None = None
        holder_error = ""
        stats: dict[str, Any] = {}
        try:
            holders, stats = collect_holders(ctx, inventory.gpus)
        except (_procfs.ScanError, OSError) as exc:  # a stuck or failed /proc scan: holders unknown
            holder_error = f"{type(exc).__name__}: {exc}"
        for gpu in inventory.gpus:
            gpu_holders = None if holders is None else holders.get(gpu.index, [])
            holder_pids = None if gpu_holders is None else {h.pid for h in gpu_holders}
            out.append(health_finding(gpu, cfg))
            out.append(throttle_finding(gpu, cfg))
            out.append(memory_finding(gpu, cfg, holder_pids))
            if gpu_holders is None:
                out.append(
                    Finding(
                        "gpu.holders",
                        gpu.subject,
                        Status.UNKNOWN,
                        "GpuHolderScanFailed",
                        f"{gpu.subject}: could not scan /proc for holders ({holder_error})",
                        "a hung filesystem can stall the /proc/*/fd scan: check `storage.mounts`, or raise the "
                        "gpu probe's timeout_seconds",
                        device=gpu.index,
                    )
                )
            else:
                out.append(holder_finding(gpu, gpu_holders, stats))
            out_of_band = None if gpu_holders is None else sum(1 for h in gpu_holders if h.out_of_band)
            out.extend(gpu_samples(gpu, out_of_band))
        out.append(
            Sample(
                "nodehealth_gpu_devices",
                "GPUs the backend enumerates (label source: nvml or nvidia-smi).",
                len(inventory.gpus),
                {"source": inventory.source},
            )
        )
        return out
