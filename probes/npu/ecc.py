"""npu.ecc: each chip's HBM ECC (`npu-smi info -t ecc -i CARD -c CHIP`): double-bit errors and pages pending
isolation (`Next-Isolated Pages`) → fail; single-bit errors rising faster than npu.ecc_single_bit_per_hour_max
and isolated pages at npu.ecc_isolated_pages_warn → warn."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from probes.base import (
    NOT_APPLICABLE,
    PARSE_ERROR,
    Finding,
    Probe,
    ProbeContext,
    ProbeOutput,
    ProbeParseError,
    Sample,
    register,
)
from probes.npu.chip_reasons import (
    ECC,
    ECC_REASONS,
    NPU_ECC_DOUBLE_BIT,
    NPU_ECC_ISOLATED_PAGES,
    NPU_ECC_PENDING_PAGES,
    NPU_ECC_SINGLE_BIT_RATE,
    NPU_HEALTH_UNREAD,
)
from probes.npu.chipmap import ChipMap, ChipRef
from probes.npu.config import NpuConfig
from probes.npu.details import parse_key_values
from probes.npu.grade import chip_detail
from probes.npu.npu import davinci_numbers


@dataclass(frozen=True)
class HbmEcc:
    single_bit: int
    double_bit: int
    single_isolated: int
    double_isolated: int
    pending: int  # Single + Double Bit Next-Isolated Pages (950); 0 where not printed


def parse_ecc(text: str) -> HbmEcc:
    """The HBM lines of `-t ecc` (DDR lines, on 910A, are not HBM and are left out)."""
    values: dict[str, int] = {}
    for key, value in parse_key_values(text):
        normal = re.sub(r"\s+", " ", key.lower())
        if normal.startswith("hbm ") and value.strip().isdigit():
            values[normal] = int(value)
    if "hbm double bit error count" not in values or "hbm single bit error count" not in values:
        raise ProbeParseError("no `HBM Single/Double Bit Error Count` lines")
    return HbmEcc(
        values["hbm single bit error count"],
        values["hbm double bit error count"],
        values.get("hbm single bit isolated pages count", 0),
        values.get("hbm double bit isolated pages count", 0),
        values.get("hbm single bit next-isolated pages count", 0)
        + values.get("hbm double bit next-isolated pages count", 0),
    )


@register
class EccProbe(Probe):
    name = "npu.ecc"
    checks = (ECC.name,)
    reasons = (*ECC_REASONS, NPU_HEALTH_UNREAD)
    default_interval = 60.0
    default_timeout = 30.0
    needs = "npu-smi and /dev/davinciN"

    def __init__(self) -> None:
        self._chipmap = ChipMap()
        self._last: dict[int, tuple[float, int]] = {}  # physical id → (monotonic time, single-bit count)

    def applicable(self, ctx: ProbeContext) -> str | None:
        return None if davinci_numbers(ctx.host.dev) else "no NPUs on this host (no /dev/davinciN)"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(NpuConfig)
        davinci = davinci_numbers(ctx.host.dev)
        if not davinci:
            return [ECC.report(NOT_APPLICABLE, "", "no NPUs on this host")]
        chips, _note = self._chipmap.chips(ctx, davinci)
        out: ProbeOutput = []
        now = time.monotonic()
        for chip, text, error in chip_detail(ctx, settings, chips, "ecc"):
            out.extend(self.judge(chip, text, error, settings, now))
        return out

    def judge(
        self, chip: ChipRef, text: str | None, error: str, settings: NpuConfig, now: float
    ) -> list[Finding | Sample]:
        observed: dict[str, Any] = chip.identity()
        who = f"npu{chip.logical_id} (card {chip.card_id} chip {chip.chip_index}) HBM"
        if text is None:
            return [ECC.report(NPU_HEALTH_UNREAD, chip.subject, f"{who}: {error}", observed, device=chip.logical_id)]
        try:
            ecc = parse_ecc(text)
        except ProbeParseError as exc:
            message = f"{who}: npu-smi info -t ecc not understood: {exc}"
            return [
                ECC.report(
                    PARSE_ERROR, chip.subject, message, {**observed, "output": text[:300]}, device=chip.logical_id
                )
            ]
        rate = self._rate(chip.physical_id, ecc.single_bit, now)
        isolated = ecc.single_isolated + ecc.double_isolated
        observed.update(
            {
                "single_bit": ecc.single_bit,
                "double_bit": ecc.double_bit,
                "isolated_pages": isolated,
                "pending_pages": ecc.pending,
                "single_bit_per_hour": rate,
            }
        )
        out: list[Finding | Sample] = _samples(chip, ecc)
        device, subject = chip.logical_id, chip.subject
        if ecc.double_bit > 0:
            message = f"{who}: {ecc.double_bit} double-bit ECC errors"
            out.append(ECC.report(NPU_ECC_DOUBLE_BIT, subject, message, observed, device=device))
        elif ecc.pending > 0:
            message = f"{who}: {ecc.pending} pages pending isolation"
            out.append(ECC.report(NPU_ECC_PENDING_PAGES, subject, message, observed, device=device))
        elif isolated >= settings.ecc_isolated_pages_warn > 0:
            message = (
                f"{who}: {isolated} pages isolated (npu.ecc_isolated_pages_warn {settings.ecc_isolated_pages_warn})"
            )
            out.append(ECC.report(NPU_ECC_ISOLATED_PAGES, subject, message, observed, device=device))
        elif rate is not None and rate > settings.ecc_single_bit_per_hour_max:
            limit = settings.ecc_single_bit_per_hour_max
            message = f"{who}: single-bit errors at {rate:.0f}/h (npu.ecc_single_bit_per_hour_max {limit:g})"
            out.append(ECC.report(NPU_ECC_SINGLE_BIT_RATE, subject, message, observed, device=device))
        else:
            message = f"{who}: {ecc.single_bit} single-bit, 0 double-bit errors, {isolated} pages isolated"
            out.append(ECC.ok(subject, message, observed, device=device))
        return out

    def _rate(self, physical: int, count: int, now: float) -> float | None:
        last = self._last.get(physical)
        self._last[physical] = (now, count)
        if last is None or count < last[1] or now - last[0] <= 0:
            return None
        return (count - last[1]) * 3600.0 / (now - last[0])


def _samples(chip: ChipRef, ecc: HbmEcc) -> list[Finding | Sample]:
    labels = chip.labels()
    series = (
        (
            "nodehealth_npu_hbm_ecc_single_bit_errors",
            "HBM single-bit ECC errors (npu-exporter's npu_chip_info_hbm_ecc_single_bit_error_cnt).",
            ecc.single_bit,
        ),
        (
            "nodehealth_npu_hbm_ecc_double_bit_errors",
            "HBM double-bit ECC errors (npu-exporter's npu_chip_info_hbm_ecc_double_bit_error_cnt).",
            ecc.double_bit,
        ),
        (
            "nodehealth_npu_hbm_ecc_isolated_pages",
            "HBM pages isolated, single- plus double-bit.",
            ecc.single_isolated + ecc.double_isolated,
        ),
        ("nodehealth_npu_hbm_ecc_pending_pages", "HBM pages pending isolation (Next-Isolated Pages).", ecc.pending),
    )
    return [Sample(name, help_text, value, labels) for name, help_text, value in series]
