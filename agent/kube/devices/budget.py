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

The ConfigMap mechanism (reads, metadata peeks, compare-and-swap, the fleet record and how its records are judged:
a record or slot from the future is stale, garbage is counted again) is the node taint budget's: agent.kube.slots.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import ClassVar

from agent.config import KubernetesConfig
from agent.kube.client import KubeApi
from agent.kube.devices.dra import own_rules
from agent.kube.devices.publicfault import own_selector
from agent.kube.slots import Fleet, SlotBudget, SlotSettings, SlotsRead, record_age, stamp

LABELS = {"app.kubernetes.io/name": "node-health", "app.kubernetes.io/component": "device-budget"}


@dataclass(frozen=True)
class DeviceGrant:
    held: frozenset[str]  # the devices this node holds slots for after the call
    used: int
    limit: int
    devices: int  # the fleet's devices, as last counted
    counting: bool = False  # refused: a percentage and no count yet


@dataclass(frozen=True)
class DeviceBudgetSettings(SlotSettings):
    drivers: tuple[str, ...]
    resources: tuple[str, ...]
    slices_version: str | None  # None: the cluster has no DRA (capacity only)
    rules_version: str | None
    fault_namespace: str | None  # None: public faults are off

    @classmethod
    def from_policy(
        cls, policy: KubernetesConfig, slices_version: str | None, rules_version: str | None
    ) -> DeviceBudgetSettings:
        pf = policy.mindcluster.public_fault
        return cls(
            *cls.shared(policy, policy.max_unhealthy_devices),
            tuple(policy.dra_drivers),
            tuple(policy.device_resources),
            slices_version,
            rules_version,
            pf.namespace if pf.enabled else None,
        )


Slot = tuple[frozenset[str], float]  # the devices a node holds slots for, and when it took them
_Read = SlotsRead[Slot]


def _used(slots: dict[str, Slot]) -> int:
    return sum(len(devices) for devices, _ in slots.values())


def count_devices(api: KubeApi, settings: DeviceBudgetSettings) -> int:
    """The fleet's accelerators: per eligible node the larger of what its DRA slices publish and what its
    capacity advertises (a node served by the DRA driver does not also advertise them as extended resources)."""
    nodes = api.list_nodes(settings.selector, from_cache=True)
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
        for rule in own_rules(api, settings.rules_version, settings.prefix, None).values():
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


def apply_census(slots: dict[str, Slot], found: dict[str, frozenset[str]], grace: float, now: float) -> dict[str, Slot]:
    """Slots older than the grace period (or from the future) become what their node isolates; isolations without
    a slot are adopted."""
    out: dict[str, Slot] = {}
    for node, (devices, at) in slots.items():
        if record_age(at, now) <= grace:
            out[node] = (devices | found.get(node, frozenset()), at)
        elif found.get(node):
            out[node] = (found[node], at)
    for node, devices in found.items():
        if node not in out:
            out[node] = (devices, now)
    return out


class DeviceBudget(SlotBudget[Slot]):
    """The device budget: a node's slot is the set of devices it holds slots for, one slot per device."""

    LABELS: ClassVar[dict[str, str]] = LABELS
    SLOTS_KEY, FLEET_KEY, KIND = "device-slots", "device-fleet", "device budget"

    def _decode(self, raw: str) -> Slot:
        try:
            data = json.loads(raw)
            return frozenset(str(d) for d in data.get("devices") or []), stamp(data.get("at", 0.0))
        except (ValueError, TypeError, AttributeError, RecursionError):
            return frozenset(), 0.0  # garbage: pruned at the next verification

    def _encode(self, slot: Slot) -> str | None:
        devices, at = slot
        return json.dumps({"devices": sorted(devices), "at": round(at, 3)}, sort_keys=True) if devices else None

    def _size(self, slot: Slot) -> int:
        return len(slot[0])

    def peek(self, settings: DeviceBudgetSettings) -> DeviceGrant | None:
        """A refusal from the ConfigMap's metadata alone (slots taken, nothing due); None: ask for real."""
        refused = self._refusal(settings)
        return None if refused is None else DeviceGrant(frozenset(), *refused)

    def _count_due(self, fleet: Fleet, settings: SlotSettings, now: float) -> bool:
        """Only a percentage needs the fleet's devices counted."""
        return settings.percentage and super()._count_due(fleet, settings, now)

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
                    leased = self._lease(state, now, "counting the devices")
                    if leased is None:
                        continue
                    state, count = leased, count_devices(self._api, settings)
                    fleet = replace(state.fleet, nodes=count, selector=settings.selector, counted_at=now, recount_by="")
                elif fleet.nodes is None and not set(isolated) & new:
                    return DeviceGrant(mine, _used(state.slots), 0, 0, counting=True)
            if not new and fleet == state.fleet:
                limit = self._limit(fleet, settings)
                return DeviceGrant(mine, _used(state.slots), limit, fleet.nodes or 0)
            grant = self._take(state, fleet, settings, now, mine, new, set(isolated))
            if grant is not None:
                return grant
        raise self._lost()

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
        limit = self._limit(fleet, settings)
        adopted = new & isolated
        room = limit - _used(slots) - len(adopted)
        if room < len(new - adopted) and self._verify_due(fleet, settings, now):
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
        if self._write(slots, fleet, state.version, what) is None:
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
            what = f"released {len(mine - kept)} device slot(s)"
            if self._write(slots, state.fleet, state.version, what) is not None:
                return kept
        raise self._lost()

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
        limit = self._limit(fleet, settings)
        new = set(wanted) - mine
        adopted = new & set(isolated)
        room = limit - _used(state.slots) - len(adopted)
        held = frozenset(mine | adopted | set(sorted(new - adopted)[: max(0, room)]))
        return DeviceGrant(held, _used(state.slots) + len(held - mine), limit, fleet.nodes or 0)
