"""The state of the node's GPUs as either backend (NVML, nvidia-smi) reports it: one model the checks judge."""

from __future__ import annotations

from dataclasses import dataclass, field

# Clock event (throttle) reason bits (nvml.h nvmlClocksEventReason*), names as nvidia-smi -q prints them.
CLOCK_EVENT_BITS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}

MIB = 1024 * 1024


@dataclass
class GpuProcess:
    pid: int
    used_bytes: int | None = None
    kind: str = "compute"  # compute or graphics


@dataclass
class GpuState:
    """What one backend could learn about one GPU. None: not reported (unsupported, N/A, or failed)."""

    index: int
    uuid: str = ""
    name: str = ""
    bus_id: str = ""
    minor: int | None = None
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    # nvidia-smi -q on newer drivers: "SRAM Threshold Exceeded : Yes" (the RMA threshold for SRAM errors).
    sram_threshold_exceeded: bool | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    recovery_action: str | None = None  # a RECOVERY_ACTIONS value
    clock_event_reasons: int | None = None  # bitmask of CLOCK_EVENT_BITS
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    inforom_corrupted: bool | None = None
    processes: list[GpuProcess] | None = None  # None: the process list could not be read
    lost: bool = False  # NVML: GPU is lost (fell off the bus)
    mig_enabled: bool = False  # MIG mode is on: its MIG devices are what jobs get
    mig_uuids: list[str] = field(default_factory=list)  # UUIDs of its MIG devices
    unsupported: list[str] = field(default_factory=list)  # queries the device does not support
    errors: dict[str, str] = field(default_factory=dict)  # query → error, for failures other than unsupported

    @property
    def subject(self) -> str:
        return f"gpu{self.index}"

    @property
    def device_ids(self) -> list[str]:
        """The names a job may know this GPU by (the device plugin's uuid strategy): its UUID, its MIG devices'."""
        return [uuid for uuid in (self.uuid, *self.mig_uuids) if uuid]


@dataclass(frozen=True)
class EnumerationFailure:
    """A GPU the backend knows of but cannot open (NVML handle error, nvidia-smi "Unable to determine...")."""

    index: int | None
    bus_id: str
    error: str


@dataclass
class GpuInventory:
    source: str  # "nvml" or "nvidia-smi"
    driver_version: str = ""
    gpus: list[GpuState] = field(default_factory=list)
    failures: list[EnumerationFailure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
