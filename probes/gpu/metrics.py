"""The gpu probe's metric samples: per GPU, labelled gpu (index), UUID, name, pci_bus_id and the pod.

`UUID` and `pci_bus_id` are dcgm-exporter's names and forms for the same things, so its series join without
label_replace; `pod`, `namespace` and `container` name the container the device plugin's ledger allocated the GPU
to, as dcgm-exporter labels them (empty when the GPU is free, shared by several pods, or the ledger was not read).

A value a GPU does not report (unsupported, N/A) produces no sample rather than a zero.
"""

from __future__ import annotations

from typing import Literal

from probes.base import Sample
from probes.gpu.model import CLOCK_EVENT_BITS, GpuState
from probes.runtime.podresources.ledger import (
    ALLOCATED_HELP,
    ALLOCATED_METRIC,
    Allocation,
    allocated_labels,
    pod_labels,
)

_ECC_HELP = "ECC errors (volatile: since the driver loaded; aggregate: over the GPU's life)."


class _Samples:
    def __init__(self, gpu: GpuState, allocations: list[Allocation]) -> None:
        # pci_bus_id and UUID as NVML gives them: the series join with dcgm-exporter's by bus id or UUID.
        device = {"gpu": str(gpu.index), "UUID": gpu.uuid, "name": gpu.name, "pci_bus_id": gpu.bus_id}
        self.labels = {**device, **pod_labels(allocations)}
        self.out: list[Sample] = []

    def add(
        self,
        name: str,
        help_text: str,
        value: float | int | bool | None,
        kind: Literal["gauge", "counter"] = "gauge",
        **extra: str,
    ) -> None:
        if value is not None:
            self.out.append(Sample(name, help_text, float(value), {**self.labels, **extra}, kind))


def gpu_samples(gpu: GpuState, out_of_band: int | None, allocations: list[Allocation] | None = None) -> list[Sample]:
    """`allocations`: the ledger's for this GPU, None when it was not read (no nodehealth_device_allocated)."""
    samples = _Samples(gpu, allocations or [])
    if allocations is not None:
        count, resource = allocated_labels(allocations)
        samples.out.append(Sample(ALLOCATED_METRIC, ALLOCATED_HELP, count, {**samples.labels, **resource}))
    _error_samples(gpu, samples)
    add = samples.add
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
    return samples.out


def _error_samples(gpu: GpuState, samples: _Samples) -> None:
    add = samples.add
    for kind, counter, value in (
        ("corrected", "volatile", gpu.ecc_corrected_volatile),
        ("uncorrected", "volatile", gpu.ecc_uncorrected_volatile),
        ("corrected", "aggregate", gpu.ecc_corrected_aggregate),
        ("uncorrected", "aggregate", gpu.ecc_uncorrected_aggregate),
    ):
        add("nodehealth_gpu_ecc_errors_total", _ECC_HELP, value, "counter", type=kind, counter=counter)
    pages = "Retired framebuffer pages."
    add("nodehealth_gpu_retired_pages_total", pages, gpu.retired_pages_sbe, "counter", cause="sbe")
    add("nodehealth_gpu_retired_pages_total", pages, gpu.retired_pages_dbe, "counter", cause="dbe")
    add(
        "nodehealth_gpu_retired_pages_pending",
        "1 while a page retirement waits for a reset.",
        gpu.retired_pages_pending,
    )
    rows = "Remapped memory rows."
    add("nodehealth_gpu_remapped_rows_total", rows, gpu.remapped_rows_correctable, "counter", type="correctable")
    add("nodehealth_gpu_remapped_rows_total", rows, gpu.remapped_rows_uncorrectable, "counter", type="uncorrectable")
    add("nodehealth_gpu_row_remap_pending", "1 while a row remap waits for a reset.", gpu.remap_pending)
    add("nodehealth_gpu_row_remap_failed", "1 when a row remap failed.", gpu.remap_failed)
