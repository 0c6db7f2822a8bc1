"""The device budget: at most `max_unhealthy_devices` of the fleet's accelerators isolated at once.

The node taint budget keeps a fleet-wide false positive (a DNS outage) from cordoning the cluster; this one keeps
a fleet-wide false positive on devices (a bad npu-smi release that marks every chip Warning) from isolating every
chip. It counts what the agents isolate on a device: DeviceTaintRules (of any effect) and public faults; a device
on its node's taint is the node budget's.

One ConfigMap (`device_budget_configmap`, in the agent's namespace) holds, per node isolating devices, the
devices it holds slots for (`{"devices": ["npu3", ...], "at": epoch}`); the annotation `<prefix>/device-slots`
says how many in all, `<prefix>/device-fleet` what the agents share about the fleet (the device count a
percentage needs, when it was counted and verified, the counting lease). Every change is a compare-and-swap on the
resourceVersion, so agents isolating at the same instant take at most the budget between them; a node writes a
rule or a fault only after its slot is written, and gives the slot back only after the rule or fault is gone.

Cost per question, whatever the fleet's size: a refused node asks again with one metadata-only GET; a grant is
one GET and one PUT. The fleet's devices are counted every `budget_recount_seconds` by one agent (a lease): the
ResourceSlices of `dra_drivers` and the Nodes' capacity of `device_resources`, from the watch cache. When the
budget is spent, one agent per `budget_grace_seconds` verifies the holders against what the agents really
isolate: their labelled DeviceTaintRules and public-fault ConfigMaps (listed by label: O(isolated), not
O(fleet)); a node's slots older than the grace period become what it isolates (none, for an agent that died),
and devices isolated without a slot are adopted.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

from agent.config import KubernetesConfig
from agent.kube.budget import Fleet, budget_limit
from agent.kube.client import BudgetConflict, KubeApi, is_status
from agent.kube.devices import own_rules_selector
from agent.kube.publicfault import own_selector

LABELS = {"app.kubernetes.io/name": "node-health", "app.kubernetes.io/component": "device-budget"}


@dataclass(frozen=True)
class DeviceGrant:
    held: frozenset[str]  # the devices this node holds slots for after the call
    used: int
    limit: int
    devices: int  # the fleet's devices, as last counted
    counting: bool = False  # refused: a percentage and no count yet


@dataclass(frozen=True)
class DeviceBudgetSettings:
    max_unhealthy: str
    node_selector: str
    grace_seconds: float
    recount_seconds: float
    lease_seconds: float
    prefix: str
    drivers: tuple[str, ...]
    resources: tuple[str, ...]
    slices_version: str | None  # None: the cluster has no DRA (capacity only)
    rules_version: str | None
    fault_namespace: str | None  # None: public faults are off

    @property
    def percentage(self) -> bool:
        return self.max_unhealthy.strip().endswith("%")

    @classmethod
    def from_policy(
        cls, policy: KubernetesConfig, slices_version: str | None, rules_version: str | None
    ) -> DeviceBudgetSettings:
        pf = policy.mindcluster.public_fault
        return cls(
            policy.max_unhealthy_devices,
            policy.budget_node_selector,
            policy.budget_grace_seconds,
            policy.budget_recount_seconds,
            max(30.0, 3 * policy.request_timeout_seconds),
            policy.key_prefix,
            tuple(policy.dra_drivers),
            tuple(policy.device_resources),
            slices_version,
            rules_version,
            pf.namespace if pf.enabled else None,
        )


@dataclass
class _Read:
    slots: dict[str, tuple[frozenset[str], float]]
    fleet: Fleet
    version: str | None


def _parse_slot(raw: str) -> tuple[frozenset[str], float]:
    try:
        data = json.loads(raw)
        return frozenset(str(d) for d in data.get("devices") or []), float(data.get("at", 0.0))
    except (ValueError, TypeError, AttributeError):
        return frozenset(), 0.0  # garbage: pruned at the next verification


def _used(slots: dict[str, tuple[frozenset[str], float]]) -> int:
    return sum(len(devices) for devices, _ in slots.values())


def count_devices(api: KubeApi, settings: DeviceBudgetSettings) -> int:
    """The fleet's accelerators: per eligible node the larger of what its DRA slices publish and what its
    capacity advertises (a node served by the DRA driver does not also advertise them as extended resources)."""
    nodes = api.list_nodes(settings.node_selector, from_cache=True)
    per_node: dict[str, int] = {}
    for node in nodes:
        capacity = (node.get("status") or {}).get("capacity") or {}
        total = 0
        for name, quantity in capacity.items():
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in settings.resources):
                try:
                    total += int(str(quantity))
                except ValueError:
                    continue
        per_node[node["metadata"]["name"]] = total
    if settings.slices_version is not None:
        published: dict[str, int] = {}
        for item in api.list_resource_slices(settings.slices_version, None, from_cache=True):
            spec = item.get("spec") or {}
            if spec.get("driver") in settings.drivers and spec.get("nodeName") in per_node:
                published[spec["nodeName"]] = published.get(spec["nodeName"], 0) + len(spec.get("devices") or [])
        for name, count in published.items():
            per_node[name] = max(per_node[name], count)
    return sum(per_node.values())


def census(api: KubeApi, settings: DeviceBudgetSettings) -> dict[str, frozenset[str]]:
    """What the agents isolate now, per node, from their own labelled objects."""
    found: dict[str, set[str]] = {}
    node_key, device_key = f"{settings.prefix}/node", f"{settings.prefix}/device"
    if settings.rules_version is not None:
        for rule in api.list_device_taint_rules(settings.rules_version, own_rules_selector(settings.prefix)):
            metadata = rule.get("metadata") or {}
            node = (metadata.get("labels") or {}).get(node_key)
            device = (metadata.get("annotations") or {}).get(device_key)
            if node and device:
                found.setdefault(node, set()).add(device)
    if settings.fault_namespace is not None:
        for configmap in api.list_configmaps(settings.fault_namespace, own_selector(settings.prefix)):
            metadata = configmap.get("metadata") or {}
            node = (metadata.get("labels") or {}).get(node_key)
            listed = str((metadata.get("annotations") or {}).get(f"{settings.prefix}/isolated", ""))
            if node:
                found.setdefault(node, set()).update(d for d in listed.split(",") if d)
    return {node: frozenset(devices) for node, devices in found.items() if devices}


def apply_census(
    slots: dict[str, tuple[frozenset[str], float]], found: dict[str, frozenset[str]], grace: float, now: float
) -> dict[str, tuple[frozenset[str], float]]:
    """Slots older than the grace period become what their node isolates; isolations without a slot are adopted."""
    out: dict[str, tuple[frozenset[str], float]] = {}
    for node, (devices, at) in slots.items():
        if now - at <= grace:
            out[node] = (devices | found.get(node, frozenset()), at)
        elif found.get(node):
            out[node] = (found[node], at)
    for node, devices in found.items():
        if node not in out:
            out[node] = (devices, now)
    return out


class DeviceBudget:
    def __init__(
        self,
        api: KubeApi,
        node: str,
        namespace: str,
        name: str,
        prefix: str,
        clock: Callable[[], float],
        on_write: Callable[[str], None],
    ) -> None:
        self._api = api
        self.node = node
        self.namespace = namespace
        self.name = name
        self._fleet_key, self._slots_key = f"{prefix}/device-fleet", f"{prefix}/device-slots"
        self._clock = clock
        self._on_write = on_write
        self.attempts = 10

    def _read(self) -> _Read:
        body = self._api.get_configmap(self.namespace, self.name)
        if body is None:
            return _Read({}, Fleet(), None)
        fleet = Fleet.parse((body["metadata"].get("annotations") or {}).get(self._fleet_key))
        slots = {node: _parse_slot(raw) for node, raw in (body.get("data") or {}).items()}
        return _Read(slots, fleet, body["metadata"]["resourceVersion"])

    def _write(self, read: _Read, slots: dict[str, tuple[frozenset[str], float]], fleet: Fleet, what: str) -> bool:
        """Compare-and-swap; False when somebody else wrote first."""
        data = {
            node: json.dumps({"devices": sorted(devices), "at": round(at, 3)}, sort_keys=True)
            for node, (devices, at) in sorted(slots.items())
            if devices
        }
        annotations = {self._slots_key: str(sum(len(d) for d, _ in slots.values()))}
        if fleet != Fleet():
            annotations[self._fleet_key] = fleet.dump()
        metadata: dict[str, Any] = {
            "name": self.name,
            "namespace": self.namespace,
            "labels": LABELS,
            "annotations": annotations,
        }
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}
        try:
            if read.version is None:
                self._api.create_configmap(self.namespace, body)
            else:
                metadata["resourceVersion"] = read.version
                self._api.replace_configmap(self.namespace, self.name, body)
        except Exception as exc:
            if is_status(exc, 409):
                return False
            raise
        self._on_write(what)
        return True

    def peek(self, settings: DeviceBudgetSettings) -> DeviceGrant | None:
        """A refusal from the ConfigMap's metadata alone (slots taken, nothing due); None: ask for real."""
        metadata = self._api.get_configmap_metadata(self.namespace, self.name)
        if metadata is None:
            return None
        annotations = metadata.get("annotations") or {}
        fleet = Fleet.parse(annotations.get(self._fleet_key))
        try:
            used = int(annotations.get(self._slots_key, ""))
        except ValueError:
            return None
        now = self._clock()
        limit = budget_limit(settings.max_unhealthy, fleet.nodes or 0)
        due = self._count_due(fleet, settings, now) or now - fleet.verified_at > settings.grace_seconds
        if due or used < limit:
            return None
        return DeviceGrant(frozenset(), used, limit, fleet.nodes or 0)

    def _count_due(self, fleet: Fleet, settings: DeviceBudgetSettings, now: float) -> bool:
        if not settings.percentage:
            return False
        return (
            fleet.nodes is None
            or fleet.selector != settings.node_selector
            or now - fleet.counted_at > (settings.recount_seconds)
        )

    def _lease_free(self, fleet: Fleet, settings: DeviceBudgetSettings, now: float) -> bool:
        return not fleet.recount_by or fleet.recount_by == self.node or now - fleet.recount_at > settings.lease_seconds

    def acquire(
        self, settings: DeviceBudgetSettings, wanted: Collection[str], isolated: Collection[str]
    ) -> DeviceGrant:
        """Slots for `wanted` devices, as many as fit; `isolated`: devices already isolated (a previous run's rule
        or fault) always get theirs, as a node already tainted keeps its node slot."""
        for _ in range(self.attempts):
            state = self._read()
            now = self._clock()
            mine = state.slots.get(self.node, (frozenset(), now))[0]
            new = set(wanted) - mine
            fleet = state.fleet
            if self._count_due(fleet, settings, now):
                if self._lease_free(fleet, settings, now):
                    lease = replace(fleet, recount_by=self.node, recount_at=now)
                    if not self._write(state, state.slots, lease, "counting the devices"):
                        continue
                    state = self._read()
                    count = count_devices(self._api, settings)
                    fleet = replace(
                        state.fleet, nodes=count, selector=settings.node_selector, counted_at=now, recount_by=""
                    )
                elif fleet.nodes is None and not set(isolated) & new:
                    return DeviceGrant(mine, _used(state.slots), 0, 0, counting=True)
            if not new and fleet == state.fleet:
                limit = budget_limit(settings.max_unhealthy, fleet.nodes or 0)
                return DeviceGrant(mine, _used(state.slots), limit, fleet.nodes or 0)
            grant = self._take(state, fleet, settings, now, mine, new, set(isolated))
            if grant is not None:
                return grant
        raise BudgetConflict(f"configmap {self.namespace}/{self.name}: {self.attempts} compare-and-swap attempts lost")

    def _take(
        self,
        state: _Read,
        fleet: Fleet,
        settings: DeviceBudgetSettings,
        now: float,
        mine: frozenset[str],
        new: set[str],
        isolated: set[str],
    ) -> DeviceGrant | None:
        """One compare-and-swap of a request; None when it lost the race."""
        slots = dict(state.slots)
        limit = budget_limit(settings.max_unhealthy, fleet.nodes or 0)
        adopted = new & isolated
        room = limit - _used(slots) - len(adopted)
        if room < len(new - adopted) and now - fleet.verified_at > settings.grace_seconds:
            slots = apply_census(slots, census(self._api, settings), settings.grace_seconds, now)
            fleet = replace(fleet, verified_at=now)
            mine = slots.get(self.node, (frozenset(), now))[0]
            new -= mine
            room = limit - _used(slots) - len(new & adopted)
        granted = adopted | set(sorted(new - adopted)[: max(0, room)])
        held = frozenset(mine | granted)
        if granted:
            slots[self.node] = (held, now)
        if (slots, fleet) == (state.slots, state.fleet):
            return DeviceGrant(held, _used(slots), limit, fleet.nodes or 0)
        what = f"took {len(granted)} device slot(s) ({_used(slots)} of {limit})" if granted else "verified the holders"
        if not self._write(state, slots, fleet, what):
            return None
        return DeviceGrant(held, _used(slots), limit, fleet.nodes or 0)

    def release(self, keep: Collection[str]) -> frozenset[str]:
        """Keep only these of this node's slots; the slots it still holds."""
        for _ in range(self.attempts):
            state = self._read()
            mine, at = state.slots.get(self.node, (frozenset(), 0.0))
            kept = mine & frozenset(keep)
            if kept == mine:
                return mine
            slots = {**state.slots, self.node: (kept, at)}
            if not kept:
                del slots[self.node]
            if self._write(state, slots, state.fleet, f"released {len(mine - kept)} device slot(s)"):
                return kept
        raise BudgetConflict(f"configmap {self.namespace}/{self.name}: {self.attempts} compare-and-swap attempts lost")

    def release_nodes(self, nodes: Collection[str] | None, what: str) -> dict[str, int]:
        """Cleanup: these nodes' slots (None: every slot and the fleet record); devices released per node."""
        for _ in range(self.attempts):
            state = self._read()
            if state.version is None:
                return {}
            gone = {n: len(d) for n, (d, _) in state.slots.items() if nodes is None or n in nodes}
            if not gone and (nodes is not None or state.fleet == Fleet()):
                return {}
            slots = {n: v for n, v in state.slots.items() if n not in gone}
            if self._write(state, slots, Fleet() if nodes is None else state.fleet, what):
                return gone
        raise BudgetConflict(f"configmap {self.namespace}/{self.name}: {self.attempts} compare-and-swap attempts lost")

    def would_grant(
        self, settings: DeviceBudgetSettings, wanted: Collection[str], isolated: Collection[str]
    ) -> DeviceGrant:
        """What acquire would answer, read-only (a dry run): counts the devices itself when no count is fresh."""
        state = self._read()
        now = self._clock()
        fleet = state.fleet
        if self._count_due(fleet, settings, now):
            fleet = replace(fleet, nodes=count_devices(self._api, settings))
        mine = state.slots.get(self.node, (frozenset(), now))[0]
        limit = budget_limit(settings.max_unhealthy, fleet.nodes or 0)
        new = set(wanted) - mine
        adopted = new & set(isolated)
        room = limit - _used(state.slots) - len(adopted)
        held = frozenset(mine | adopted | set(sorted(new - adopted)[: max(0, room)]))
        return DeviceGrant(held, _used(state.slots) + len(held - mine), limit, fleet.nodes or 0)

    def usage(self) -> tuple[dict[str, frozenset[str]], Fleet]:
        """The slots per node and the fleet record (read-only: the fleet view, dry runs)."""
        state = self._read()
        return {node: devices for node, (devices, _) in state.slots.items()}, state.fleet
