"""The npu probe's metric samples: per chip, labelled chip (logical id), card, name, pci_bus_id, id and the pod.

`id` is the chip's physical id, the label npu-exporter gives its chip series (its `id`: the Phy-ID); `pod`,
`namespace` and `container` name the container the device plugin's ledger allocated the chip to, as dcgm-exporter
labels GPU series (empty when the chip is free, shared by several pods, or the ledger was not read).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from probes.base import Sample
from probes.npu.info_table import NpuChip
from probes.runtime.podresources.ledger import (
    ALLOCATED_HELP,
    ALLOCATED_METRIC,
    Allocation,
    allocated_labels,
    pod_labels,
)

MIB = 1024 * 1024

# Metric value of each health word (documented in docs/probes/npu.md, Metrics).
HEALTH_METRIC = {"ok": 0, "warning": 1, "alarm": 2, "critical": 3}
HEALTH_METRIC_OTHER = 4  # UNKNOWN (device absent or not started) and words npu-smi has not printed before


def chip_labels(chip: NpuChip) -> dict[str, str]:
    """`pci_bus_id` as npu-smi prints it (`0000:C1:00.0`), `id` the physical id: npu-exporter's chip key."""
    physical = "" if chip.device_number is None else str(chip.device_number)
    return {
        "chip": str(chip.logical_id),
        "card": str(chip.card_id),
        "name": chip.name,
        "pci_bus_id": chip.bus_id or "",
        "id": physical,
    }


def chip_samples(
    chips: Sequence[NpuChip],
    out_of_band: Mapping[int, int],
    allocated: Mapping[int, list[Allocation]] | None = None,
) -> list[Sample]:
    """`allocated`: the ledger's allocations per device number, None when it was not read."""
    samples: list[Sample] = []
    for chip in chips:
        grants = (allocated or {}).get(chip.device_number, []) if chip.device_number is not None else []
        labels = {**chip_labels(chip), **pod_labels(grants)}
        if allocated is not None:
            count, resource = allocated_labels(grants)
            samples.append(Sample(ALLOCATED_METRIC, ALLOCATED_HELP, count, {**labels, **resource}))

        def add(name: str, help_text: str, value: float | None, labels: dict[str, str] = labels) -> None:
            if value is not None:
                samples.append(Sample(name, help_text, value, labels))

        add(
            "nodehealth_npu_health",
            "npu-smi health per chip: 0 OK, 1 Warning, 2 Alarm, 3 Critical, 4 UNKNOWN or unrecognised.",
            HEALTH_METRIC.get(chip.health.lower(), HEALTH_METRIC_OTHER),
        )
        _memory(chip, add)
        add(
            "nodehealth_npu_aicore_utilization_ratio",
            "AI Core utilisation per chip, 0 to 1 (npu-smi AICore(%), or NPU Util(%) on 950).",
            None if chip.aicore_percent is None else chip.aicore_percent / 100.0,
        )
        add("nodehealth_npu_temperature_celsius", "Chip temperature.", chip.temperature_celsius)
        add("nodehealth_npu_power_watts", "Chip (card) power draw; absent on 310P.", chip.power_watts)
        add(
            "nodehealth_npu_processes",
            "Processes npu-smi lists on the chip.",
            None if chip.processes is None else len(chip.processes),
        )
        if chip.device_number is not None:
            add(
                "nodehealth_npu_out_of_band_holders",
                "Processes outside Kubernetes pods holding the chip's /dev/davinciN.",
                out_of_band.get(chip.device_number, 0),
            )
    return samples


def _memory(chip: NpuChip, add: Callable[[str, str, float | None], None]) -> None:
    if chip.hbm_total_mib:
        add("nodehealth_npu_hbm_total_bytes", "HBM capacity per chip.", chip.hbm_total_mib * MIB)
        if chip.hbm_used_mib is not None:
            add("nodehealth_npu_hbm_used_bytes", "HBM in use per chip.", chip.hbm_used_mib * MIB)
    if chip.memory_total_mib:
        add(
            "nodehealth_npu_memory_total_bytes",
            "Device DDR capacity per chip (310/310P/910A; 910B and later print 0).",
            chip.memory_total_mib * MIB,
        )
        if chip.memory_used_mib is not None:
            add("nodehealth_npu_memory_used_bytes", "Device DDR in use per chip.", chip.memory_used_mib * MIB)
