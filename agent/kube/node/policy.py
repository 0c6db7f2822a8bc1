"""What the Node should carry, computed from one health snapshot: a pure function, no API.

Per category (npu, gpu, storage, network, interconnect, time, host) one taint intent and one condition intent; one
`<prefix>/ready` label intent; and the events findings ask for. An intent may be "hold": keep whatever
the Node carries now, because the agent has no fresh result to decide on (start-up, stale results) —
that is what keeps a restart from flapping a node.

Conditions read right in `kubectl describe node`: `True` always has reason `Healthy` (warnings are listed
in the message, "warn: ClockUnsynced (time.sync)"); `False` has the worst failing reason; `Unknown` has the
reason there is no verdict (WarmingUp, Stale, ProbeTimeout...).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Literal

from agent.config import KubernetesConfig
from agent.ready import matches_finding
from agent.reasons import NO_FRESH_RESULT, STALE, WARMING_UP
from agent.snapshot import CheckState, Snapshot
from probes.base import CATEGORIES, Finding, Status
from probes.text import clip

BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
# Stronger first: the category's single taint takes the strongest effect its problems ask for.
EFFECT_RANK = {"NoExecute": 0, "NoSchedule": 1, "PreferNoSchedule": 2}
HEALTHY = "Healthy"
MESSAGE_LIMIT = 1024
# The head of a condition message that says which problems the condition has: a change of it is a change of
# the condition (written at once); the rest of the message (what the probes measured) waits for the heartbeat.
SUMMARY_LIMIT = 300
DETAILS = " — "  # between the summary and the measured details


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
    summary: str = ""
    message: str = ""  # starts with summary


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
    # Node annotations the agent owns (key, value; None: remove): `<prefix>/isolated-devices`.
    annotations: tuple[tuple[str, str | None], ...] = ()

    def fingerprint(self) -> tuple[object, ...]:
        """What decides a write; message details only ride along (they change with every number measured)."""
        return (
            tuple((t.category, t.action, t.reason, t.effect) for t in self.taints),
            tuple((c.type, c.action, c.status, c.reason, c.summary) for c in self.conditions),
            self.ready_label,
            self.annotations,
        )


def taint_key(prefix: str, category: str) -> str:
    return f"{prefix}/{category}"


def ready_label_key(prefix: str) -> str:
    return f"{prefix}/ready"


def isolated_devices_key(prefix: str) -> str:
    """The Node annotation that lists the node's isolated devices and how each is isolated."""
    return f"{prefix}/isolated-devices"


def tainted_label_key(prefix: str) -> str:
    """Present ("true") exactly while the node carries a NoSchedule/NoExecute taint of ours: what the budget
    lists, with a label selector, instead of every node of the cluster."""
    return f"{prefix}/tainted"


def effect_for(finding: Finding, policy: KubernetesConfig) -> str:
    if finding.status == Status.WARN:
        return policy.warn_effect
    return policy.effects.get(finding.reason, policy.default_effect)


def _ignored(finding: Finding, policy: KubernetesConfig) -> bool:
    return finding.reason in policy.disabled_reasons or matches_finding(finding, policy.disabled_checks)


def _counts(finding: Finding, policy: KubernetesConfig) -> bool:
    """A finding whose reason is disabled is not a problem on the Node (it still is over HTTP)."""
    return finding.reason not in policy.disabled_reasons


def _details(states: Iterable[CheckState], with_reason: bool = True) -> str:
    parts = []
    for state in states:
        f = state.finding
        where = f"{f.check} {f.subject}".strip()
        parts.append(f"{where}: {f.reason}: {f.message}" if with_reason else f"{where}: {f.message}")
    return "; ".join(parts)


def _named(label: str, states: Collection[CheckState]) -> str:
    """ "fail: MountMissing (storage.mounts), DiskFull (storage.space)": stable while the problems are."""
    if not states:
        return ""
    names = dict.fromkeys(f"{s.finding.reason} ({s.finding.check})" for s in states)
    return f"{label}: {', '.join(names)}"


def _severity(state: CheckState, policy: KubernetesConfig) -> tuple[int, int, str, str]:
    status_rank = 0 if state.finding.status == Status.FAIL else 1
    effect = effect_for(state.finding, policy)
    return (EFFECT_RANK.get(effect, 3), status_rank, state.finding.reason, state.finding.check)


def _condition(
    category: str,
    reason: str,
    status: str,
    summary_parts: list[str],
    details: str,
    action: Literal["set", "hold"] = "set",
) -> ConditionIntent:
    summary = clip("; ".join(p for p in summary_parts if p), SUMMARY_LIMIT)
    message = clip(f"{summary}{DETAILS}{details}" if details else summary, MESSAGE_LIMIT)
    return ConditionIntent(category, CATEGORIES[category].condition_type, action, status, reason, summary, message)


def category_intents(
    category: str, states: Collection[CheckState], policy: KubernetesConfig
) -> tuple[TaintIntent, ConditionIntent]:
    condition_type = CATEGORIES[category].condition_type
    disabled = policy.disabled_checks
    relevant = [s for s in states if s.finding.status != Status.SKIP and not matches_finding(s.finding, disabled)]
    if not relevant:
        return TaintIntent(category, "none"), ConditionIntent(category, condition_type, "absent")
    counted = [s for s in relevant if _counts(s.finding, policy)]
    failing = sorted((s for s in counted if s.finding.status == Status.FAIL), key=lambda s: _severity(s, policy))
    warning = sorted((s for s in counted if s.finding.status == Status.WARN), key=lambda s: _severity(s, policy))
    unknown = [s for s in counted if s.finding.status == Status.UNKNOWN]
    return _taint_intent(category, failing, warning, unknown, policy), _condition_intent(
        category, relevant, failing, warning, unknown, policy
    )


def _taint_intent(
    category: str,
    failing: list[CheckState],
    warning: list[CheckState],
    unknown: list[CheckState],
    policy: KubernetesConfig,
) -> TaintIntent:
    tainting = sorted(
        (s for s in failing + warning if effect_for(s.finding, policy) != "None"), key=lambda s: _severity(s, policy)
    )
    if tainting:
        worst = tainting[0].finding
        return TaintIntent(
            category, "set", worst.reason, effect_for(worst, policy), clip(_details(tainting), MESSAGE_LIMIT)
        )
    if any(s.finding.reason in NO_FRESH_RESULT for s in unknown):
        return TaintIntent(category, "hold")  # taints of a previous run stay until fresh results decide
    return TaintIntent(category, "none")


def _condition_intent(
    category: str,
    relevant: list[CheckState],
    failing: list[CheckState],
    warning: list[CheckState],
    unknown: list[CheckState],
    policy: KubernetesConfig,
) -> ConditionIntent:
    warned = _named("warn", warning)
    if failing:
        return _condition(
            category, failing[0].finding.reason, "False", [_named("fail", failing), warned], _details(failing, False)
        )
    if unknown and all(s.finding.reason == WARMING_UP.code for s in unknown):
        return _condition(category, WARMING_UP.code, "Unknown", [_named("unknown", unknown)], "", action="hold")
    if unknown:
        first = sorted(unknown, key=lambda s: (s.finding.reason != STALE.code, s.finding.reason))[0]
        return _condition(
            category, first.finding.reason, "Unknown", [_named("unknown", unknown), warned], _details(unknown, False)
        )
    ignored = [s for s in relevant if not _counts(s.finding, policy) and s.finding.status != Status.OK]
    passed = f"{len(relevant) - len(ignored)} of {len(relevant)} checks passed"
    details = _details(warning, False)
    if ignored:
        details = "; ".join(p for p in (details, f"disabled by kubernetes.disabled_reasons: {_details(ignored)}") if p)
    return _condition(category, HEALTHY, "True", [warned, passed], details)


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
