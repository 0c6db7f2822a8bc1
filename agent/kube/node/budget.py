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

The ConfigMap mechanism (reads, metadata peeks, compare-and-swap, the fleet record and how its records are
judged: from the future, stale; garbage, counted again) is the device budget's too: agent.kube.slots.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from agent.config import KubernetesConfig
from agent.kube.client import is_status
from agent.kube.node.policy import BLOCKING_EFFECTS, tainted_label_key
from agent.kube.slots import Fleet, SlotBudget, SlotSettings, record_age, stamp

LABELS = {"app.kubernetes.io/name": "node-health", "app.kubernetes.io/component": "taint-budget"}


@dataclass(frozen=True)
class BudgetResult:
    granted: bool
    used: int  # slots held after this call (ours included when granted)
    limit: int
    nodes: int
    wrote: bool = False
    counting: bool = False  # refused: a percentage and no node count yet (another agent is counting)


@dataclass(frozen=True)
class BudgetSettings(SlotSettings):
    @classmethod
    def from_policy(cls, policy: KubernetesConfig) -> BudgetSettings:
        return cls(*cls.shared(policy, policy.max_unhealthy))


@dataclass(frozen=True)
class Census:
    """What a list told: a full count (every eligible node) or a verification (only the tainted ones)."""

    at: float
    full: bool
    nodes: frozenset[str]  # full: every eligible node
    tainted: frozenset[str]  # nodes carrying a blocking taint of ours
    cleared: frozenset[str] = frozenset()  # verification: slot holders found gone or untainted
    selector: str = ""  # full: the selector it counted with


def _acquired_at(raw: str) -> float:
    """When the slot was taken; 0 (long ago: prunable once its node is not tainted) when that is garbage."""
    try:
        return stamp(json.loads(raw).get("acquired_at", 0.0))
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


class TaintBudget(SlotBudget[str]):
    """The node taint budget: a slot is the raw JSON of `_slot`, kept as written (one per node)."""

    LABELS: ClassVar[dict[str, str]] = LABELS
    SLOTS_KEY, FLEET_KEY, KIND = "slots", "fleet", "taint budget"

    def _decode(self, raw: str) -> str:
        return raw

    def _encode(self, slot: str) -> str:
        return slot

    def _size(self, slot: str) -> int:
        return 1

    def peek(self, settings: BudgetSettings) -> BudgetResult | None:
        """A refusal read from the ConfigMap's metadata alone, when that is all there is to say: the slots are
        taken and no count or verification is due. None: read the slots (acquire)."""
        refused = self._refusal(settings)
        return None if refused is None else BudgetResult(False, *refused)

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
                    leased = self._lease(state, now, "counting the nodes")
                    if leased is None:
                        continue
                    state, count = leased, self._count(settings)
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
        raise self._lost()

    def release(self) -> bool:
        """Give the slot back; True when a write happened."""
        return bool(self.release_nodes([self.node], "released this node's slot"))

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
