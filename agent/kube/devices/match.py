"""Which device a finding is about, and which device of the cluster's DRA ResourceSlices that is: pure, no I/O.

- `identities`: every NPU and GPU of the node as its findings know it (logical index, UUIDs, PCI Bus-Id,
  physical id, /dev minor), merged over all findings about it (a pcie finding knows the Bus-Id, the npu finding
  of the same chip its physical id).
- `device_wants`: per device, the worst problem that asks to isolate it, with the effect a device taint gets.
- `published_devices` / `matching`: the devices this node's ResourceSlices publish, and which of them is a given
  device: by UUID, else by PCI Bus-Id, else (NPUs) by physical id, never by position or by name.
- `rule_name` / `rule_body`: one DeviceTaintRule per published device and category, named deterministically.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.config import KubernetesConfig
from agent.kube.node.policy import NO_FRESH_RESULT, taint_key
from agent.ready import matches_finding
from agent.snapshot import CheckState, Snapshot
from probes.base import (
    OBSERVED_DEVICE_IDS,
    OBSERVED_DEVICE_MINOR,
    OBSERVED_PCI_BUS_ID,
    OBSERVED_PHYSICAL_ID,
    Status,
)
from probes.runtime.inventory import normalize_bus_id

DEVICE_CATEGORIES = ("npu", "gpu")
DEVICE_EFFECTS = ("NoExecute", "NoSchedule", "None")  # strongest first
RULE_LABELS = {"app.kubernetes.io/name": "node-health", "app.kubernetes.io/component": "device-taint"}
NAME_LIMIT = 253
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
# Attribute names (lowercased, without their domain) under which DRA drivers publish a device's identity:
# NVIDIA `uuid` and `resource.kubernetes.io/pciBusID` (older releases `pcieBusID`), MindCluster `physicId`.
_UUID_ATTRIBUTES = ("uuid",)
_BUS_ATTRIBUTES = ("pcibusid", "pciebusid", "busid")
_PHYSICAL_ATTRIBUTES = ("physicid", "physicalid", "phyid")


@dataclass(frozen=True, order=True)
class DeviceRef:
    """One accelerator of this node: its category and the index findings give it (NPU logical id, GPU index)."""

    category: str
    index: int

    @property
    def name(self) -> str:
        return f"{self.category}{self.index}"


@dataclass
class Identity:
    ref: DeviceRef
    uuids: set[str] = field(default_factory=set)
    bus_ids: set[str] = field(default_factory=set)  # normalized, sysfs style
    physical_id: int | None = None
    minor: int | None = None


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def identities(states: Iterable[CheckState]) -> dict[DeviceRef, Identity]:
    out: dict[DeviceRef, Identity] = {}
    for state in states:
        finding = state.finding
        if finding.device is None or finding.category not in DEVICE_CATEGORIES:
            continue
        ref = DeviceRef(finding.category, finding.device)
        identity = out.setdefault(ref, Identity(ref))
        ids = finding.observed.get(OBSERVED_DEVICE_IDS)
        if isinstance(ids, (list, tuple)):
            identity.uuids.update(i for i in ids if isinstance(i, str) and i)
        bus = finding.observed.get(OBSERVED_PCI_BUS_ID)
        normal = normalize_bus_id(bus) if isinstance(bus, str) else None
        if normal is not None:
            identity.bus_ids.add(normal)
        physical = _as_int(finding.observed.get(OBSERVED_PHYSICAL_ID))
        if physical is not None:
            identity.physical_id = physical
        minor = _as_int(finding.observed.get(OBSERVED_DEVICE_MINOR))
        if minor is not None:
            identity.minor = minor
    return out


# --- what to isolate ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Want:
    """The worst problem of one device that asks to isolate it."""

    ref: DeviceRef
    reason: str
    effect: str  # of a device taint: NoSchedule, NoExecute or None
    states: tuple[CheckState, ...]  # every problem of the device, worst first

    @property
    def keys(self) -> frozenset[tuple[str, str]]:
        return frozenset(state.finding.key for state in self.states)

    @property
    def message(self) -> str:
        finding = self.states[0].finding
        return f"{finding.check} {finding.subject}: {finding.message}".strip()


def device_effect(status: Status, reason: str, policy: KubernetesConfig) -> str:
    """A warn is informational (None); a fail takes its node effect where a device taint has it: NoSchedule, and
    NoExecute only when allowed. PreferNoSchedule and None (report only) have no device counterpart: None."""
    if status == Status.WARN:
        return "None"
    effect = policy.effects.get(reason, policy.default_effect)
    if effect == "NoExecute":
        return "NoExecute" if policy.allow_noexecute else "NoSchedule"
    return "NoSchedule" if effect == "NoSchedule" else "None"


def is_device_problem(state: CheckState, policy: KubernetesConfig) -> bool:
    finding = state.finding
    return (
        finding.device is not None
        and finding.category in DEVICE_CATEGORIES
        and finding.status in (Status.FAIL, Status.WARN)
        and finding.reason not in policy.disabled_reasons
        and not matches_finding(finding, policy.disabled_checks)
    )


def device_wants(snapshot: Snapshot, policy: KubernetesConfig) -> dict[DeviceRef, Want]:
    problems: dict[DeviceRef, list[tuple[tuple[int, int, str, str], CheckState]]] = {}
    for state in snapshot.checks:
        if not is_device_problem(state, policy):
            continue
        finding = state.finding
        assert finding.device is not None
        effect = device_effect(finding.status, finding.reason, policy)
        rank = (DEVICE_EFFECTS.index(effect), 0 if finding.status == Status.FAIL else 1, finding.reason, finding.check)
        problems.setdefault(DeviceRef(finding.category, finding.device), []).append((rank, state))
    out = {}
    for ref, ranked in sorted(problems.items()):
        ranked.sort(key=lambda item: item[0])
        worst = ranked[0][1].finding
        effect = device_effect(worst.status, worst.reason, policy)
        out[ref] = Want(ref, worst.reason, effect, tuple(state for _, state in ranked))
    return out


def held_categories(snapshot: Snapshot, policy: KubernetesConfig) -> frozenset[str]:
    """Categories with a check that has no fresh result (WarmingUp, Stale): what a previous run isolated there
    stays until fresh results decide, as the category's node taint does."""
    return frozenset(
        state.finding.category
        for state in snapshot.checks
        if state.finding.category in DEVICE_CATEGORIES
        and state.finding.status == Status.UNKNOWN
        and state.finding.reason in NO_FRESH_RESULT
        and not matches_finding(state.finding, policy.disabled_checks)
    )


# --- published devices --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Published:
    """A device one of this node's ResourceSlices publishes: what a DeviceTaintRule selects it by, and its ids."""

    driver: str
    pool: str
    name: str
    slice: str
    uuids: frozenset[str] = frozenset()
    bus_id: str | None = None
    physical_id: int | None = None


def _attribute(value: Any) -> Any:
    """A DeviceAttribute's value ({"string": ...}, {"int": ...}, {"version": ...}, {"bool": ...})."""
    if not isinstance(value, Mapping):
        return None
    for kind in ("string", "int", "version", "bool"):
        if kind in value:
            return value[kind]
    return None


def _published(driver: str, pool: str, slice_name: str, device: Mapping[str, Any]) -> Published | None:
    name = device.get("name")
    if not isinstance(name, str) or not name:
        return None
    raw = device.get("attributes")
    if not isinstance(raw, Mapping):  # v1beta1 nests them under `basic`
        basic = device.get("basic")
        raw = basic.get("attributes") if isinstance(basic, Mapping) else None
    attributes = {str(key).rsplit("/", 1)[-1].lower(): _attribute(value) for key, value in (raw or {}).items()}
    uuids = frozenset(v for k in _UUID_ATTRIBUTES if isinstance(v := attributes.get(k), str) and v)
    bus = next((v for k in _BUS_ATTRIBUTES if isinstance(v := attributes.get(k), str)), None)
    physical = next((p for k in _PHYSICAL_ATTRIBUTES if (p := _as_int(attributes.get(k))) is not None), None)
    return Published(driver, pool, name, slice_name, uuids, normalize_bus_id(bus) if bus else None, physical)


def published_devices(
    slices: Iterable[Mapping[str, Any]], node: str, drivers: Iterable[str]
) -> tuple[list[Published], list[str]]:
    """The devices this node's slices of the given drivers publish, and notes on the slices left out (another
    node's, or a pool not named after the node: the admission policy lets an agent taint only its own pool)."""
    wanted = set(drivers)
    out: list[Published] = []
    notes: list[str] = []
    for item in slices:
        spec = item.get("spec") if isinstance(item, Mapping) else None
        if not isinstance(spec, Mapping) or spec.get("driver") not in wanted:
            continue
        name = str((item.get("metadata") or {}).get("name", ""))
        pool = str((spec.get("pool") or {}).get("name", ""))
        if spec.get("nodeName") != node:
            continue
        if pool != node:
            notes.append(f"slice {name} of {spec['driver']}: pool {pool!r} is not the node's name")
            continue
        for device in spec.get("devices") or []:
            published = _published(str(spec["driver"]), pool, name, device) if isinstance(device, Mapping) else None
            if published is not None:
                out.append(published)
    return out, notes


def matching(identity: Identity, published: Iterable[Published]) -> list[Published]:
    """The published devices that are this device: by UUID (a GPU's, or its MIG devices'), else by PCI Bus-Id,
    else, for an NPU, by physical id."""
    candidates = list(published)
    by_uuid = [p for p in candidates if p.uuids & identity.uuids]
    if by_uuid:
        return by_uuid
    by_bus = [p for p in candidates if p.bus_id is not None and p.bus_id in identity.bus_ids]
    if by_bus:
        return by_bus
    if identity.ref.category == "npu" and identity.physical_id is not None:
        return [p for p in candidates if p.physical_id == identity.physical_id]
    return []


# --- rules ----------------------------------------------------------------------------------------------------


def node_label_value(node: str) -> str | None:
    """The node's name as a label value, or None when it cannot be one (longer than 63 characters)."""
    return node if _LABEL_VALUE.match(node) else None


def rule_name(prefix: str, category: str, node: str, driver: str, device: str) -> str:
    """`<prefix>.<category>.<node>.<driver>.<device>`, lowercased: deterministic, a DNS subdomain of at most 253
    characters; when that does not fit (or the parts are not DNS names) the tail becomes a hash of them."""
    raw = ".".join((prefix, category, node, driver, device))
    name = raw.lower()
    if len(name) <= NAME_LIMIT and _DNS_SUBDOMAIN.match(name) and ".." not in name:
        return name
    digest = hashlib.sha256(raw.encode()).hexdigest()[:16]
    head = re.sub(r"[^a-z0-9.-]+", "-", f"{prefix}.{category}.{node}".lower()).strip(".-")
    return f"{head[: NAME_LIMIT - len(digest) - 1].rstrip('.-')}.{digest}"


def rule_labels(prefix: str, node_label: str, category: str) -> dict[str, str]:
    return {**RULE_LABELS, f"{prefix}/node": node_label, f"{prefix}/category": category}


def own_rules_selector(prefix: str, node_label: str | None = None) -> str:
    """The label selector of the agents' rules: of one node, or (None) of every node."""
    base = ",".join(f"{k}={v}" for k, v in RULE_LABELS.items())
    return f"{base},{prefix}/node={node_label}" if node_label is not None else f"{base},{prefix}/node"


def rule_spec(prefix: str, device: Published, category: str, reason: str, effect: str) -> dict[str, Any]:
    return {
        "deviceSelector": {"driver": device.driver, "pool": device.pool, "device": device.name},
        "taint": {"key": taint_key(prefix, category), "value": reason, "effect": effect},
    }


def rule_body(
    version: str, name: str, labels: Mapping[str, str], subject: str, prefix: str, spec: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "DeviceTaintRule",
        "metadata": {"name": name, "labels": dict(labels), "annotations": {f"{prefix}/device": subject}},
        "spec": dict(spec),
    }


def same_spec(rule: Mapping[str, Any], spec: Mapping[str, Any]) -> bool:
    """Whether a stored rule selects and taints as `spec` says (timeAdded, set by the server, aside)."""
    stored = rule.get("spec") or {}
    taint = stored.get("taint") or {}
    wanted = spec["taint"]
    same_taint = all((taint.get(key) or "") == (wanted.get(key) or "") for key in ("key", "value", "effect"))
    return same_taint and stored.get("deviceSelector") == spec["deviceSelector"]


def is_own_rule(rule: Mapping[str, Any], prefix: str, node_label: str | None) -> bool:
    """Whether a rule carries the agents' labels (of this node, unless node_label is None)."""
    labels = (rule.get("metadata") or {}).get("labels") or {}
    if any(labels.get(key) != value for key, value in RULE_LABELS.items()):
        return False
    node = labels.get(f"{prefix}/node")
    return node is not None and (node_label is None or node == node_label)
