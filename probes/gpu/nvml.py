"""The GPU state model both GPU backends fill, and the NVML (nvidia-ml-py) reader.

`pynvml` is imported only inside `read_nvml`, so an agent on a host without NVIDIA GPUs never loads it.

NVML calls can block for a long time on a wedged GPU (the driver waits on the device). They run in the
probe's thread, bounded by the scheduler's probe timeout: a call that never returns leaves that one probe
run stuck (reported as a timeout, then /healthz wedged), never the agent. All NVML work of a run happens in
one pass (init, read every device, shutdown) so a run costs one trip through the driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

# NVML return codes (nvml.h nvmlReturn_t) this module interprets.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_CORRUPTED_INFOROM = 14

# nvmlDeviceGetFieldValues field id (nvml.h NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) and its values.
FIELD_GPU_RECOVERY_ACTION = 230
RECOVERY_ACTIONS = {
    0: "None",
    1: "Reset",
    2: "Reboot",
    3: "Drain P2P",
    4: "Drain and Reset",
    5: "Recover IMEX Domain",
    6: "Bus Reset",
    7: "System Reboot",
}

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
    unsupported: list[str] = field(default_factory=list)  # queries the device does not support
    errors: dict[str, str] = field(default_factory=dict)  # query → error, for failures other than unsupported

    @property
    def subject(self) -> str:
        return f"gpu{self.index}"


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


class NvmlUnavailable(Exception):
    """NVML could not be loaded or initialised (no library, no driver, version mismatch)."""


# pynvml keeps module-global state (the loaded library, an init refcount); one pass at a time.
_NVML_LOCK = threading.Lock()

T = TypeVar("T")


def library_loadable(library: str) -> bool:
    """Whether the NVML shared library can be dlopen'ed, without importing pynvml."""
    try:
        ctypes.CDLL(library or "libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def read_nvml(library: str = "") -> GpuInventory:
    """One pass over every GPU through NVML. Raises NvmlUnavailable when NVML cannot be initialised.

    `library`: path of libnvidia-ml.so.1 to load; empty: the dynamic loader's search path.
    """
    try:
        import pynvml
    except ImportError as exc:  # nvidia-ml-py is a dependency; an image without it falls back to nvidia-smi
        raise NvmlUnavailable(f"nvidia-ml-py not installed: {exc}") from None
    with _NVML_LOCK:
        if library and pynvml.nvmlLib is None:
            try:
                pynvml.nvmlLib = ctypes.CDLL(library)
            except OSError as exc:
                raise NvmlUnavailable(f"cannot load {library}: {exc}") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML init failed: {exc}") from None
        try:
            return _read_devices(pynvml)
        finally:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()


def _read_devices(nvml: Any) -> GpuInventory:
    inventory = GpuInventory(source="nvml")
    try:
        inventory.driver_version = _text(nvml.nvmlSystemGetDriverVersion())
    except nvml.NVMLError as exc:
        inventory.notes.append(f"driver version: {exc}")
    try:
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML device count failed: {exc}") from None
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as exc:
            inventory.failures.append(EnumerationFailure(index, "", str(exc)))
            continue
        inventory.gpus.append(_read_device(nvml, index, handle))
    return inventory


def _read_device(nvml: Any, index: int, handle: Any) -> GpuState:
    gpu = GpuState(index=index)

    def query(key: str, fn: Callable[..., T], *args: Any) -> T | None:
        if gpu.lost:
            return None
        try:
            return fn(handle, *args)
        except nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == NVML_ERROR_NOT_SUPPORTED:
                gpu.unsupported.append(key)
            elif code == NVML_ERROR_GPU_IS_LOST:
                gpu.lost = True
                gpu.errors[key] = str(exc)
            elif code == NVML_ERROR_CORRUPTED_INFOROM and key == "inforom":
                gpu.inforom_corrupted = True
            else:
                gpu.errors[key] = str(exc)
            return None

    gpu.name = _text(query("name", nvml.nvmlDeviceGetName) or "")
    gpu.uuid = _text(query("uuid", nvml.nvmlDeviceGetUUID) or "")
    gpu.minor = query("minor_number", nvml.nvmlDeviceGetMinorNumber)
    pci = query("pci_info", nvml.nvmlDeviceGetPciInfo)
    if pci is not None:
        gpu.bus_id = _text(pci.busId)

    corrected, uncorrected = nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    volatile, aggregate = nvml.NVML_VOLATILE_ECC, nvml.NVML_AGGREGATE_ECC
    ecc = nvml.nvmlDeviceGetTotalEccErrors
    gpu.ecc_uncorrected_volatile = query("ecc_uncorrected_volatile", ecc, uncorrected, volatile)
    gpu.ecc_uncorrected_aggregate = query("ecc_uncorrected_aggregate", ecc, uncorrected, aggregate)
    gpu.ecc_corrected_volatile = query("ecc_corrected_volatile", ecc, corrected, volatile)
    gpu.ecc_corrected_aggregate = query("ecc_corrected_aggregate", ecc, corrected, aggregate)

    pages = nvml.nvmlDeviceGetRetiredPages
    sbe = query("retired_pages", pages, nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    if sbe is not None:
        gpu.retired_pages_sbe = len(sbe)
        dbe = query("retired_pages", pages, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        gpu.retired_pages_dbe = None if dbe is None else len(dbe)
        pending = query("retired_pages_pending", nvml.nvmlDeviceGetRetiredPagesPendingStatus)
        gpu.retired_pages_pending = None if pending is None else bool(pending)

    rows = query("remapped_rows", nvml.nvmlDeviceGetRemappedRows)
    if rows is not None:
        gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable = int(rows[0]), int(rows[1])
        gpu.remap_pending, gpu.remap_failed = bool(rows[2]), bool(rows[3])

    values = query("recovery_action", nvml.nvmlDeviceGetFieldValues, [FIELD_GPU_RECOVERY_ACTION])
    if values is not None:
        value = values[0]
        if value.nvmlReturn == 0:
            action = int(value.value.uiVal)
            gpu.recovery_action = RECOVERY_ACTIONS.get(action, f"Unknown ({action})")
        elif value.nvmlReturn == NVML_ERROR_NOT_SUPPORTED:
            gpu.unsupported.append("recovery_action")
        else:
            gpu.errors["recovery_action"] = f"NVML field error {value.nvmlReturn}"

    gpu.clock_event_reasons = _clock_event_reasons(nvml, query)

    memory = query("memory_info", nvml.nvmlDeviceGetMemoryInfo)
    if memory is not None:
        gpu.memory_total_bytes, gpu.memory_used_bytes = int(memory.total), int(memory.used)
        gpu.memory_free_bytes = int(memory.free)

    compute = query("compute_processes", nvml.nvmlDeviceGetComputeRunningProcesses)
    graphics = query("graphics_processes", nvml.nvmlDeviceGetGraphicsRunningProcesses)
    if compute is not None or graphics is not None:
        gpu.processes = [GpuProcess(int(p.pid), _used(p), "compute") for p in compute or []]
        gpu.processes += [GpuProcess(int(p.pid), _used(p), "graphics") for p in graphics or []]

    temperature = query("temperature", nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
    gpu.temperature_celsius = None if temperature is None else float(temperature)
    milliwatts = query("power_usage", nvml.nvmlDeviceGetPowerUsage)
    gpu.power_watts = None if milliwatts is None else milliwatts / 1000.0
    if query("inforom", lambda handle: nvml.nvmlDeviceValidateInforom(handle) or True):
        gpu.inforom_corrupted = False
    return gpu


def _clock_event_reasons(nvml: Any, query: Callable[..., Any]) -> int | None:
    def reasons(handle: Any) -> int:
        try:
            return nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
        except nvml.NVMLError_FunctionNotFound:  # drivers before 535 export only the older name
            return nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)

    value = query("clock_event_reasons", reasons)
    return None if value is None else int(value)


def _used(process: Any) -> int | None:
    used = getattr(process, "usedGpuMemory", None)
    return None if used is None else int(used)


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
