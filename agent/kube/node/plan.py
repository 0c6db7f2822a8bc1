"""The patch to send, computed from a health snapshot, the Node as read and the policy: pure, no I/O.

`plan()` answers, for one Node object: the taint list, the labels and the conditions to write (each as the
strategic-merge body the API takes), the Events that go with the changes, and what the cluster taint budget
must do (take a slot before a first NoSchedule/NoExecute taint, give it back after the last one). The
reconciler (`agent.kube.reconciler`) only performs what a plan says.

Ownership: only taints `<prefix>/<category>`, the labels `<prefix>/ready` and `<prefix>/tainted`, and the
conditions of the categories are ever in a plan; every other taint, label and condition is left as read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from agent.config import KubernetesConfig
from agent.kube.node.policy import (
    BLOCKING_EFFECTS,
    DETAILS,
    MESSAGE_LIMIT,
    ConditionIntent,
    Desired,
    desired_state,
    ready_label_key,
    taint_key,
    tainted_label_key,
)
from agent.reasons import WARMING_UP
from agent.snapshot import Snapshot
from agent.timestamps import rfc3339
from probes.base import CATEGORIES
from probes.text import clip

TAINT_SUPPRESSED = "TaintSuppressedByBudget"
# kube-apiserver refuses (422) an object whose annotations, keys and values together, pass this many bytes.
ANNOTATIONS_LIMIT = 256 * 1024


@dataclass(frozen=True)
class SlotView:
    """What the reconciler knows of this node's budget slot. unknown: not asked since start (a previous run
    may hold one); denied: asked recently and refused (used/limit say why)."""

    state: Literal["held", "free", "unknown", "denied"] = "unknown"
    used: int = 0
    limit: int = 0
    counting: bool = False  # refused because no one has counted the nodes yet


@dataclass(frozen=True)
class PlannedEvent:
    reason: str
    message: str
    warning: bool


@dataclass(frozen=True)
class Plan:
    # "acquire": the plan adds a first blocking taint and needs a slot first (plan again with the answer);
    # "register": the node already carries one (a previous run's) and its slot is not known to be held.
    slot_request: Literal["", "acquire", "register"] = ""
    node_patch: dict[str, Any] | None = None  # PATCH nodes/{name}: taints + labels, resourceVersion-guarded
    node_change: str = ""
    status_patch: dict[str, Any] | None = None  # PATCH nodes/{name}/status: conditions merged by type
    status_change: str = ""
    events: tuple[PlannedEvent, ...] = ()
    blocking: bool = False  # after the node patch the node carries a NoSchedule/NoExecute taint of ours
    release: bool = False  # give the slot back once the node patch is done
    suppressed: Mapping[str, str] = field(default_factory=dict)  # category → reason of a withheld taint
    blocking_taints: str = ""  # "network=DnsFailed,npu=..." for the budget's bookkeeping


def plan(
    snapshot: Snapshot,
    node: Mapping[str, Any],
    policy: KubernetesConfig,
    *,
    now: float,
    slot: SlotView = SlotView(),
    heartbeat: bool = False,
) -> Plan:
    return plan_desired(desired_state(snapshot, policy), node, policy, now=now, slot=slot, heartbeat=heartbeat)


@dataclass(frozen=True)
class _Taints:
    request: Literal["", "acquire", "register"]
    new: list[dict[str, Any]]
    changed: bool
    blocking: bool
    suppressed: dict[str, str]
    blocking_taints: str


def plan_desired(
    desired: Desired,
    node: Mapping[str, Any],
    policy: KubernetesConfig,
    *,
    now: float,
    slot: SlotView = SlotView(),
    heartbeat: bool = False,
) -> Plan:
    taints = _plan_taints(desired, node, policy, slot)
    if taints.request == "acquire":
        return Plan(slot_request="acquire", blocking_taints=taints.blocking_taints)
    node_patch, node_change = _node_patch(desired, node, policy, taints)
    status_patch, status_change, events = _plan_conditions(
        desired, node, policy, now, taints.suppressed, slot, heartbeat
    )
    return Plan(
        slot_request=taints.request,
        node_patch=node_patch,
        node_change=node_change,
        status_patch=status_patch,
        status_change=status_change,
        events=events,
        blocking=taints.blocking,
        release=not taints.blocking and slot.state in ("held", "unknown"),
        suppressed=taints.suppressed,
        blocking_taints=taints.blocking_taints,
    )


def _taint_id(taint: Mapping[str, Any]) -> tuple[str, str, str]:
    return (taint.get("key", ""), taint.get("value", "") or "", taint.get("effect", ""))


def _fmt(taint: Mapping[str, Any]) -> str:
    return f"{taint.get('key')}={taint.get('value', '') or ''}:{taint.get('effect')}"


def _plan_taints(desired: Desired, node: Mapping[str, Any], policy: KubernetesConfig, slot: SlotView) -> _Taints:
    owned = {taint_key(policy.key_prefix, category): category for category in CATEGORIES}
    current: list[dict[str, Any]] = list((node.get("spec") or {}).get("taints") or [])
    ours: dict[str, dict[str, Any]] = {}
    for taint in current:
        if taint.get("key") in owned:
            ours.setdefault(owned[taint["key"]], taint)
    planned: dict[str, dict[str, Any]] = {}
    for intent in desired.taints:
        existing = ours.get(intent.category)
        if intent.action == "set":
            wanted = {
                "key": taint_key(policy.key_prefix, intent.category),
                "value": intent.reason,
                "effect": intent.effect,
            }
            same = existing is not None and _taint_id(existing) == _taint_id(wanted)
            planned[intent.category] = existing if same and existing is not None else wanted
        elif intent.action == "hold" and existing is not None:
            planned[intent.category] = existing

    had_blocking = any(t.get("effect") in BLOCKING_EFFECTS for t in ours.values())
    wants_blocking = [c for c, t in planned.items() if t.get("effect") in BLOCKING_EFFECTS]
    names = ",".join(f"{c}={planned[c].get('value', '')}" for c in sorted(wants_blocking))
    request: Literal["", "acquire", "register"] = ""
    suppressed: dict[str, str] = {}
    if wants_blocking and not had_blocking:
        if slot.state == "denied":
            suppressed = {c: planned.pop(c).get("value", "") for c in wants_blocking}
        elif slot.state != "held":
            return _Taints("acquire", current, False, False, {}, names)
    elif wants_blocking and slot.state != "held":
        request = "register"  # a node tainted by a previous run keeps its taint and records its slot

    new: list[dict[str, Any]] = []
    placed: set[str] = set()
    for taint in current:  # the list keeps its order: another controller's taints stay where they are
        category = owned.get(taint.get("key", ""))
        if category is None:
            new.append(taint)
        elif category in planned and category not in placed:
            new.append(planned[category])
            placed.add(category)
    new.extend(planned[c] for c in CATEGORIES if c in planned and c not in placed)
    blocking = any(t.get("effect") in BLOCKING_EFFECTS for c, t in planned.items())
    return _Taints(request, new, new != current, blocking, suppressed, names)


def _node_patch(
    desired: Desired, node: Mapping[str, Any], policy: KubernetesConfig, taints: _Taints
) -> tuple[dict[str, Any] | None, str]:
    metadata = node.get("metadata") or {}
    labels = metadata.get("labels") or {}
    ready_key, tainted_key = ready_label_key(policy.key_prefix), tainted_label_key(policy.key_prefix)
    wanted_labels: dict[str, str | None] = {
        ready_key: desired.ready_label if desired.ready_label is not None else labels.get(ready_key, "false"),
        tainted_key: "true" if taints.blocking else None,
    }
    label_patch = {key: value for key, value in wanted_labels.items() if labels.get(key) != value}
    annotations = metadata.get("annotations") or {}
    annotation_patch = {key: value for key, value in desired.annotations if annotations.get(key) != value}
    withheld = _over_annotation_limit(annotations, annotation_patch)
    for key in withheld:
        del annotation_patch[key]
    if not taints.changed and not label_patch and not annotation_patch:
        return None, ""
    patch: dict[str, Any] = {"metadata": {"resourceVersion": metadata.get("resourceVersion")}}
    if taints.changed:
        patch["spec"] = {"taints": taints.new}
    if label_patch:
        patch["metadata"]["labels"] = label_patch
    if annotation_patch:
        patch["metadata"]["annotations"] = annotation_patch
    owned = {taint_key(policy.key_prefix, category) for category in CATEGORIES}
    current = (node.get("spec") or {}).get("taints") or []
    before = {_fmt(t) for t in current if t.get("key") in owned}
    after = {_fmt(t) for t in taints.new if t.get("key") in owned}
    parts = [f"+taint {t}" for t in sorted(after - before)] + [f"-taint {t}" for t in sorted(before - after)]
    parts += [f"label {k}={v}" if v is not None else f"-label {k}" for k, v in label_patch.items()]
    parts += [f"annotation {k}" if v is not None else f"-annotation {k}" for k, v in annotation_patch.items()]
    parts += [
        f"annotation {k} not written: the Node's annotations would pass {ANNOTATIONS_LIMIT} bytes" for k in withheld
    ]
    return patch, ", ".join(parts) or "taint order"


def _over_annotation_limit(current: Mapping[str, Any], patch: Mapping[str, str | None]) -> list[str]:
    """The patched annotations that would take the Node's past the API server's 256 KiB (keys and values, all
    together; it refuses the whole write with 422): checked before sending, so taints and labels still go."""
    after = {**current, **patch}
    total = sum(len(k.encode()) + len(str(v).encode()) for k, v in after.items() if v is not None)
    if total <= ANNOTATIONS_LIMIT:
        return []
    return [k for k, v in patch.items() if v is not None]


def _suppressed_intent(
    intent: ConditionIntent, policy: KubernetesConfig, reason: str, slot: SlotView
) -> ConditionIntent:
    """False with the failing reason; the head of the message says the taint was withheld, and why. The slot
    counts change while nothing else does: they go after the summary, with the measured details."""
    why = "the cluster taint budget is being counted" if slot.counting else "the cluster taint budget is spent"
    summary = clip(
        f"taint {taint_key(policy.key_prefix, intent.category)}={reason} withheld: {why}; {intent.summary}",
        MESSAGE_LIMIT,
    )
    details = intent.message[len(intent.summary) :].removeprefix(DETAILS)
    if not slot.counting:
        details = f"{slot.used} of {slot.limit} slots taken" + (f"; {details}" if details else "")
    return ConditionIntent(
        intent.category,
        intent.type,
        intent.action,
        intent.status,
        intent.reason,
        summary,
        clip(f"{summary}{DETAILS}{details}" if details else summary, MESSAGE_LIMIT),
    )


def _plan_conditions(
    desired: Desired,
    node: Mapping[str, Any],
    policy: KubernetesConfig,
    now: float,
    suppressed: Mapping[str, str],
    slot: SlotView,
    heartbeat: bool,
) -> tuple[dict[str, Any] | None, str, tuple[PlannedEvent, ...]]:
    existing = {c.get("type"): c for c in (node.get("status") or {}).get("conditions") or []}
    stamp = rfc3339(now)
    items: list[dict[str, Any]] = []
    events: list[PlannedEvent] = []
    for intent in desired.conditions:
        old = existing.get(intent.type)
        if intent.action == "absent":
            if old is not None:
                items.append({"type": intent.type, "$patch": "delete"})
            continue
        if intent.action == "hold" and old is not None:
            continue  # a previous run's condition stands until this run has results
        if intent.category in suppressed:
            intent = _suppressed_intent(intent, policy, suppressed[intent.category], slot)
        status, reason = ("Unknown", WARMING_UP.code) if intent.action == "hold" else (intent.status, intent.reason)
        changed = (
            old is None
            or old.get("status") != status
            or old.get("reason") != reason
            or not str(old.get("message") or "").startswith(intent.summary)
        )
        if not changed and not heartbeat:
            continue
        flipped = old is None or old.get("status") != status
        items.append(
            {
                "type": intent.type,
                "status": status,
                "reason": reason,
                "message": intent.message,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp if flipped else (old or {}).get("lastTransitionTime") or stamp,
            }
        )
        if changed and not (old is None and status != "False"):  # a condition appearing healthy is no news
            before = old.get("status") if old else "absent"
            event_reason = TAINT_SUPPRESSED if intent.category in suppressed else reason
            text = clip(f"{intent.type}: {before} -> {status}: {intent.message}", MESSAGE_LIMIT)
            events.append(PlannedEvent(event_reason, text, status == "False"))
    if not items:
        return None, "", ()
    change = ", ".join(
        f"{i['type']}=" + ("(removed)" if i.get("$patch") else f"{i['status']}/{i['reason']}") for i in items
    )
    return _ordered(items, list(existing)), change, tuple(events)


def _ordered(items: list[dict[str, Any]], current: list[Any]) -> dict[str, Any]:
    """The conditions patch with `$setElementOrder/conditions`: every condition where it is (foreign ones untouched,
    in place), new ones after them. Without it kube-apiserver's strategic merge puts the patched conditions before
    the others; with it the patch's own items must come in the same order (else 500)."""
    removed = {i["type"] for i in items if i.get("$patch") == "delete"}
    order = [t for t in current if t not in removed]
    order += [i["type"] for i in items if i["type"] not in removed and i["type"] not in order]
    position = {t: n for n, t in enumerate(order)}
    items = sorted(items, key=lambda i: position.get(i["type"], len(order)))
    return {"status": {"$setElementOrder/conditions": [{"type": t} for t in order], "conditions": items}}


# --- cleanup ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CleanupPlan:
    node_patch: dict[str, Any] | None
    status_patch: dict[str, Any] | None
    removed: tuple[str, ...]  # "taint node-health/npu=X:NoSchedule", "label node-health/ready", "condition NPUHealthy"


def plan_cleanup(node: Mapping[str, Any], prefix: str) -> CleanupPlan:
    """Everything this agent put on the Node, to remove: taints and labels under `<prefix>/`, its conditions."""
    metadata = node.get("metadata") or {}
    current = list((node.get("spec") or {}).get("taints") or [])
    mine = [t for t in current if str(t.get("key", "")).startswith(prefix + "/")]
    labels = sorted(k for k in (metadata.get("labels") or {}) if k.startswith(prefix + "/"))
    annotations = sorted(k for k in (metadata.get("annotations") or {}) if k.startswith(prefix + "/"))
    ours = {category.condition_type for category in CATEGORIES.values()}
    conditions = [c.get("type") for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") in ours]
    node_patch: dict[str, Any] | None = None
    if mine or labels or annotations:
        node_patch = {"metadata": {"resourceVersion": metadata.get("resourceVersion")}}
        if mine:
            node_patch["spec"] = {"taints": [t for t in current if t not in mine]}
        if labels:
            node_patch["metadata"]["labels"] = dict.fromkeys(labels)
        if annotations:
            node_patch["metadata"]["annotations"] = dict.fromkeys(annotations)
    status_patch = (
        {"status": {"conditions": [{"type": t, "$patch": "delete"} for t in conditions]}} if conditions else None
    )
    removed = (
        *(f"taint {_fmt(t)}" for t in mine),
        *(f"label {k}" for k in labels),
        *(f"annotation {k}" for k in annotations),
        *(f"condition {t}" for t in conditions),
    )
    return CleanupPlan(node_patch, status_patch, removed)
