"""The checks of the gpu probe and every reason it can give, with its status, meaning and fix."""

from __future__ import annotations

from probes.base import Check, Reason, Status
from probes.ledger import POD_RESOURCES_UNAVAILABLE

HEALTH = Check("gpu.health")
THROTTLE = Check("gpu.throttle")
MEMORY = Check("gpu.memory")
HOLDERS = Check("gpu.holders")
LEDGER = Check("gpu.ledger")
CHECKS = (HEALTH, THROTTLE, MEMORY, HOLDERS, LEDGER)

GPU_ECC_UNCORRECTABLE = Reason(
    "GpuEccUncorrectable",
    Status.FAIL,
    "uncorrectable ECC errors since the driver loaded (fail), a lifetime count above "
    "gpu.ecc_aggregate_uncorrectable_max or the SRAM threshold exceeded (fail), a lifetime count 1..max (warn)",
    "drain, reset the GPU (`nvidia-smi -r -i N`) or reboot; RMA if they recur",
    also=(Status.WARN,),
)
GPU_RETIREMENT_PENDING = Reason(
    "GpuRetirementPending",
    Status.FAIL,
    "a page retirement or row remap waits for a GPU reset (XID 63); the status is gpu.retirement_pending_status",
    "when the GPU is idle, reset it (`nvidia-smi -r -i N`) or reboot the node",
    also=(Status.WARN,),
)
GPU_ROW_REMAP_FAILED = Reason(
    "GpuRowRemapFailed",
    Status.FAIL,
    "row remapping failed: no spare rows left (XID 64)",
    "the GPU needs replacement (RMA): drain it and open a case with the vendor",
)
GPU_RECOVERY_REQUIRED = Reason(
    "GpuRecoveryRequired",
    Status.FAIL,
    "the driver's recovery action is not None (Reset, Reboot, Drain P2P, Drain and Reset, Bus Reset, ...)",
    "the action it names (the finding's hint says how)",
)
GPU_MISSING = Reason(
    "GpuMissing",
    Status.FAIL,
    "a GPU expected but not usable: NVML/nvidia-smi cannot open it, the GPU is lost (fallen off the bus), fewer "
    "GPUs than gpu.expected_gpus or /dev/nvidiaN nodes, or the driver unreachable while GPUs are expected",
    "check dmesg (XID 79, NVRM), drain and reboot; reseat or replace the GPU if it recurs",
)
GPU_INFOROM_CORRUPTED = Reason(
    "GpuInfoRomCorrupted",
    Status.WARN,
    "the infoROM is corrupted (NVML CORRUPTED_INFOROM, the nvidia-smi warning): ECC and retirement records may "
    "not persist",
    "reflash the infoROM with NVIDIA support, or replace the GPU",
)
GPU_THROTTLED = Reason(
    "GpuThrottled",
    Status.FAIL,
    "HW slowdown, HW thermal slowdown or HW power brake (fail); SW thermal slowdown (gpu.sw_thermal_status, warn "
    "by default). Idle, application clocks, SW power cap, sync boost and display clocks are no problem",
    "check cooling and power (`nvidia-smi -q -d TEMPERATURE,POWER,PERFORMANCE`)",
    also=(Status.WARN,),
)
GPU_MEMORY_LOW = Reason(
    "GpuMemoryLow",
    Status.FAIL,
    "free framebuffer below gpu.min_free_mib",
    "another process holds GPU memory: list them (`nvidia-smi -q -d PIDS -i N`) and stop leftovers of earlier jobs",
)
GPU_MEMORY_LEAKED = Reason(
    "GpuMemoryLeaked",
    Status.FAIL,
    "more than gpu.memory_leak_min_mib of framebuffer in use with no process (neither NVML nor the fd scan sees one)",
    "memory was not released (a killed job's context): reset the GPU (`nvidia-smi -r -i N`) or reboot the node",
)
GPU_HELD_OUT_OF_BAND = Reason(
    "GpuHeldOutOfBand",
    Status.FAIL,
    "a process outside any pod (and not in gpu.allowed_holders) holds /dev/nvidiaN or is in NVML's process list",
    "stop it (the hint names the command and PIDs), or run it as a pod",
)
GPU_SHARED_BY_PODS = Reason(
    "GpuSharedByPods",
    Status.FAIL,
    "processes of two or more pods hold the same GPU (MPS server processes count as one holder), and "
    "gpu.shared_ok does not allow it for that GPU",
    "delete one of the pods (the hint names them); if the GPU is shared on purpose (time-slicing, MPS), set "
    "gpu.shared_ok: true or list the GPU's index",
)
GPU_QUERY_FAILED = Reason(
    "GpuQueryFailed",
    Status.UNKNOWN,
    "an NVML query (or nvidia-smi) failed with an error other than not-supported",
    "check the driver (dmesg | grep -i nvrm; nvidia-smi -q -i N)",
)
GPU_HOLDER_SCAN_FAILED = Reason(
    "GpuHolderScanFailed",
    Status.UNKNOWN,
    "the /proc/*/fd scan failed, or some processes could not be read (named in the message); holders outside "
    "pods it did find are still reported",
    "look for processes in D state (ps -eo pid,stat,cmd) and hung mounts (storage.mounts)",
)
GPU_DRIVER_UNAVAILABLE = Reason(
    "GpuDriverUnavailable",
    Status.UNKNOWN,
    "NVML and nvidia-smi were found but could not read the GPUs",
    "the NVIDIA driver is not loaded or does not match its library: check `lsmod | grep nvidia`, dmesg (NVRM), "
    "and that the driver and libnvidia-ml versions agree; reboot after a driver upgrade",
)
GPU_TOOL_MISSING = Reason(
    "GpuToolMissing",
    Status.UNKNOWN,
    "NVIDIA device nodes (or gpu.expected_gpus) but neither libnvidia-ml.so.1 nor nvidia-smi, on the loader "
    "path, on PATH or under the driver root (gpu.driver_root)",
    "point gpu.nvml_library, gpu.smi_command or gpu.driver_root at the driver (GPU Operator: /run/nvidia/driver, "
    "mounted from the host); the node is not ready meanwhile (the finding is required; "
    "gpu.unreadable_blocks_ready: false lets a node whose GPUs cannot be read be ready)",
)
GPU_HELD_OUTSIDE_ALLOCATION = Reason(
    "GpuHeldOutsideAllocation",
    Status.FAIL,
    "a pod holds the GPU although the device plugin's ledger (the kubelet's PodResources API) allocated it to no "
    "pod, or to another pod (both are named); time-slicing and MPS replicas (GPU-<uuid>::N) and MIG are followed",
    "delete the pod that holds the GPU without an allocation (a privileged debug pod, a job a second scheduler "
    "placed without the device plugin): the next job the plugin gives the GPU to finds it busy",
)
GPU_DEVICE_PLUGIN_UNHEALTHY = Reason(
    "DevicePluginUnhealthy",
    Status.WARN,
    "the device plugin no longer offers the GPU (absent from the kubelet's GetAllocatableResources: it marked it "
    "unhealthy), shown beside the agent's own verdict on the GPU; the status is gpu.device_plugin_unhealthy_status",
    "the plugin keeps jobs off the GPU already: if the agent finds the GPU healthy, read the device plugin's log "
    "(an XID it counts as fatal, a restart); if both find it unhealthy, drain the node and reset the GPU",
    also=(Status.FAIL,),
)

REASONS = (
    GPU_ECC_UNCORRECTABLE,
    GPU_RETIREMENT_PENDING,
    GPU_ROW_REMAP_FAILED,
    GPU_RECOVERY_REQUIRED,
    GPU_MISSING,
    GPU_INFOROM_CORRUPTED,
    GPU_THROTTLED,
    GPU_MEMORY_LOW,
    GPU_MEMORY_LEAKED,
    GPU_HELD_OUT_OF_BAND,
    GPU_SHARED_BY_PODS,
    GPU_QUERY_FAILED,
    GPU_HOLDER_SCAN_FAILED,
    GPU_DRIVER_UNAVAILABLE,
    GPU_TOOL_MISSING,
    GPU_HELD_OUTSIDE_ALLOCATION,
    GPU_DEVICE_PLUGIN_UNHEALTHY,
    POD_RESOURCES_UNAVAILABLE,
)
