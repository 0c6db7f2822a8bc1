"""gpu.links' NVML backend: each GPU's NVLink states and error counters and its NVSwitch fabric state, in one pass.

Per GPU (nvml.h, the entry points nvidia-ml-py wraps):
- `nvmlDeviceGetNvLinkState(device, link)` for link 0..NVML_NVLINK_MAX_LINKS-1: NVML_FEATURE_ENABLED is an active
  link, DISABLED an inactive one; NOT_SUPPORTED or INVALID_ARGUMENT (nvml.h: "the device doesn't support this
  feature", "link is invalid") is a link the GPU does not have, so a GPU without NVLink has none;
- `nvmlDeviceGetNvLinkErrorCounter(device, link, counter)` for each link it has: DL_REPLAY, DL_RECOVERY and
  DL_CRC_FLIT, under the names nvidia-smi nvlink -e gives them (replay_errors, recovery_errors, crc_errors), so
  the counter window goes on across a change of backend; a counter NOT_SUPPORTED (newer GPUs report these as
  field values) is left out;
- `nvmlDeviceGetGpuFabricInfoV` with an nvmlGpuFabricInfo_v3_t, else _v2_t (an older driver answers
  ARGUMENT_VERSION_MISMATCH), else the older `nvmlDeviceGetGpuFabricInfo` (nvmlGpuFabricInfo_t) where the driver
  lacks the versioned call: the state (NVML_GPU_FABRIC_STATE_*) and, once Completed, the status (an
  nvmlReturn_t). NOT_SUPPORTED (before Hopper, no NVSwitch) is the fabric state N/A, as nvidia-smi prints it.
Any other error on a GPU (GPU_IS_LOST, UNKNOWN, ...) makes that GPU's links or fabric unreadable, with the error
as the reason; the other GPUs are still read. The structs are declared here from nvml.h's layouts, not taken
from nvidia-ml-py, whose declarations vary with its version.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

from probes.gpu.links_smi import FabricState, GpuLinks
from probes.gpu.nvml import (
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NvmlUnavailable,
    nvml_pass,
)

NVML_FEATURE_ENABLED = 1  # nvml.h nvmlEnableState_t
NVLINK_MAX_LINKS = 36  # nvml.h NVML_NVLINK_MAX_LINKS (18 before Blackwell; a link past the GPU's is skipped)
# nvml.h nvmlNvLinkErrorCounter_t, named as `nvidia-smi nvlink -e` prints them
NVLINK_COUNTERS = {0: "replay_errors", 1: "recovery_errors", 2: "crc_errors"}
NO_SUCH_LINK = (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT)
# nvml.h NVML_GPU_FABRIC_STATE_*, as nvidia-smi -q prints the Fabric State
FABRIC_STATES = {0: "N/A", 1: "Not Started", 2: "In Progress", 3: "Completed"}
FABRIC_COMPLETED = 3
FABRIC_UUID_LEN = 16


class FabricInfo(ctypes.Structure):
    """nvml.h nvmlGpuFabricInfo_t (nvmlGpuFabricState_t is an unsigned char)."""

    _fields_ = (
        ("clusterUuid", ctypes.c_ubyte * FABRIC_UUID_LEN),
        ("status", ctypes.c_int),
        ("cliqueId", ctypes.c_uint),
        ("state", ctypes.c_ubyte),
    )


class FabricInfoV2(ctypes.Structure):
    """nvml.h nvmlGpuFabricInfo_v2_t: a version first, a healthMask last."""

    _fields_ = (
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_ubyte * FABRIC_UUID_LEN),
        ("status", ctypes.c_int),
        ("cliqueId", ctypes.c_uint),
        ("state", ctypes.c_ubyte),
        ("healthMask", ctypes.c_uint),
    )


class FabricInfoV3(ctypes.Structure):
    """nvml.h nvmlGpuFabricInfo_v3_t (nvmlGpuFabricInfoV_t): v2 and a healthSummary."""

    _fields_ = (*FabricInfoV2._fields_, ("healthSummary", ctypes.c_ubyte))


def struct_version(struct: type[ctypes.Structure], version: int) -> int:
    """nvml.h NVML_STRUCT_VERSION: the struct's size, the version in the top byte."""
    return ctypes.sizeof(struct) | (version << 24)


@dataclass
class NvmlLinks:
    """What one NVML pass read: each GPU's identity and fabric state (by index) and its NVLinks."""

    fabric: list[FabricState] = field(default_factory=list)
    links: dict[int, GpuLinks] = field(default_factory=dict)


def read_links_nvml(library: str = "") -> NvmlLinks:
    """Raises NvmlUnavailable when NVML cannot be loaded, initialised or count its GPUs."""
    return nvml_pass(library, _read_all)


def _read_all(nvml: Any) -> NvmlLinks:
    try:
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML device count failed: {exc}") from None
    out = NvmlLinks()
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as exc:
            why = f"nvmlDeviceGetHandleByIndex: {_error(exc)}"
            out.fabric.append(FabricState("", "", None, "", "", error=why))
            out.links[index] = GpuLinks(index, error=why)
            continue
        gpu = GpuLinks(index, _identity(nvml, nvml.nvmlDeviceGetName, handle), "")
        gpu.uuid = _identity(nvml, nvml.nvmlDeviceGetUUID, handle)
        lost = _read_links(nvml, handle, gpu) == NVML_ERROR_GPU_IS_LOST
        out.fabric.append(_read_fabric(nvml, handle, gpu, lost))
        out.links[index] = gpu
    return out


def _identity(nvml: Any, call: Any, handle: Any) -> str:
    try:
        value = call(handle)
    except nvml.NVMLError:
        return ""  # the finding names the GPU by index; gpu.health reports the identity's own errors
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _error(exc: Exception) -> str:
    code = getattr(exc, "value", None)
    return f"{exc} (NVML error {code})" if code is not None else str(exc)


def _read_links(nvml: Any, handle: Any, gpu: GpuLinks) -> int | None:
    """Fill gpu's states and counters; on an error other than a missing link or counter, set gpu.error and
    return the NVML code."""
    for link in range(NVLINK_MAX_LINKS):
        try:
            gpu.states[link] = nvml.nvmlDeviceGetNvLinkState(handle, link) == NVML_FEATURE_ENABLED
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) in NO_SUCH_LINK:
                continue
            gpu.error = f"nvmlDeviceGetNvLinkState(link {link}): {_error(exc)}"
            return getattr(exc, "value", None)
        for counter, name in NVLINK_COUNTERS.items():
            try:
                value = nvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) == NVML_ERROR_NOT_SUPPORTED:
                    continue
                gpu.error = f"nvmlDeviceGetNvLinkErrorCounter(link {link}, {name}): {_error(exc)}"
                return getattr(exc, "value", None)
            gpu.counters.setdefault(link, {})[name] = int(value)
    return None


def _read_fabric(nvml: Any, handle: Any, gpu: GpuLinks, lost: bool) -> FabricState:
    bus_id = _identity(nvml, lambda h: nvml.nvmlDeviceGetPciInfo(h).busId, handle)
    minor_text = _identity(nvml, nvml.nvmlDeviceGetMinorNumber, handle)
    minor = int(minor_text) if minor_text.isdigit() else None
    if lost:  # every further call would fail the same way
        return FabricState(bus_id, gpu.uuid, minor, "", "", error=gpu.error)
    try:
        info = _fabric_info(nvml, handle)
    except nvml.NVMLError as exc:
        code = getattr(exc, "value", None)
        if code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):
            return FabricState(bus_id, gpu.uuid, minor, "N/A", "N/A")
        return FabricState(bus_id, gpu.uuid, minor, "", "", error=f"GPU fabric info: {_error(exc)}")
    state = FABRIC_STATES.get(int(info.state), f"Unknown ({int(info.state)})")
    if int(info.state) != FABRIC_COMPLETED:
        status = "N/A"  # nvml.h: the status "must be checked only if state returns complete"
    elif info.status == 0:
        status = "Success"
    else:
        status = f"{_text(nvml.nvmlErrorString(info.status))} (NVML error {info.status})"
    mask = int(info.healthMask) if hasattr(info, "healthMask") else None
    return FabricState(bus_id, gpu.uuid, minor, state, status, health_mask=mask)


def _fabric_info(nvml: Any, handle: Any) -> ctypes.Structure:
    """v3, else v2 (ARGUMENT_VERSION_MISMATCH), else the unversioned call (FUNCTION_NOT_FOUND, or a
    nvidia-ml-py without the versioned wrapper)."""
    versioned = getattr(nvml, "nvmlDeviceGetGpuFabricInfoV", None)
    if versioned is not None:
        for struct, version in ((FabricInfoV3, 3), (FabricInfoV2, 2)):
            info = struct()
            info.version = struct_version(struct, version)
            try:
                versioned(handle, ctypes.byref(info))
                return info
            except nvml.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code == NVML_ERROR_ARGUMENT_VERSION_MISMATCH:
                    continue
                if code != NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
                break
    call = getattr(nvml, "nvmlDeviceGetGpuFabricInfo", None)
    if call is None:  # a nvidia-ml-py older than the fabric API: as a driver without it
        raise nvml.NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
    legacy = FabricInfo()
    call(handle, ctypes.byref(legacy))
    return legacy


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
