"""The chips the per-chip npu probes (npu.roce, npu.grade, npu.ecc) read, and the identity their findings carry.

`npu-smi info -m` maps each card/chip to its logical and physical id (cached while the /dev/davinciN set is the
same); without it (npu-smi missing or failing) each /dev/davinciN is one chip: card N, chip 0, logical = physical
= N, as on the host's full view of single-chip cards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from probes.base import OBSERVED_DEVICE_MINOR, OBSERVED_PCI_BUS_ID, OBSERVED_PHYSICAL_ID, ProbeContext, ProbeParseError
from probes.npu.config import NpuConfig
from probes.npu.details import parse_mapping
from probes.npu.smi import run_smi


@dataclass(frozen=True)
class ChipRef:
    logical_id: int
    physical_id: int  # hccn_tool -i N, /dev/davinciN, MindCluster's physicId
    card_id: int
    chip_index: int
    name: str = ""
    bus_id: str = ""

    @property
    def subject(self) -> str:
        return f"npu{self.logical_id}"

    def identity(self) -> dict[str, Any]:
        """What agent/kube/devices matches the chip by (the same keys npu.health findings carry)."""
        out: dict[str, Any] = {
            "card": self.card_id,
            "chip": self.chip_index,
            "logical_id": self.logical_id,
            OBSERVED_PHYSICAL_ID: self.physical_id,
            OBSERVED_DEVICE_MINOR: self.physical_id,
        }
        if self.bus_id:
            out[OBSERVED_PCI_BUS_ID] = self.bus_id
        return out

    def labels(self) -> dict[str, str]:
        """npu-exporter's label names: `id`, `model_name`, `pcie_bus_info`; ours: `chip` (logical id)."""
        return {
            "chip": str(self.logical_id),
            "id": str(self.physical_id),
            "model_name": self.name,
            "pcie_bus_info": self.bus_id,
        }


class ChipMap:
    """One per probe instance: the mapping is read once per /dev/davinciN set, not every run."""

    def __init__(self) -> None:
        self._cache: tuple[tuple[int, ...], tuple[ChipRef, ...], str] | None = None

    def chips(self, ctx: ProbeContext, davinci: list[int]) -> tuple[tuple[ChipRef, ...], str]:
        """(the chips, why `npu-smi info -m` was not used or "")."""
        key = tuple(davinci)
        if self._cache is not None and self._cache[0] == key:
            chips, note = self._cache[1], self._cache[2]
        else:
            chips, note = self._read(ctx, ctx.settings(NpuConfig), davinci)
        if not note:
            self._cache = (key, chips, note)
        bus = _bus_ids(ctx)
        chips = tuple(
            ChipRef(c.logical_id, c.physical_id, c.card_id, c.chip_index, c.name, bus.get(c.logical_id, ""))
            for c in chips
        )
        return chips, note

    @staticmethod
    def _read(ctx: ProbeContext, settings: NpuConfig, davinci: list[int]) -> tuple[tuple[ChipRef, ...], str]:
        fallback = tuple(ChipRef(n, n, n, 0) for n in davinci)
        text, failure = run_smi(ctx, settings, ["info", "-m"])
        if failure is not None:
            return fallback, f"npu-smi info -m: {failure.message}; chips taken from /dev/davinciN"
        try:
            rows = parse_mapping(text or "")
        except ProbeParseError as exc:
            return fallback, f"npu-smi info -m not understood ({exc}); chips taken from /dev/davinciN"
        out = []
        for row in rows:
            if row.logical_id is None:
                continue
            physical = row.physical_id if row.physical_id is not None else row.logical_id
            out.append(ChipRef(row.logical_id, physical, row.card_id, row.chip_index, row.name))
        return tuple(sorted(out, key=lambda c: c.logical_id)), ""


def _bus_ids(ctx: ProbeContext) -> dict[int, str]:
    """Bus-Ids the npu probe published to the host's device inventory (logical id → Bus-Id), when it has run."""
    return {device.index: device.bus_id for device in ctx.host.devices.all() if device.kind == "npu"}
