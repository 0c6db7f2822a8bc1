"""npu.health and npu.hbm: the judgements on chips npu-smi listed (pure functions of parsed output)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from probes.base import (
    OBSERVED_DEVICE_MINOR,
    OBSERVED_HBM_FREE_MIB,
    OBSERVED_PCI_BUS_ID,
    OBSERVED_PHYSICAL_ID,
    Finding,
    Sample,
    Status,
)
from probes.npu.details import HealthDetail
from probes.npu.info_table import NpuChip
from probes.npu.reasons import (
    HBM,
    HEALTH,
    NPU_HBM_LEAKED,
    NPU_HBM_LOW,
    NPU_HBM_UNREPORTED,
    NPU_HEALTH_UNRECOGNIZED,
    NPU_MISSING,
    health_reason,
)


def chip_subject(chip: NpuChip) -> str:
    return f"npu{chip.logical_id}"


def chip_observed(chip: NpuChip) -> dict[str, Any]:
    observed: dict[str, Any] = {"card": chip.card_id, "chip": chip.chip_index, "logical_id": chip.logical_id}
    if chip.physical_id is not None:
        observed["physical_id"] = chip.physical_id
    if chip.bus_id:
        observed["bus_id"] = chip.bus_id
    return observed


def with_identity(findings: Iterable[Finding | Sample], chips: Sequence[NpuChip]) -> list[Finding | Sample]:
    """Every finding about one chip carries the ids the cluster's device APIs know it by: its Bus-Id, its
    physical id and /dev/davinciN's N. The physical id is npu-smi's (the A3 `Phy-ID` column, `info -m`) when it
    prints one, else the logical id, which is the same number on the host's full view of the chips; a chip
    npu-smi does not list is known by its device node alone."""
    by_logical = {chip.logical_id: chip for chip in chips if chip.logical_id is not None}
    out: list[Finding | Sample] = []
    for finding in findings:
        if not isinstance(finding, Finding) or finding.device is None:
            out.append(finding)
            continue
        chip = by_logical.get(finding.device)
        number = chip.device_number if chip is not None else finding.device
        observed: dict[str, Any] = {**finding.observed, OBSERVED_PHYSICAL_ID: number, OBSERVED_DEVICE_MINOR: number}
        if chip is not None and chip.bus_id:
            observed[OBSERVED_PCI_BUS_ID] = chip.bus_id
        out.append(replace(finding, observed=observed))
    return out


def describe_chip(chip: NpuChip) -> str:
    return f"npu{chip.logical_id} ({chip.name or 'NPU'}, card {chip.card_id} chip {chip.chip_index})"


def _reset_command(chip: NpuChip) -> str:
    return f"npu-smi set -t reset -i {chip.card_id} -c {chip.chip_index}"


# --- health ----------------------------------------------------------------------------------------


def health_findings(
    chips: Sequence[NpuChip],
    details: Mapping[tuple[int, int], HealthDetail | str],
    health_status: Mapping[str, str],
    davinci: Sequence[int],
    expected_chips: int | None,
) -> list[Finding]:
    """npu.health per chip, plus one node-wide finding about chips expected but not listed."""
    status_of = {word.lower(): status for word, status in health_status.items()}
    out = [_chip_health(chip, details.get((chip.card_id, chip.chip_index)), status_of) for chip in chips]
    listed = {chip.device_number for chip in chips}
    for number in (n for n in davinci if n not in listed):
        out.append(
            HEALTH.report(
                NPU_MISSING,
                f"npu{number}",
                f"/dev/davinci{number} exists but npu-smi does not list chip {number}",
                {"device_node": f"davinci{number}", "chips_listed": len(chips)},
                device=number,
            )
        )
    out.append(_chip_count(chips, davinci, expected_chips))
    return out


def _chip_health(chip: NpuChip, detail: HealthDetail | str | None, status_of: Mapping[str, str]) -> Finding:
    observed = chip_observed(chip)
    observed["health"] = chip.health
    codes: tuple[str, ...] = ()
    information: tuple[str, ...] = ()
    if isinstance(detail, HealthDetail):
        codes, information = detail.error_codes, detail.error_information
        observed["error_codes"] = list(codes)
        if information:
            observed["error_information"] = list(information[:5])
    elif isinstance(detail, str):
        observed["health_detail_error"] = detail
    word = chip.health
    configured = status_of.get(word.lower())
    subject, device = chip_subject(chip), chip.logical_id
    if configured == "ok":
        return HEALTH.ok(subject, f"{describe_chip(chip)}: {word}", observed, device=device)
    suffix = (f", error codes {' '.join(codes)}" if codes else "") + (f": {information[0]}" if information else "")
    hint = (
        "look the error codes up in Ascend's fault-code table (faultCode.json of the device plugin); drain the "
        f"node and reset the chip ({_reset_command(chip)}) or reboot; replace the card if it comes back"
    )
    if configured is None and word.upper() == "UNKNOWN":
        message = f"{describe_chip(chip)} reports health UNKNOWN (device absent or not started){suffix}"
        return HEALTH.report(NPU_MISSING, subject, message, observed, device=device)
    if configured is None:
        message = f"{describe_chip(chip)} reports health {word!r}, a word the agent does not know{suffix}"
        hint = f"map it in npu.health_status (ok, warn or fail); {hint}"
        return HEALTH.report(NPU_HEALTH_UNRECOGNIZED, subject, message, observed, hint=hint, device=device)
    message = f"{describe_chip(chip)} health is {word}{suffix}"
    reason = health_reason(word)
    return HEALTH.report(reason, subject, message, observed, hint=hint, status=Status(configured), device=device)


def _chip_count(chips: Sequence[NpuChip], davinci: Sequence[int], expected_chips: int | None) -> Finding:
    observed: dict[str, Any] = {"chips_listed": len(chips), "davinci_nodes": len(davinci)}
    if expected_chips is not None:
        observed["expected_chips"] = expected_chips
    if expected_chips is not None and len(chips) < expected_chips:
        message = f"npu-smi lists {len(chips)} chips, {expected_chips} expected (npu.expected_chips)"
        return HEALTH.report(NPU_MISSING, "", message, observed)
    expected_text = f", {expected_chips} expected" if expected_chips is not None else ""
    return HEALTH.ok(
        "", f"npu-smi lists {len(chips)} chips{expected_text}; {len(davinci)} /dev/davinci nodes", observed
    )


# --- hbm -------------------------------------------------------------------------------------------


def hbm_findings(
    chips: Sequence[NpuChip],
    min_free_mib: float,
    leak_min_mib: float,
    chips_with_fd_holders: set[int],
    proc_mem_errors: Mapping[tuple[int, int], str],
    ledger_notes: Mapping[int, str] | None = None,
) -> list[Finding]:
    """npu.hbm per chip: free device memory below the floor; memory in use with no process on the chip (saying
    whether the device plugin's ledger has the chip free: `ledger_notes` per device number)."""
    out: list[Finding] = []
    for chip in chips:
        observed = chip_observed(chip)
        error = proc_mem_errors.get((chip.card_id, chip.chip_index))
        if error:
            observed["proc_mem_error"] = error
        note = (ledger_notes or {}).get(chip.device_number) if chip.device_number is not None else None
        out.append(_chip_memory(chip, observed, min_free_mib, leak_min_mib, chips_with_fd_holders, note or ""))
    return out


def _chip_memory(
    chip: NpuChip,
    observed: dict[str, Any],
    min_free_mib: float,
    leak_min_mib: float,
    fd_held: set[int],
    ledger_note: str = "",
) -> Finding:
    subject, device = chip_subject(chip), chip.logical_id
    memory = chip.device_memory()
    if memory is None:
        message = f"{describe_chip(chip)}: npu-smi shows no device memory figures"
        return HBM.report(NPU_HBM_UNREPORTED, subject, message, observed, device=device)
    kind, used, total = memory
    free = total - used
    observed.update({"memory": kind, "used_mib": used, "total_mib": total, OBSERVED_HBM_FREE_MIB: free})
    if chip.processes is not None:
        observed["processes"] = len(chip.processes)
        observed["process_memory_mib"] = sum(p.memory_mib or 0 for p in chip.processes)
    label = "HBM" if kind == "hbm" else "device memory"
    no_process = chip.processes is not None and not chip.processes and chip.device_number not in fd_held
    if no_process and used > leak_min_mib:
        message = (
            f"{describe_chip(chip)}: {used} MiB of {label} in use with no process on the chip "
            f"(above {leak_min_mib:g} MiB)" + (f"; {ledger_note}" if ledger_note else "")
        )
        if ledger_note:
            observed["ledger"] = ledger_note
        hint = f"memory of an exited job was not released: reset the chip ({_reset_command(chip)}) or reboot the node"
        return HBM.report(NPU_HBM_LEAKED, subject, message, observed, hint=hint, device=device)
    if free < min_free_mib:
        holders = ", ".join(f"{p.pid} ({p.name or '?'})" for p in (chip.processes or ())[:5])
        message = f"{describe_chip(chip)}: {free} MiB of {label} free of {total} MiB, below {min_free_mib:g} MiB" + (
            f"; processes {holders}" if holders else ""
        )
        return HBM.report(NPU_HBM_LOW, subject, message, observed, device=device)
    return HBM.ok(subject, f"{describe_chip(chip)}: {free} MiB of {label} free of {total} MiB", observed, device=device)
