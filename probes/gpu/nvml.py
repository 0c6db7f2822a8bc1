"""The NVML (nvidia-ml-py) reader: every GPU in one pass, into the model of probes.gpu.model.

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
from typing import Any, TypeVar

from probes.gpu.model import EnumerationFailure, GpuInventory, GpuProcess, GpuState

# NVML return codes (nvml.h nvmlReturn_t) this module interprets.
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25

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
    return nvml_pass(library, _read_devices)


def nvml_pass(library: str, read: Callable[[Any], T]) -> T:
    """init, `read(pynvml)`, shutdown, one pass at a time (the gpu probe's and gpu.links' share the library).
    Raises NvmlUnavailable when NVML cannot be loaded or initialised."""
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
            return read(pynvml)
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

    _read_identity(nvml, handle, gpu, query)
    _read_errors(nvml, gpu, query)
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


def _read_identity(nvml: Any, handle: Any, gpu: GpuState, query: Callable[..., Any]) -> None:
    gpu.name = _text(query("name", nvml.nvmlDeviceGetName) or "")
    gpu.uuid = _text(query("uuid", nvml.nvmlDeviceGetUUID) or "")
    gpu.minor = query("minor_number", nvml.nvmlDeviceGetMinorNumber)
    pci = query("pci_info", nvml.nvmlDeviceGetPciInfo)
    if pci is not None:
        gpu.bus_id = _text(pci.busId)
    mode = query("mig_mode", nvml.nvmlDeviceGetMigMode)
    if mode is not None and mode[0] == nvml.NVML_DEVICE_MIG_ENABLE:
        gpu.mig_enabled = True
        gpu.mig_uuids = _mig_uuids(nvml, handle, gpu, query)


def _mig_uuids(nvml: Any, handle: Any, gpu: GpuState, query: Callable[..., Any]) -> list[str]:
    """UUIDs of the MIG devices of a GPU in MIG mode (NOT_FOUND marks an empty slot)."""
    uuids: list[str] = []
    for slot in range(query("mig_devices", nvml.nvmlDeviceGetMaxMigDeviceCount) or 0):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            uuids.append(_text(nvml.nvmlDeviceGetUUID(mig)))
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) != NVML_ERROR_NOT_FOUND:
                gpu.errors["mig_devices"] = str(exc)
    return uuids


def _read_errors(nvml: Any, gpu: GpuState, query: Callable[..., Any]) -> None:
    """ECC counters, page retirement, row remapping and the driver's recovery action."""
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
