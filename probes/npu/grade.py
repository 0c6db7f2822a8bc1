"""npu.grade: each chip's error codes (`npu-smi info -t health -i CARD -c CHIP`, every chip, whatever its health
word) graded by Huawei's fault levels (probes/npu/fault_codes.py): SeparateNPU / PreSeparateNPU → fail
(NpuFaultSeparate), RestartRequest / RestartBusiness / RestartNPU / FreeRestartNPU → fail with the reset as the
fix (NpuFaultReset), NotHandleFault / SubHealthFault → warn (NpuFaultMinor). The finding names the code, its
level and where the grade came from. The chips are read in parallel by at most npu.hccn_parallel children."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from probes.base import (
    NOT_APPLICABLE,
    PARSE_ERROR,
    Finding,
    Probe,
    ProbeContext,
    ProbeOutput,
    ProbeParseError,
    register,
)
from probes.npu.chip_reasons import (
    GRADE,
    GRADE_REASONS,
    NPU_FAULT_CODES_INVALID,
    NPU_FAULT_MINOR,
    NPU_FAULT_RESET,
    NPU_FAULT_SEPARATE,
    NPU_HEALTH_UNREAD,
)
from probes.npu.chipmap import ChipMap, ChipRef
from probes.npu.config import NpuConfig
from probes.npu.details import parse_health
from probes.npu.fault_codes import RESET, SEPARATE, FaultCodeError, FaultTable, load_table, worst
from probes.npu.npu import davinci_numbers
from probes.npu.smi import run_smi


def chip_detail(
    ctx: ProbeContext, settings: NpuConfig, chips: tuple[ChipRef, ...], kind: str
) -> list[tuple[ChipRef, str | None, str]]:
    """(chip, output, error) of `npu-smi info -t KIND -i CARD -c CHIP` for every chip, in parallel."""

    def one(chip: ChipRef) -> tuple[ChipRef, str | None, str]:
        if ctx.remaining(0) < 0.5:
            return chip, None, f"npu-smi info -t {kind} not asked: probe deadline near"
        args = ["info", "-t", kind, "-i", str(chip.card_id), "-c", str(chip.chip_index)]
        text, failure = run_smi(ctx, settings, args, reserve=0.3)
        return chip, text, failure.message if failure is not None else ""

    workers = max(1, min(settings.hccn_parallel, len(chips)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"npu-{kind}") as pool:
        return list(pool.map(one, chips))


@register
class GradeProbe(Probe):
    name = "npu.grade"
    checks = (GRADE.name,)
    reasons = GRADE_REASONS
    default_interval = 60.0
    default_timeout = 30.0
    needs = "npu-smi and /dev/davinciN; MindCluster's faultCode.json where mounted"

    def __init__(self) -> None:
        self._chipmap = ChipMap()

    def applicable(self, ctx: ProbeContext) -> str | None:
        return None if davinci_numbers(ctx.host.dev) else "no NPUs on this host (no /dev/davinciN)"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(NpuConfig)
        davinci = davinci_numbers(ctx.host.dev)
        if not davinci:
            return [GRADE.report(NOT_APPLICABLE, "", "no NPUs on this host")]
        try:
            table = load_table(settings.fault_code_files)
        except FaultCodeError as exc:
            message = f"fault grading table unusable: {exc}"
            return [GRADE.report(NPU_FAULT_CODES_INVALID, "", message, {"fault_code_files": settings.fault_code_files})]
        chips, _note = self._chipmap.chips(ctx, davinci)
        return [
            grade_finding(chip, text, error, table) for chip, text, error in chip_detail(ctx, settings, chips, "health")
        ]


def grade_finding(chip: ChipRef, text: str | None, error: str, table: FaultTable) -> Finding:
    observed: dict[str, Any] = {**chip.identity(), "grading": table.source}
    who = f"npu{chip.logical_id} (card {chip.card_id} chip {chip.chip_index})"
    if text is None:
        return GRADE.report(NPU_HEALTH_UNREAD, chip.subject, f"{who}: {error}", observed, device=chip.logical_id)
    try:
        detail = parse_health(text)
    except ProbeParseError as exc:
        message = f"{who}: npu-smi info -t health not understood: {exc}"
        return GRADE.report(
            PARSE_ERROR, chip.subject, message, {**observed, "output": text[:300]}, device=chip.logical_id
        )
    grades = [table.grade(code) for code in detail.error_codes]
    observed.update(
        {"health": detail.health, "codes": [{"code": g.code, "level": g.level, "source": g.source} for g in grades]}
    )
    top = worst(grades)
    if top is None:
        return GRADE.ok(
            chip.subject, f"{who}: no error codes (health {detail.health})", observed, device=chip.logical_id
        )
    message = f"{who}: error code {top.code} graded {top.level} by {top.source} (health word {detail.health})"
    if len(grades) > 1:
        message += f"; also {', '.join(f'{g.code} {g.level}' for g in grades if g is not top)}"
    reset = f"npu-smi set -t reset -i {chip.card_id} -c {chip.chip_index}"
    if top.level in SEPARATE:
        return GRADE.report(NPU_FAULT_SEPARATE, chip.subject, message, observed, device=chip.logical_id)
    if top.level in RESET:
        hint = f"restart the job; reset the chip when idle ({reset}) or reboot"
        return GRADE.report(NPU_FAULT_RESET, chip.subject, message, observed, hint=hint, device=chip.logical_id)
    return GRADE.report(NPU_FAULT_MINOR, chip.subject, message, observed, device=chip.logical_id)
