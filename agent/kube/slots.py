"""What the two cluster budgets share (agent.kube.node.budget for nodes, agent.kube.devices.budget for devices): a
ConfigMap of slots, one data key per node holding some, and two annotations, how many slots are taken
(`<prefix>/<slots key>`) and the fleet record (`<prefix>/<fleet key>`: the count a percentage needs, when it was
counted, when the holders were last verified, who is counting now: a lease). Every change is a compare-and-swap
on the ConfigMap's resourceVersion (PUT with it; 409 → read again), so agents asking at the same instant take
at most the budget between them; a refused node asks again by reading only the ConfigMap's metadata (a GET
answered as PartialObjectMetadata: a few hundred bytes, whatever the size of the fleet).

`SlotBudget` is that mechanism; each budget says what a slot is (`_decode`, `_encode`, `_size`), what it counts
and how it verifies the holders.

Records are other agents' words, judged here: their timestamps are other nodes' wall clocks, so a record is as
old as this agent's clock says (`record_age`), and one from the future (a clock running ahead) is stale, never
fresh for a year; a value that is not a finite, non-negative number in range is garbage (`Fleet.validated`): the
record counts as absent, so the fleet is counted again (logged once per garbage record), which never lifts the
budget (no slot beyond the limit) and never stalls it beyond that one recount. The slots count annotation is
judged alike (`slots_count`): garbage there is not believed, the slots themselves are read and counted.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Generic, TypeVar

from agent.config import KubernetesConfig
from agent.kube.client import BudgetConflict, KubeApi, is_status

log = logging.getLogger("agent.kube")

# A record stamped this far ahead of this agent's clock is taken as written now (ordinary skew between nodes);
# further ahead, it is stale.
FUTURE_TOLERANCE_SECONDS = 5.0
# Far beyond any cluster Kubernetes supports (5,000 nodes; the largest managed ones 65,000): more is garbage.
# The device budget's count is of devices (16 per node at most today), still far below.
MAX_FLEET_NODES = 1_000_000


def record_age(stamp: float, now: float) -> float:
    """How old a record stamped `stamp` (another agent's wall clock) is to this agent, whose clock says `now`.
    From the future beyond the tolerance it is infinitely old: a node whose clock runs ahead must not freeze
    the fleet's recounts and verifications, nor keep a dead node's slot young, until its clock is reached."""
    if stamp > now + FUTURE_TOLERANCE_SECONDS:
        return math.inf
    return max(0.0, now - stamp)


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} is {value!r}, not a finite number >= 0")
    return float(value)


def stamp(value: Any) -> float:
    """A slot's timestamp as another agent wrote it; 0 (long ago: prunable) when that is garbage."""
    try:
        return _finite(value, "stamp")
    except ValueError:
        return 0.0


def slots_count(raw: Any) -> int:
    """The slots count annotation as agents write it (a decimal count, at most MAX_FLEET_NODES); ValueError says
    what is garbage. (int() alone takes "-5", " 5", "5_000" and other scripts' digits.)"""
    text = raw if isinstance(raw, str) else ""
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_FLEET_NODES:
        raise ValueError(f"{raw!r} is not a slot count")
    return int(text)


def budget_limit(max_unhealthy: str, count: int) -> int:
    """A count, or a percentage of `count` rounded up (10% of 5 nodes is 1, as for a DaemonSet's maxUnavailable)."""
    text = max_unhealthy.strip()
    if text.endswith("%"):
        return math.ceil(count * float(text[:-1]) / 100.0 - 1e-9)
    return int(float(text))


@dataclass(frozen=True)
class Fleet:
    """What the fleet annotation records. `nodes`: what the budget counts (the device budget: devices)."""

    nodes: int | None = None
    selector: str = ""
    counted_at: float = 0.0
    verified_at: float = 0.0
    recount_by: str = ""
    recount_at: float = 0.0

    @classmethod
    def validated(cls, raw: str | None) -> Fleet:
        """The record with every value checked; ValueError says what is garbage. (json.loads takes NaN,
        Infinity and 1e999, which is infinite, as numbers.)"""
        try:
            data = json.loads(raw or "{}")
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        nodes = data.get("nodes")
        if nodes is not None:
            count = _finite(nodes, "nodes")
            if count != int(count) or count > MAX_FLEET_NODES:
                raise ValueError(f"nodes is {nodes!r}, not a node count")
            nodes = int(count)
        selector, recount_by = data.get("selector", ""), data.get("recount_by", "")
        if not isinstance(selector, str) or not isinstance(recount_by, str):
            raise ValueError("selector and recount_by must be strings")
        stamps = [_finite(data.get(key, 0.0), key) for key in ("counted_at", "verified_at", "recount_at")]
        return cls(nodes, selector, stamps[0], stamps[1], recount_by, stamps[2])

    @classmethod
    def parse(cls, raw: str | None) -> Fleet:
        try:
            return cls.validated(raw)
        except ValueError:
            return cls()  # garbage: counted again

    def dump(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)


@dataclass(frozen=True)
class SlotSettings:
    """A budget's policy, as both budgets read it from the config."""

    max_unhealthy: str
    selector: str  # the nodes the budget counts
    grace_seconds: float
    recount_seconds: float
    lease_seconds: float
    prefix: str

    @property
    def percentage(self) -> bool:
        return self.max_unhealthy.strip().endswith("%")

    @staticmethod
    def shared(policy: KubernetesConfig, max_unhealthy: str) -> tuple[str, str, float, float, float, str]:
        """The fields above from the config, with this budget's `max_unhealthy`: the two share everything else."""
        return (
            max_unhealthy,
            policy.budget_node_selector,
            policy.budget_grace_seconds,
            policy.budget_recount_seconds,
            max(30.0, 3 * policy.request_timeout_seconds),  # the counting lease
            policy.key_prefix,
        )


SlotT = TypeVar("SlotT")


@dataclass
class SlotsRead(Generic[SlotT]):
    slots: dict[str, SlotT]
    fleet: Fleet
    version: str | None  # None: no ConfigMap yet


class SlotBudget(Generic[SlotT]):
    """One budget's ConfigMap: read, peeked at, written by compare-and-swap; the fleet record judged."""

    LABELS: ClassVar[dict[str, str]]
    SLOTS_KEY: ClassVar[str]  # the annotations' names under `<prefix>/`
    FLEET_KEY: ClassVar[str]
    KIND: ClassVar[str]  # the budget, in logs

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
        self._fleet_key, self._slots_key = f"{prefix}/{self.FLEET_KEY}", f"{prefix}/{self.SLOTS_KEY}"
        self._clock = clock
        self._on_write = on_write
        self.attempts = 10
        self._garbage_seen: str | None = None  # the garbage fleet record last logged
        self._garbage_count_seen: str | None = None  # the garbage slots count last logged

    # --- what a slot is: the budget's own -----------------------------------------------------------

    def _decode(self, raw: str) -> SlotT:
        raise NotImplementedError

    def _encode(self, slot: SlotT) -> str | None:
        """The data value; None: the node holds nothing, no key."""
        raise NotImplementedError

    def _size(self, slot: SlotT) -> int:
        """How many of the budget's slots it takes."""
        raise NotImplementedError

    # --- the ConfigMap ------------------------------------------------------------------------------

    def _read(self) -> SlotsRead[SlotT]:
        body = self._api.get_configmap(self.namespace, self.name)
        if body is None:
            return SlotsRead({}, Fleet(), None)
        fleet = self._fleet((body["metadata"].get("annotations") or {}).get(self._fleet_key))
        slots = {node: self._decode(raw) for node, raw in (body.get("data") or {}).items()}
        return SlotsRead(slots, fleet, body["metadata"]["resourceVersion"])

    def _fleet(self, raw: str | None) -> Fleet:
        """The fleet record, or none (so the fleet is counted again) when it is garbage; logged once."""
        try:
            return Fleet.validated(raw)
        except ValueError as exc:
            if raw != self._garbage_seen:
                self._garbage_seen = raw
                log.warning(
                    "kubernetes: %s %s/%s: fleet record is garbage (%s); counting again",
                    self.KIND,
                    self.namespace,
                    self.name,
                    exc,
                )
            return Fleet()

    def _used(self, raw: str | None) -> int | None:
        """The slots count, or None (the slots are read and counted) when there is none or it is garbage; a
        refusal is never taken from garbage. Garbage is logged once."""
        if raw is None:
            return None
        try:
            return slots_count(raw)
        except ValueError as exc:
            if raw != self._garbage_count_seen:
                self._garbage_count_seen = raw
                log.warning(
                    "kubernetes: %s %s/%s: slots count is garbage (%s); counting the slots again",
                    self.KIND,
                    self.namespace,
                    self.name,
                    exc,
                )
            return None

    def _refusal(self, settings: SlotSettings) -> tuple[int, int, int] | None:
        """(used, limit, counted) of a refusal read from the ConfigMap's metadata alone, when that is all there is
        to say: the slots are taken and no count or verification is due. None: read the slots."""
        metadata = self._api.get_configmap_metadata(self.namespace, self.name)
        if metadata is None:
            return None
        annotations = metadata.get("annotations") or {}
        fleet = self._fleet(annotations.get(self._fleet_key))
        used = self._used(annotations.get(self._slots_key))
        if used is None:
            return None
        now = self._clock()
        limit = self._limit(fleet, settings)
        if self._count_due(fleet, settings, now) or used < limit or self._verify_due(fleet, settings, now):
            return None
        return used, limit, fleet.nodes or 0

    def _write(self, slots: dict[str, SlotT], fleet: Fleet, version: str | None, what: str) -> str | None:
        """Compare-and-swap: the new resourceVersion, or None when somebody else wrote first."""
        data = {node: raw for node, slot in sorted(slots.items()) if (raw := self._encode(slot)) is not None}
        annotations = {self._slots_key: str(sum(self._size(slot) for slot in slots.values()))}
        if fleet != Fleet():
            annotations[self._fleet_key] = fleet.dump()
        metadata: dict[str, Any] = {
            "name": self.name,
            "namespace": self.namespace,
            "labels": self.LABELS,
            "annotations": annotations,
        }
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}
        try:
            if version is None:
                answer = self._api.create_configmap(self.namespace, body)
            else:
                metadata["resourceVersion"] = version
                answer = self._api.replace_configmap(self.namespace, self.name, body)
        except Exception as exc:
            if is_status(exc, 409):
                return None
            raise
        self._on_write(what)
        return str(answer.get("metadata", {}).get("resourceVersion") or "")

    def _lost(self) -> BudgetConflict:
        return BudgetConflict(f"configmap {self.namespace}/{self.name}: {self.attempts} compare-and-swap attempts lost")

    # --- the fleet record, judged -------------------------------------------------------------------

    def _count_due(self, fleet: Fleet, settings: SlotSettings, now: float) -> bool:
        stale = record_age(fleet.counted_at, now) > settings.recount_seconds
        return fleet.nodes is None or fleet.selector != settings.selector or stale

    def _verify_due(self, fleet: Fleet, settings: SlotSettings, now: float) -> bool:
        return record_age(fleet.verified_at, now) > settings.grace_seconds

    def _lease_free(self, fleet: Fleet, settings: SlotSettings, now: float) -> bool:
        expired = record_age(fleet.recount_at, now) > settings.lease_seconds
        return not fleet.recount_by or fleet.recount_by == self.node or expired

    def _lease(self, state: SlotsRead[SlotT], now: float, what: str) -> SlotsRead[SlotT] | None:
        """Take the counting lease; the state as written, or None when somebody else wrote first."""
        lease = replace(state.fleet, recount_by=self.node, recount_at=now)
        version = self._write(state.slots, lease, state.version, what)
        return None if version is None else SlotsRead(state.slots, lease, version)

    def _limit(self, fleet: Fleet, settings: SlotSettings) -> int:
        return budget_limit(settings.max_unhealthy, fleet.nodes or 0)

    # --- cleanup ------------------------------------------------------------------------------------

    def release_nodes(self, nodes: Collection[str] | None, what: str = "", dry_run: bool = False) -> dict[str, int]:
        """Remove these nodes' slots (None: every slot and the fleet record); the budget's slots they held, per
        node, in the nodes' order. dry_run: what would be removed, nothing written."""
        if dry_run:
            held = {n: slot for n, slot in self._read().slots.items() if nodes is None or n in nodes}
        else:
            held = self._release(nodes, what)
        return {node: self._size(slot) for node, slot in sorted(held.items())}

    def _release(self, nodes: Collection[str] | None, what: str) -> dict[str, SlotT]:
        """Remove these nodes' slots (None: every slot and the fleet record); the slots removed."""
        for _ in range(self.attempts):
            state = self._read()
            if state.version is None:
                return {}
            gone = {n: slot for n, slot in state.slots.items() if nodes is None or n in nodes}
            if not gone and (nodes is not None or state.fleet == Fleet()):
                return {}
            slots = {n: slot for n, slot in state.slots.items() if n not in gone}
            fleet = Fleet() if nodes is None else state.fleet
            if self._write(slots, fleet, state.version, what or f"released {len(gone)} slots") is not None:
                return gone
        raise self._lost()
