"""Device isolation in the Kubernetes tests: the DRA drivers' ResourceSlices as they publish them, and device
findings as the npu and gpu probes report them (index, UUID, Bus-Id, physical id, /dev minor).

- NVIDIA (`gpu.nvidia.com`, k8s-dra-driver-gpu): pool = the node's name, device `gpu-<minor>` (the /dev/nvidiaN
  minor, not the NVML index), attributes `uuid` and `resource.kubernetes.io/pciBusID` (older releases:
  `pcieBusID`), as DeviceAttributes (`{"string": ...}`).
- MindCluster (`npu.huawei.com`): pool = the node's name, device `ascend910-<phyID>` (a DRA device name is a DNS
  label: lowercase), attribute `physicId`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.kube.devices.isolation import Isolation, RuleSpec
from agent.kube.devices.match import NAME_LIMIT, DeviceRef, Published
from agent.state import HealthState
from probes.base import (
    OBSERVED_DEVICE_IDS,
    OBSERVED_DEVICE_MINOR,
    OBSERVED_PCI_BUS_ID,
    OBSERVED_PHYSICAL_ID,
    Finding,
    Status,
)
from support.kube_double import ApiDouble
from support.kube_dra import add_resource_slice

NVIDIA = "gpu.nvidia.com"
ASCEND = "npu.huawei.com"


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML index: what findings and /ready?devices= call it
    minor: int  # /dev/nvidiaN: what the DRA driver names it by
    uuid: str
    bus_id: str  # as NVML prints it (00000000:3B:00.0)


@dataclass(frozen=True)
class Chip:
    logical_id: int
    physical_id: int
    bus_id: str  # as npu-smi prints it (0000:C1:00.0)


# Eight GPUs whose minors are not their indices (GPUs 3 and 5 swapped, as on hosts where the driver enumerated
# them in another order): a rule placed by position would taint the wrong GPU.
GPUS = tuple(
    Gpu(i, {3: 5, 5: 3}.get(i, i), f"GPU-{i:08x}-1111-2222-3333-{i:012x}", f"00000000:{0x18 + i:02X}:00.0")
    for i in range(8)
)
# Eight 910B chips: physical ids 0..7 in another order than their logical ids.
CHIPS = tuple(Chip(i, (i * 3) % 8, f"0000:{0xC1 + i:02X}:00.0") for i in range(8))


def nvidia_devices(gpus: tuple[Gpu, ...] = GPUS, bus_attribute: str = "resource.kubernetes.io/pciBusID") -> list[Any]:
    """What the NVIDIA DRA driver publishes: its bus ids in the kernel's lowercase, 4-digit-domain form."""
    return [
        {
            "name": f"gpu-{gpu.minor}",
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": gpu.uuid},
                "productName": {"string": "NVIDIA A100-SXM4-40GB"},
                bus_attribute: {"string": "0000:" + gpu.bus_id.split(":", 1)[1].lower()},
            },
            "capacity": {"memory": {"value": "40Gi"}},
        }
        for gpu in gpus
    ]


def ascend_devices(chips: tuple[Chip, ...] = CHIPS) -> list[Any]:
    return [
        {"name": f"ascend910-{chip.physical_id}", "attributes": {"physicId": {"int": chip.physical_id}}}
        for chip in chips
    ]


def publish_gpus(double: ApiDouble, node: str, gpus: tuple[Gpu, ...] = GPUS) -> None:
    add_resource_slice(double, f"{node}-gpu.nvidia.com-x7k2p", node, NVIDIA, nvidia_devices(gpus))


def publish_npus(double: ApiDouble, node: str, chips: tuple[Chip, ...] = CHIPS) -> None:
    add_resource_slice(double, f"{node}-npu.huawei.com-q4m8d", node, ASCEND, ascend_devices(chips))


def gpu_finding(gpu: Gpu, check: str = "gpu.holders", status: str = "ok", reason: str = "OK") -> Finding:
    observed = {OBSERVED_DEVICE_IDS: [gpu.uuid], OBSERVED_PCI_BUS_ID: gpu.bus_id, OBSERVED_DEVICE_MINOR: gpu.minor}
    message = f"gpu{gpu.index}: " + ("no holder outside Kubernetes" if status == "ok" else f"{reason} on gpu")
    return Finding(check, f"gpu{gpu.index}", Status(status), reason, message, "", observed, gpu.index)


def npu_finding(chip: Chip, check: str = "npu.holders", status: str = "ok", reason: str = "OK") -> Finding:
    observed = {
        OBSERVED_PHYSICAL_ID: chip.physical_id,
        OBSERVED_DEVICE_MINOR: chip.physical_id,
        OBSERVED_PCI_BUS_ID: chip.bus_id,
    }
    message = f"/dev/davinci{chip.physical_id}: " + ("ok" if status == "ok" else f"{reason}")
    return Finding(check, f"npu{chip.logical_id}", Status(status), reason, message, "", observed, chip.logical_id)


def record_gpus(state: HealthState, bad: dict[int, str] | None = None, check: str = "gpu.holders") -> None:
    """One gpu probe run: every GPU ok but those in `bad` (index → reason, a fail)."""
    bad = bad or {}
    state.record(
        "gpu",
        [gpu_finding(g, check, "fail" if g.index in bad else "ok", bad.get(g.index, "OK")) for g in GPUS],
    )


def record_npus(
    state: HealthState, bad: dict[int, str] | None = None, check: str = "npu.holders", status: str = "fail"
) -> None:
    bad = bad or {}
    state.record(
        "npu",
        [npu_finding(c, check, status if c.logical_id in bad else "ok", bad.get(c.logical_id, "OK")) for c in CHIPS],
    )


def longest_isolation(index: int) -> Isolation:
    """One chip's entry with every field at its longest: a rule per DRA driver, each name at the 253-character
    limit, every fault code, a why far past its clip."""
    rules = tuple(
        RuleSpec("r" * NAME_LIMIT, Published(driver, "n" * 63, f"npu-{index}", "s"), {})
        for driver in ("gpu.nvidia.com", "npu.huawei.com", "ascend.project-hami.io")
    )
    codes = {f"Reason{n}": f"8{n:08d}" for n in range(12)}
    why = "HTTP 500 " + "the order in patch list doesn't match $setElementOrder list " * 500
    return Isolation(DeviceRef("npu", index), "node", "NpuHbmMultiBitEccError", "NoExecute", rules, codes, 7, why)
