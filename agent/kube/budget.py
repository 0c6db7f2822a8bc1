"""The cluster taint budget: at most `max_unhealthy` nodes carry a NoSchedule/NoExecute node-health taint.

One ConfigMap holds the slots, one data key per node holding one (`{"acquired_at": epoch, "taints": ...}`).
Its annotations say how many slots are taken (`<prefix>/slots`) and what the agents share about the fleet
(`<prefix>/fleet`): the count of eligible nodes, when it was counted, when the holders were last verified, and
who is counting now (a lease). Every change is a compare-and-swap on the ConfigMap's resourceVersion (PUT with
it; 409 → read again), so agents failing at the same instant take at most the budget between them: a node
adds its first blocking taint only after its slot is written, and gives the slot back only after its last
blocking taint is gone.

Cost at fleet scale (a DNS outage fails every node at once, exactly when the budget trips): a node that was
refused asks again by reading only the ConfigMap's metadata (a GET answered as PartialObjectMetadata: the
annotations, a few hundred bytes whatever the size of the fleet and of the budget); only when they show a free
slot (or work that is due) does it read the slots and write its own (one GET, one PUT). The node count a
percentage needs is refreshed every `budget_recount_seconds` by one agent, which takes the lease first, with
a list served from the API server's watch cache (resourceVersion=0). When the budget is spent, one agent per
`budget_grace_seconds` verifies the holders: it lists only the nodes labelled `<prefix>/tainted=true` (set in
the same write as the taint) and GETs the few slot holders that list lacks, so slots of nodes that are gone
or no longer tainted (an agent that died) come back. Nodes tainted without a slot (a ConfigMap deleted by
hand) are adopted as holders by either.

Records are other agents' words, judged here: their timestamps are other nodes' wall clocks, so a record is as
old as this agent's clock says (`record_age`), and one from the future (a clock running ahead) is stale, never
fresh for a year; a value that is not a finite, non-negative number in range is garbage (`Fleet.validated`): the
record counts as absent, so the nodes are counted again (logged once per garbage record), which never lifts
the budget (no taint beyond the limit) and never stalls it beyond that one recount.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

from agent.config import KubernetesConfig
from agent.kube.client import BudgetConflict, KubeApi, is_status
from agent.kube.policy import BLOCKING_EFFECTS, tainted_label_key

log = logging.getLogger("agent.kube")

LABELS = {"app.kubernetes.io/name": "node-health", "app.kubernetes.io/component": "taint-budget"}
# A record stamped this far ahead of this agent's clock is taken as written now (ordinary skew between nodes);
# further ahead, it is stale.
FUTURE_TOLERANCE_SECONDS = 5.0
# Far beyond any cluster Kubernetes supports (5,000 nodes; the largest managed ones 65,000): more is garbage.
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


@dataclass(frozen=True)
class BudgetResult:
    granted: bool
    used: int  # slots held after this call (ours included when granted)
    limit: int
    nodes: int
    wrote: bool = False
    counting: bool = False  # refused: a percentage and no node count yet (another agent is counting)


@dataclass(frozen=True)
class BudgetSettings:
    max_unhealthy: str
    selector: str
    grace_seconds: float
    recount_seconds: float
    lease_seconds: float
    prefix: str

    @classmethod
    def from_policy(cls, policy: KubernetesConfig) -> BudgetSettings:
        return cls(
            policy.max_unhealthy,
            policy.budget_node_selector,
            policy.budget_grace_seconds,
            policy.budget_recount_seconds,
            max(30.0, 3 * policy.request_timeout_seconds),
            policy.key_prefix,
        )

    @property
    def percentage(self) -> bool:
        return self.max_unhealthy.strip().endswith("%")


def budget_limit(max_unhealthy: str, nodes: int) -> int:
    """A count, or a percentage of nodes rounded up (10% of 5 nodes is 1, as for a DaemonSet's maxUnavailable)."""
    text = max_unhealthy.strip()
    if text.endswith("%"):
        return math.ceil(nodes * float(text[:-1]) / 100.0 - 1e-9)
    return int(float(text))


@dataclass(frozen=True)
class Fleet:
    """What the `<prefix>/fleet` annotation records."""

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
class Census:
    """What a list told: a full count (every eligible node) or a verification (only the tainted ones)."""

    at: float
    full: bool
    nodes: frozenset[str]  # full: every eligible node
    tainted: frozenset[str]  # nodes carrying a blocking taint of ours
    cleared: frozenset[str] = frozenset()  # verification: slot holders found gone or untainted
    selector: str = ""  # full: the selector it counted with


@dataclass
class _Read:
    slots: dict[str, str]
    fleet: Fleet
    version: str | None


def _acquired_at(raw: str) -> float:
    """When the slot was taken; 0 (long ago: prunable once its node is not tainted) when that is garbage."""
    try:
        return _finite(json.loads(raw).get("acquired_at", 0.0), "acquired_at")
    except (ValueError, AttributeError, TypeError, RecursionError):
        return 0.0


def _slot(now: float, taints: str) -> str:
    return json.dumps({"acquired_at": round(now, 3), "taints": taints}, sort_keys=True)


def _blocking(node: dict[str, Any], prefix: str) -> bool:
    return any(
        str(t.get("key", "")).startswith(prefix + "/") and t.get("effect") in BLOCKING_EFFECTS
        for t in (node.get("spec") or {}).get("taints") or []
    )


def apply_census(
    slots: dict[str, str], fleet: Fleet, census: Census, grace: float, now: float
) -> tuple[dict[str, str], Fleet]:
    """Slots and fleet record after a census: prune slots of nodes gone or untainted past the grace period,
    adopt tainted nodes without a slot. Pure."""
    kept: dict[str, str] = {}
    for node, raw in slots.items():
        young = record_age(_acquired_at(raw), now) <= grace  # taken, the taint is on its way
        if census.full and node not in census.nodes:
            continue  # gone, or out of the pool the budget counts
        if census.full and node not in census.tainted and not young:
            continue
        if node in census.cleared and not young:
            continue
        kept[node] = raw
    for node in sorted(census.tainted - set(kept)):
        kept[node] = _slot(now, "found tainted without a slot")
    if census.full:
        fleet = replace(
            fleet, nodes=len(census.nodes), selector=census.selector, counted_at=census.at, recount_by="", recount_at=0
        )
    return kept, replace(fleet, verified_at=census.at)


class TaintBudget:
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
        self._fleet_key, self._slots_key = f"{prefix}/fleet", f"{prefix}/slots"
        self._clock = clock
        self._on_write = on_write
        self.attempts = 10
        self._garbage_seen: str | None = None  # the garbage fleet record last logged

    # --- the ConfigMap -------------------------------------------------------------------------

    def _read(self) -> _Read:
        body = self._api.get_configmap(self.namespace, self.name)
        if body is None:
            return _Read({}, Fleet(), None)
        fleet = self._fleet((body["metadata"].get("annotations") or {}).get(self._fleet_key))
        return _Read(dict(body.get("data") or {}), fleet, body["metadata"]["resourceVersion"])

    def _fleet(self, raw: str | None) -> Fleet:
        """The fleet record, or none (so the nodes are counted again) when it is garbage; logged once."""
        try:
            return Fleet.validated(raw)
        except ValueError as exc:
            if raw != self._garbage_seen:
                self._garbage_seen = raw
                log.warning(
                    "kubernetes: taint budget %s/%s: fleet record is garbage (%s); counting the nodes again",
                    self.namespace,
                    self.name,
                    exc,
                )
            return Fleet()

    def peek(self, settings: BudgetSettings) -> BudgetResult | None:
        """A refusal read from the ConfigMap's metadata alone, when that is all there is to say: the slots are
        taken and no count or verification is due. None: read the slots (acquire)."""
        metadata = self._api.get_configmap_metadata(self.namespace, self.name)
        if metadata is None:
            return None
        annotations = metadata.get("annotations") or {}
        fleet = self._fleet(annotations.get(self._fleet_key))
        try:
            used = int(annotations.get(self._slots_key, ""))
        except ValueError:
            return None
        now = self._clock()
        limit = self._limit(fleet, settings)
        if self._count_due(fleet, settings, now) or used < limit or self._verify_due(fleet, settings, now):
            return None
        return BudgetResult(False, used, limit, fleet.nodes or 0)

    def _write(self, slots: dict[str, str], fleet: Fleet, version: str | None, what: str) -> str | None:
        """Compare-and-swap: the new resourceVersion, or None when somebody else wrote first."""
        annotations = {self._slots_key: str(len(slots))}
        if fleet != Fleet():
            annotations[self._fleet_key] = fleet.dump()
        metadata: dict[str, Any] = {
            "name": self.name,
            "namespace": self.namespace,
            "labels": LABELS,
            "annotations": annotations,
        }
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": dict(sorted(slots.items()))}
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

    # --- lists ---------------------------------------------------------------------------------

    def _count(self, settings: BudgetSettings) -> Census:
        items = self._api.list_nodes(settings.selector, from_cache=True)
        names = frozenset(item["metadata"]["name"] for item in items)
        tainted = frozenset(item["metadata"]["name"] for item in items if _blocking(item, settings.prefix))
        return Census(self._clock(), True, names, tainted, selector=settings.selector)

    def _verify(self, slots: dict[str, str], settings: BudgetSettings) -> Census:
        label = f"{tainted_label_key(settings.prefix)}=true"
        selector = f"{settings.selector},{label}" if settings.selector else label
        items = self._api.list_nodes(selector, from_cache=True)
        tainted = frozenset(i["metadata"]["name"] for i in items if _blocking(i, settings.prefix))
        now = self._clock()
        cleared = set()
        for node, raw in slots.items():
            if node in tainted or record_age(_acquired_at(raw), now) <= settings.grace_seconds:
                continue
            try:  # not labelled: gone, untainted, or tainted by a version that did not label
                if not _blocking(self._api.get_node(node), settings.prefix):
                    cleared.add(node)
            except Exception as exc:
                if not is_status(exc, 404):
                    raise
                cleared.add(node)
        return Census(now, False, frozenset(), tainted, frozenset(cleared))

    def _count_due(self, fleet: Fleet, settings: BudgetSettings, now: float) -> bool:
        stale = record_age(fleet.counted_at, now) > settings.recount_seconds
        return fleet.nodes is None or fleet.selector != settings.selector or stale

    def _verify_due(self, fleet: Fleet, settings: BudgetSettings, now: float) -> bool:
        return record_age(fleet.verified_at, now) > settings.grace_seconds

    def _lease_free(self, fleet: Fleet, settings: BudgetSettings, now: float) -> bool:
        expired = record_age(fleet.recount_at, now) > settings.lease_seconds
        return not fleet.recount_by or fleet.recount_by == self.node or expired

    # --- operations ----------------------------------------------------------------------------

    def acquire(
        self, settings: BudgetSettings, taints: str, already_tainted: bool = False, peek_first: bool = False
    ) -> BudgetResult:
        """Take (or confirm) this node's slot. A node already carrying a blocking taint always gets one.
        peek_first: the node knows it holds no slot (it was refused): a refusal may come from `peek`."""
        if peek_first and not already_tainted:
            refused = self.peek(settings)
            if refused is not None:
                return refused
        count: Census | None = None
        verification: Census | None = None
        for _ in range(self.attempts):
            state = self._read()
            now = self._clock()
            if self.node in state.slots:
                return BudgetResult(True, len(state.slots), self._limit(state.fleet, settings), state.fleet.nodes or 0)
            if count is None and self._count_due(state.fleet, settings, now):
                if self._lease_free(state.fleet, settings, now):
                    lease = replace(state.fleet, recount_by=self.node, recount_at=now)
                    version = self._write(state.slots, lease, state.version, "counting the nodes")
                    if version is None:
                        continue
                    state = _Read(state.slots, lease, version)
                    count = self._count(settings)
                elif state.fleet.nodes is None and settings.percentage and not already_tainted:
                    return BudgetResult(False, len(state.slots), 0, 0, counting=True)
            slots, fleet = dict(state.slots), state.fleet
            for census in (count, verification):
                if census is not None:
                    slots, fleet = apply_census(slots, fleet, census, settings.grace_seconds, now)
            limit = self._limit(fleet, settings)
            spent = len(slots) >= limit and not already_tainted
            if spent and count is None and verification is None and self._verify_due(fleet, settings, now):
                verification = self._verify(slots, settings)
                slots, fleet = apply_census(slots, fleet, verification, settings.grace_seconds, now)
                spent = len(slots) >= limit
            if not spent:
                slots[self.node] = _slot(now, taints)
            if (slots, fleet) == (state.slots, state.fleet):
                return BudgetResult(False, len(slots), limit, fleet.nodes or 0)
            what = f"took a slot ({len(slots)} of {limit}) for {taints}" if not spent else "verified the holders"
            if self._write(slots, fleet, state.version, what) is not None:
                return BudgetResult(not spent, len(slots), limit, fleet.nodes or 0, wrote=True)
        raise BudgetConflict(f"configmap {self.namespace}/{self.name}: {self.attempts} compare-and-swap attempts lost")

    def _limit(self, fleet: Fleet, settings: BudgetSettings) -> int:
        return budget_limit(settings.max_unhealthy, fleet.nodes or 0)

    def release(self) -> bool:
        """Give the slot back; True when a write happened."""
        return bool(self.release_nodes([self.node], "released this node's slot"))

    def release_nodes(self, nodes: Collection[str] | None, what: str = "") -> list[str]:
        """Remove these nodes' slots (None: every slot and the fleet record); the nodes released."""
        for _ in range(self.attempts):
            state = self._read()
            if state.version is None:
                return []
            gone = sorted(state.slots if nodes is None else set(nodes) & set(state.slots))
            if not gone and (nodes is not None or state.fleet == Fleet()):
                return []
            slots = {n: raw for n, raw in state.slots.items() if n not in gone}
            fleet = Fleet() if nodes is None else state.fleet
            if self._write(slots, fleet, state.version, what or f"released {len(gone)} slots") is not None:
                return gone
        raise BudgetConflict(f"configmap {self.namespace}/{self.name}: {self.attempts} compare-and-swap attempts lost")

    def holders(self) -> list[str]:
        """The nodes holding a slot now (read-only)."""
        return sorted(self._read().slots)

    def usage(self, settings: BudgetSettings) -> BudgetResult:
        """What acquire would answer, read-only (dry run): counts the nodes itself when no count is fresh."""
        state = self._read()
        slots, fleet, now = state.slots, state.fleet, self._clock()
        if self._count_due(fleet, settings, now):
            slots, fleet = apply_census(slots, fleet, self._count(settings), settings.grace_seconds, now)
        limit = self._limit(fleet, settings)
        held = self.node in slots
        granted = held or len(slots) < limit
        return BudgetResult(granted, len(slots) + (0 if held else int(granted)), limit, fleet.nodes or 0)
