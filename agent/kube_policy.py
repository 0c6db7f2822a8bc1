"""What the Node should carry, computed from one health snapshot: a pure function, no API.

Per category (npu, gpu, storage, network, time, host) one taint intent and one condition intent; one
`<prefix>/ready` label intent; and the events findings ask for. An intent may be "hold": keep whatever
the Node carries now, because the agent has no fresh result to decide on (start-up, stale results) —
that is what keeps a restart from flapping a node.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from agent.config import KubernetesConfig
from agent.state import CONDITION_TYPES, STALE, WARMING_UP, CheckState, Snapshot, matches_any
from probes.base import CATEGORIES, Finding, Status

BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
# Stronger first: the category's single taint takes the strongest effect its problems ask for.
EFFECT_RANK = {"NoExecute": 0, "NoSchedule": 1, "PreferNoSchedule": 2}
NO_FRESH_RESULT = frozenset({WARMING_UP, STALE})
HEALTHY = "Healthy"
MESSAGE_LIMIT = 1024


@dataclass(frozen=True)
class TaintIntent:
    category: str
    action: Literal["set", "hold", "none"]
    reason: str = ""
    effect: str = ""
    message: str = ""

    @property
    def blocking(self) -> bool:
        return self.action == "set" and self.effect in BLOCKING_EFFECTS


@dataclass(frozen=True)
class ConditionIntent:
    category: str
    type: str
    # hold: keep the Node's condition if it has one, else write Unknown/WarmingUp.
    action: Literal["set", "hold", "absent"]
    status: str = ""
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class FindingEvent:
    check: str
    subject: str
    reason: str
    message: str
    warning: bool


@dataclass(frozen=True)
class Desired:
    taints: tuple[TaintIntent, ...]
    conditions: tuple[ConditionIntent, ...]
    ready_label: str | None  # "true" / "false"; None: hold
    events: tuple[FindingEvent, ...]


def taint_key(prefix: str, category: str) -> str:
    return f"{prefix}/{category}"


def ready_label_key(prefix: str) -> str:
    return f"{prefix}/ready"


def effect_for(finding: Finding, policy: KubernetesConfig) -> str:
    if finding.status == Status.WARN:
        return policy.warn_effect
    return policy.effects.get(finding.reason, policy.default_effect)


def _ignored(finding: Finding, policy: KubernetesConfig) -> bool:
    return finding.reason in policy.disabled_reasons or matches_any(finding.check, policy.disabled_checks)


def _check_disabled(finding: Finding, policy: KubernetesConfig) -> bool:
    return matches_any(finding.check, policy.disabled_checks)


def _counts(finding: Finding, policy: KubernetesConfig) -> bool:
    """A finding whose reason is disabled is not a problem on the Node (it still is over HTTP)."""
    return finding.reason not in policy.disabled_reasons


def _describe(states: Collection[CheckState]) -> str:
    parts = []
    for state in states:
        f = state.finding
        where = f"{f.check} {f.subject}".strip()
        parts.append(f"{where}: {f.reason}: {f.message}")
    return _clip("; ".join(parts))


def _clip(text: str) -> str:
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 1] + "…"


def _severity(state: CheckState, policy: KubernetesConfig) -> tuple[int, int, str, str]:
    status_rank = 0 if state.finding.status == Status.FAIL else 1
    effect = effect_for(state.finding, policy)
    return (EFFECT_RANK.get(effect, 3), status_rank, state.finding.reason, state.finding.check)


def category_intents(
    category: str, states: Collection[CheckState], policy: KubernetesConfig
) -> tuple[TaintIntent, ConditionIntent]:
    condition_type = CONDITION_TYPES[category]
    relevant = [s for s in states if s.finding.status != Status.SKIP and not _check_disabled(s.finding, policy)]
    if not relevant:
        return TaintIntent(category, "none"), ConditionIntent(category, condition_type, "absent")
    counted = [s for s in relevant if _counts(s.finding, policy)]

    failing = sorted((s for s in counted if s.finding.status == Status.FAIL), key=lambda s: _severity(s, policy))
    warning = sorted((s for s in counted if s.finding.status == Status.WARN), key=lambda s: _severity(s, policy))
    unknown = [s for s in counted if s.finding.status == Status.UNKNOWN]
    no_fresh = [s for s in unknown if s.finding.reason in NO_FRESH_RESULT]

    tainting = sorted(
        (s for s in failing + warning if effect_for(s.finding, policy) != "None"), key=lambda s: _severity(s, policy)
    )
    if tainting:
        worst = tainting[0]
        taint = TaintIntent(
            category, "set", worst.finding.reason, effect_for(worst.finding, policy), _describe(tainting)
        )
    elif no_fresh:
        taint = TaintIntent(category, "hold")  # taints of a previous run stay until fresh results decide
    else:
        taint = TaintIntent(category, "none")

    if failing:
        condition = ConditionIntent(
            category, condition_type, "set", "False", failing[0].finding.reason, _describe(failing)
        )
    elif unknown and all(s.finding.reason == WARMING_UP for s in unknown):
        condition = ConditionIntent(category, condition_type, "hold", "Unknown", WARMING_UP, _describe(unknown))
    elif unknown:
        first = sorted(unknown, key=lambda s: (s.finding.reason != STALE, s.finding.reason))[0]
        condition = ConditionIntent(
            category, condition_type, "set", "Unknown", first.finding.reason, _describe(unknown)
        )
    elif warning:
        condition = ConditionIntent(
            category, condition_type, "set", "True", warning[0].finding.reason, _describe(warning)
        )
    else:
        ignored = [s for s in relevant if not _counts(s.finding, policy) and s.finding.status != Status.OK]
        message = f"{len(relevant) - len(ignored)} of {len(relevant)} checks passed"
        if ignored:
            message += f"; disabled by kubernetes.disabled_reasons: {_describe(ignored)}"
        condition = ConditionIntent(category, condition_type, "set", "True", HEALTHY, _clip(message))
    return taint, condition


def desired_state(snapshot: Snapshot, policy: KubernetesConfig) -> Desired:
    grouped = snapshot.categories()
    taints, conditions = [], []
    for category in CATEGORIES:
        taint, condition = category_intents(category, grouped.get(category, ()), policy)
        taints.append(taint)
        conditions.append(condition)

    ready_label: str | None
    if snapshot.warming_up:
        ready_label = None
    else:
        blocking = [f for f in snapshot.verdict.reasons if not _ignored(f, policy)]
        ready_label = "false" if blocking else "true"

    events = []
    for state in snapshot.checks:
        wanted = state.finding.event
        if wanted is not None:
            events.append(
                FindingEvent(state.finding.check, state.finding.subject, wanted.reason, wanted.message, wanted.warning)
            )
    return Desired(tuple(taints), tuple(conditions), ready_label, tuple(events))
