"""Config of the gpu family (`gpu:`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool

from probes.family import PositiveSeconds, Section


class GpuConfig(Section):
    # GPUs expected on this node; None: one per /dev/nvidiaN node.
    expected_gpus: int | None = Field(None, ge=0)
    # On a node with /dev/nvidiaN nodes (or gpu.expected_gpus), GPUs whose health cannot be read (GpuToolMissing,
    # the driver unreachable) block readiness (the findings say `required`); false: the node may be ready meanwhile.
    unreadable_blocks_ready: bool = True
    # Free framebuffer below this many MiB → GpuMemoryLow; 0 disables.
    min_free_mib: float = Field(0, ge=0)
    # Framebuffer in use with no process on the GPU above this many MiB → GpuMemoryLeaked.
    memory_leak_min_mib: float = Field(1024, ge=0)
    # Path of libnvidia-ml.so.1 to load; empty: the dynamic loader's search path.
    nvml_library: str = ""
    # argv prefix of the fallback used when NVML cannot be loaded; e.g. [nsenter, -t, 1, -m, --, nvidia-smi].
    smi_command: list[str] = ["nvidia-smi"]
    # Where a driver container (the GPU Operator's) keeps the driver, under host.root: when neither the library
    # nor smi_command is found, NVML is loaded from its lib dirs and nvidia-smi run chrooted into it.
    driver_root: str = "/run/nvidia/driver"
    smi_timeout_seconds: PositiveSeconds = 8.0
    # Lifetime (aggregate) uncorrectable ECC errors: 1..this → warn, above → fail. Volatile ones always fail.
    ecc_aggregate_uncorrectable_max: int = Field(4, ge=0)
    # Status of a pending page retirement / row remap (takes effect at the next GPU reset).
    retirement_pending_status: Literal["warn", "fail"] = "fail"
    # SW thermal slowdown: warn by default (the driver lowering clocks near its target temperature).
    sw_thermal_status: Literal["ok", "warn", "fail"] = "warn"
    holder_devices: list[str] = ["nvidia[0-9]*"]
    # Commands (fnmatch on the executable's base name) allowed to hold GPUs outside a pod.
    allowed_holders: list[str] = [
        "nvidia-persistenced",
        "nv-hostengine",
        "nvidia-smi",
        "nvidia-cuda-mps-control",
        "nvidia-cuda-mps-server",
        "nv-fabricmanager",
        "dcgm-exporter",
    ]
    # A GPU held by processes of two or more pods is GpuSharedByPods unless sharing is on purpose (time-slicing,
    # MPS): true for every GPU, or the indices of the GPUs that may be shared.
    shared_ok: StrictBool | list[Annotated[int, Field(ge=0)]] = False
    # MPS servers (fnmatch on the executable's base name) hold a GPU for their clients: one holder together.
    mps_server_commands: list[str] = ["nvidia-cuda-mps-server"]

    # Status of a GPU the device plugin no longer offers (DevicePluginUnhealthy): the plugin keeps jobs off it.
    device_plugin_unhealthy_status: Literal["warn", "fail"] = "warn"

    def sharing_allowed(self, index: int) -> bool:
        return self.shared_ok is True or (isinstance(self.shared_ok, list) and index in self.shared_ok)
