"""The device plugins' ledger as the kubelet tells it: which container of which pod was given which device, and
which devices the plugins still offer. Pure functions over the reader's JSON answer (`reader.py`).

Device ids, as the plugins name them:

- NVIDIA (`nvidia.com/...`): `GPU-<uuid>`, `MIG-<uuid>`, an index (`0`) under the plugin's index strategy, and
  `<id>::N` for replica N of a time-sliced or MPS-shared GPU: several pods on one GPU by design.
- Ascend (`huawei.com/...`): `Ascend910-<phy id>` for a whole chip (its /dev/davinciN, N the physical id) and
  `Ascend910-2c-<vdev id>-<phy id>` for a vNPU cut from a chip (a template such as `Ascend910-2c`): shared by
  design. Under Volcano the kubelet-side ids are not the chips really mounted: those are in the pod annotation
  `huawei.com/AscendReal` (`Ascend910-3,Ascend910-4`), which overrides the ledger's ids for that pod.
- DRA claims (`dynamic_resources`) are kept as `<driver>/<pool>/<device>` under the driver's name.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from probes.runtime.podresources.caps import MAX_ALLOCATABLE_IDS, MAX_ALLOCATED_IDS, MAX_PODS

ASCEND_REAL_ANNOTATION = "huawei.com/AscendReal"
NVIDIA_PREFIX = "nvidia.com/"
ASCEND_PREFIX = "huawei.com/"
# What one answer may hold is bounded in caps.py, by the reader child before it builds anything; `ledger_of` checks
# the counts again (a LedgerError past them), so the agent never keeps more whatever the line holds.
# ASCII only: \d would take any Unicode decimal digit (Arabic-Indic ones, which int() reads) from a kubelet answer.
_REPLICA = re.compile(r"^(?P<base>.+?)::(?P<replica>\d+)$", re.ASCII)
_ASCEND_CHIP = re.compile(r"^Ascend\w*?-(?P<phy>\d+)$", re.ASCII)
_ASCEND_VNPU = re.compile(r"^Ascend\w*?-(?P<cores>\d+c)-(?P<vdev>\d+)-(?P<phy>\d+)$", re.ASCII)


class LedgerError(ValueError):
    """The reader's answer is not a ledger (truncated, not JSON, wrong shapes)."""


@dataclass(frozen=True)
class Allocation:
    """One device id the ledger gave to one container."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str

    @property
    def pod_key(self) -> tuple[str, str]:
        return (self.namespace, self.pod)

    def describe_pod(self) -> str:
        return f"pod {self.namespace}/{self.pod}" + (f" container {self.container}" if self.container else "")

    def to_dict(self) -> dict[str, str]:
        return {
            "namespace": self.namespace,
            "name": self.pod,
            "container": self.container,
            "resource": self.resource,
            "device_id": self.device_id,
        }


@dataclass(frozen=True)
class Ledger:
    """One answer of List and GetAllocatableResources."""

    allocations: tuple[Allocation, ...] = ()
    pods: frozenset[tuple[str, str]] = frozenset()  # every pod the kubelet listed, with or without devices
    allocatable: Mapping[str, frozenset[str]] = field(default_factory=dict)  # resource → ids offered

    @functools.cached_property
    def by_pod(self) -> dict[tuple[str, str], list[Allocation]]:
        """The allocations per pod, made once per ledger (on first use) and gone with it."""
        return by_pod(self.allocations)

    def of_resources(self, prefix: str) -> list[Allocation]:
        return [a for a in self.allocations if a.resource.startswith(prefix)]

    def offered(self, prefix: str) -> dict[str, frozenset[str]]:
        return {resource: ids for resource, ids in self.allocatable.items() if resource.startswith(prefix)}

    def to_dict(self, prefix: str = "", limit: int = 64) -> dict[str, Any]:
        """What findings carry of it (bounded): the allocations and offered ids of one vendor's resources."""
        allocations = self.of_resources(prefix)
        offered = self.offered(prefix)
        out: dict[str, Any] = {
            "pods_listed": len(self.pods),
            "allocations": [a.to_dict() for a in allocations[:limit]],
            "allocatable": {resource: sorted(ids)[:limit] for resource, ids in sorted(offered.items())},
        }
        if len(allocations) > limit:
            out["allocations_not_shown"] = len(allocations) - limit
        return out


def parse_ledger(text: str | bytes) -> Ledger:
    """The reader's JSON document → Ledger; LedgerError when it is anything else."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise LedgerError(f"not JSON: {exc}") from None
    return ledger_of(document)


def ledger_of(document: Any) -> Ledger:
    """The reader's document, parsed from JSON once (client.py), → Ledger; LedgerError when it is anything else or
    holds more than caps.py admits (the child refuses such answers before it sends them: this is the agent's own
    check, never a truncation that would judge a part of the ledger as the whole)."""
    if not isinstance(document, dict) or not isinstance(document.get("pods"), list):
        raise LedgerError("no pods list in the answer")
    if len(document["pods"]) > MAX_PODS:
        raise LedgerError(f"{len(document['pods'])} pods listed (at most {MAX_PODS} are read)")
    allocations: list[Allocation] = []
    pods: set[tuple[str, str]] = set()
    for pod in document["pods"]:
        namespace, name = _text(pod, "namespace"), _text(pod, "name")
        pods.add((namespace, name))
        for container in _items(pod, "containers"):
            for devices in _items(container, "devices"):
                resource = _text(devices, "resource")
                for device_id in _strings(devices.get("ids")):
                    allocations.append(Allocation(namespace, name, _text(container, "name"), resource, device_id))
            for claim in _items(container, "claims"):
                device = "/".join(_text(claim, key) for key in ("driver", "pool", "device"))
                allocations.append(
                    Allocation(namespace, name, _text(container, "name"), _text(claim, "driver"), device)
                )
            if len(allocations) > MAX_ALLOCATED_IDS:
                raise LedgerError(f"over {MAX_ALLOCATED_IDS} device ids allocated (no more are read)")
    allocatable: dict[str, frozenset[str]] = {}
    offered = 0
    for devices in _items(document, "allocatable"):
        ids = _strings(devices.get("ids"))
        offered += len(ids)
        if offered > MAX_ALLOCATABLE_IDS:
            raise LedgerError(f"over {MAX_ALLOCATABLE_IDS} allocatable device ids (no more are read)")
        resource = _text(devices, "resource")
        allocatable[resource] = allocatable.get(resource, frozenset()) | frozenset(ids)
    return Ledger(tuple(allocations), frozenset(pods), allocatable)


def _items(parent: Any, key: str) -> list[dict[str, Any]]:
    value = parent.get(key) if isinstance(parent, dict) else None
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise LedgerError(f"{key} is not a list of objects")
    return value


def _text(parent: dict[str, Any], key: str) -> str:
    value = parent.get(key, "")
    if not isinstance(value, str):
        raise LedgerError(f"{key} is not a string")
    return value


def _strings(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise LedgerError("device ids are not a list of strings")
    return value


# --- device ids ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceRef:
    """What one device id names: a whole device (`key`) and whether holding it is shared by design."""

    key: str  # GPU-<uuid>, MIG-<uuid>, an index, or the Ascend chip's physical id as text
    shared: bool = False  # a replica (::N), a vNPU: several pods on one device by design
    why_shared: str = ""


def nvidia_ref(device_id: str) -> DeviceRef:
    """`GPU-<uuid>::2` → (GPU-<uuid>, shared: a time-slicing/MPS replica); `MIG-<uuid>` a MIG device (its GPU shared
    by design); `GPU-<uuid>` and an index a whole GPU."""
    match = _REPLICA.match(device_id)
    if match:
        return DeviceRef(match["base"], True, f"replica {match['replica']} (time-slicing or MPS)")
    if device_id.startswith("MIG-"):  # each pod its own MIG device, all on one GPU's /dev/nvidiaN
        return DeviceRef(device_id, True, "MIG devices of one GPU")
    return DeviceRef(device_id)


def ascend_ref(device_id: str) -> DeviceRef | None:
    """`Ascend910-3` → chip 3; `Ascend910-2c-100-3` → chip 3, a vNPU (shared by design); None: not an Ascend id."""
    match = _ASCEND_VNPU.match(device_id)
    if match:
        return DeviceRef(match["phy"], True, f"vNPU {match['cores']} (template)")
    match = _ASCEND_CHIP.match(device_id)
    return DeviceRef(match["phy"]) if match else None


def ascend_real(annotation: str) -> list[str]:
    """The chips `huawei.com/AscendReal` names (comma-separated device ids), in order, each once."""
    return list(dict.fromkeys(part.strip() for part in annotation.split(",") if part.strip()))


def pod_devices(ledger: Ledger | None, namespace: str, name: str) -> list[Allocation]:
    """Every device id the ledger allocated to pod <namespace>/<name> (all its containers); [] when it has none
    or the ledger does not list the pod (`pod_listed` tells the two apart)."""
    if ledger is None:
        return []
    return [a for a in ledger.allocations if a.pod_key == (namespace, name)]


def pod_listed(ledger: Ledger | None, namespace: str, name: str) -> bool:
    return ledger is not None and (namespace, name) in ledger.pods


def by_pod(allocations: Iterable[Allocation]) -> dict[tuple[str, str], list[Allocation]]:
    out: dict[tuple[str, str], list[Allocation]] = {}
    for allocation in allocations:
        out.setdefault(allocation.pod_key, []).append(allocation)
    return out


def describe_pods(allocations: Sequence[Allocation], limit: int = 3) -> str:
    """`pod a/b container c, pod d/e` (each pod once), or `no pod`."""
    pods = list(dict.fromkeys(a.describe_pod() for a in allocations))
    if not pods:
        return "no pod"
    return ", ".join(pods[:limit]) + (f" and {len(pods) - limit} more" if len(pods) > limit else "")


# --- metric labels ---------------------------------------------------------------------------------

ALLOCATED_METRIC = "nodehealth_device_allocated"
ALLOCATED_HELP = (
    "Pods the device plugin's ledger (the kubelet's PodResources API) allocates the device to: 0 free, 1, or more "
    "when shared by design (time-slicing, MPS, vNPU). Labels pod, namespace, container: the one pod, else empty."
)


def pod_labels(allocations: Sequence[Allocation]) -> dict[str, str]:
    """`pod`, `namespace`, `container` of the device's one allocated pod, as dcgm-exporter labels its series;
    empty when it is free or shared (one series per device whatever the pods: the cardinality is the devices')."""
    pods = by_pod(allocations)
    if len(pods) != 1:
        return {"pod": "", "namespace": "", "container": ""}
    first = next(iter(pods.values()))
    containers = sorted({a.container for a in first})
    container = containers[0] if len(containers) == 1 else ""
    return {"pod": first[0].pod, "namespace": first[0].namespace, "container": container}


def allocated_labels(allocations: Sequence[Allocation]) -> tuple[float, dict[str, str]]:
    """nodehealth_device_allocated of one device: (pods it is allocated to, its `resource` label)."""
    resources = sorted({a.resource for a in allocations})
    return float(len(by_pod(allocations))), {"resource": resources[0] if len(resources) == 1 else ""}
