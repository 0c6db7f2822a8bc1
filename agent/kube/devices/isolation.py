"""How each bad device is isolated, and what that leaves for the Node to carry: pure, no I/O.

`decide` picks one mechanism per device that asks to be isolated (`devices.device_wants`):

- `public_fault`: an NPU, with MindCluster public faults on (`kubernetes.mindcluster.public_fault.enabled`);
- `dra`: a DeviceTaintRule per device a ResourceSlice of this node publishes for it, where the cluster serves
  DeviceTaintRules;
- otherwise the fallback `kubernetes.device_fallback` names: `node` (the category's node taint, as for any
  problem), `prefer` (PreferNoSchedule while few of the node's devices are bad), `none` (the pre-flight only).

The device budget may turn a `dra` or `public_fault` isolation into `withheld` (the isolator decides that).
`adjust_desired` then takes the devices isolated finer than the node out of the node's taints, names each device
and how it is isolated in its category's condition, and writes the list to the `<prefix>/isolated-devices`
annotation; node-wide problems (npu-smi failing, storage, network, ...) taint the node as before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agent.config import KubernetesConfig
from agent.kube.devices.match import (
    DeviceRef,
    Identity,
    Published,
    Want,
    matching,
    rule_name,
    rule_spec,
)
from agent.kube.devices.publicfault import ActiveFault, FaultKey
from agent.kube.node.policy import (
    BLOCKING_EFFECTS,
    DETAILS,
    EFFECT_RANK,
    MESSAGE_LIMIT,
    SUMMARY_LIMIT,
    ConditionIntent,
    Desired,
    TaintIntent,
    category_intents,
    isolated_devices_key,
)
from agent.snapshot import Snapshot
from probes.text import clip

# A device's `why` in the annotation (an API error message can be long), and the annotation's own budget of the
# 256 KiB a Node's annotations may take in all.
WHY_LIMIT = 300
ANNOTATION_LIMIT = 32 * 1024

FINE = ("dra", "public_fault")  # isolated on the device itself
MECHANISMS = ("dra", "public_fault", "node", "prefer", "none", "withheld")
_DEVICE_NAME = re.compile(r"^(npu|gpu)(\d+)$")


@dataclass(frozen=True)
class RuleSpec:
    name: str
    device: Published
    spec: Mapping[str, Any]


@dataclass(frozen=True)
class Mechanisms:
    """What the cluster offers this node for isolating its devices, as the isolator found it."""

    rules_version: str | None = None  # the resource.k8s.io version serving DeviceTaintRules
    published: Sequence[Published] = ()
    no_dra: str = "the cluster serves no DeviceTaintRules"  # why DRA does not apply, when it does not
    node_label: str | None = None  # the node's name as a label value (None: too long for one)
    public_fault: bool = False
    public_fault_error: str = ""  # public faults are on but their ConfigMap could not be read: the chips fall back
    prefix: str = "node-health"
    node: str = ""


@dataclass(frozen=True)
class Isolation:
    ref: DeviceRef
    mechanism: str  # one of MECHANISMS
    reason: str
    effect: str = ""  # of the device taint (dra), or of the node taint (node, prefer)
    rules: tuple[RuleSpec, ...] = ()
    codes: Mapping[str, str] = field(default_factory=dict)  # reason → fault code (public_fault)
    physical_id: int | None = None
    why: str = ""  # why not finer (node, prefer, none) or why withheld
    why_code: str = ""  # the same as a metric label: no_dra, not_published, no_physical_id, write_failed, budget
    want: Want | None = None  # None: kept from a previous run while the category has no fresh result

    @property
    def device(self) -> str:
        return self.ref.name

    @property
    def fine(self) -> bool:
        return self.mechanism in FINE

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"device": self.device, "category": self.ref.category, "reason": self.reason}
        out["mechanism"] = self.mechanism
        if self.effect:
            out["effect"] = self.effect
        if self.rules:
            out["rules"] = [rule.name for rule in self.rules]
        if self.codes:
            out["codes"] = sorted(set(self.codes.values()))
        if self.why:
            out["why"] = clip(self.why, WHY_LIMIT)
        if self.want is None:
            out["held"] = True
        return out


def fault_codes(want: Want, policy: KubernetesConfig) -> dict[str, str]:
    settings = policy.mindcluster.public_fault
    return {s.finding.reason: settings.codes.get(s.finding.reason, settings.default_code) for s in want.states}


def _fallback(want: Want, policy: KubernetesConfig, why: str, why_code: str) -> Isolation:
    return Isolation(want.ref, policy.device_fallback, want.reason, why=why, why_code=why_code, want=want)


def decide_one(want: Want, identity: Identity, mechanisms: Mechanisms, policy: KubernetesConfig) -> Isolation:
    """The mechanism for one device; the budget and the writes may still change it."""
    if want.ref.category == "npu" and mechanisms.public_fault_error:
        return _fallback(want, policy, mechanisms.public_fault_error, "write_failed")
    if want.ref.category == "npu" and mechanisms.public_fault:
        if identity.physical_id is None:
            return _fallback(want, policy, "npu-smi gave no physical id for a public fault", "no_physical_id")
        codes = fault_codes(want, policy)
        return Isolation(
            want.ref, "public_fault", want.reason, codes=codes, physical_id=identity.physical_id, want=want
        )
    if mechanisms.rules_version is None:
        return _fallback(want, policy, mechanisms.no_dra, "no_dra")
    if mechanisms.node_label is None:
        return _fallback(want, policy, "the node's name is too long for a label value", "node_name")
    found = matching(identity, mechanisms.published)
    if not found:
        why = f"{want.ref.name} is not published in a ResourceSlice of this node"
        return _fallback(want, policy, why, "not_published")
    rules = tuple(
        RuleSpec(
            rule_name(mechanisms.prefix, want.ref.category, mechanisms.node, device.driver, device.name),
            device,
            rule_spec(mechanisms.prefix, device, want.ref.category, want.reason, want.effect),
        )
        for device in sorted(found, key=lambda p: (p.driver, p.name))
    )
    return Isolation(want.ref, "dra", want.reason, want.effect, rules, want=want)


def decide(
    wants: Mapping[DeviceRef, Want],
    identities: Mapping[DeviceRef, Identity],
    mechanisms: Mechanisms,
    policy: KubernetesConfig,
) -> list[Isolation]:
    return [
        decide_one(want, identities.get(ref) or Identity(ref), mechanisms, policy)
        for ref, want in sorted(wants.items())
    ]


def as_fallback(isolation: Isolation, policy: KubernetesConfig, why: str, why_code: str) -> Isolation:
    """A finer isolation that could not be written falls back to the node (fail closed)."""
    return replace(isolation, mechanism=policy.device_fallback, rules=(), codes={}, why=why, why_code=why_code)


def _ref_of(name: str) -> DeviceRef | None:
    match = _DEVICE_NAME.match(name)
    return DeviceRef(match[1], int(match[2])) if match else None


def kept_isolations(
    rules: Iterable[Mapping[str, Any]],
    fault_devices: Iterable[str],
    held: frozenset[str],
    wants: Mapping[DeviceRef, Want],
    prefix: str,
) -> list[Isolation]:
    """What a previous run isolated in a category without fresh results stays, as its node taint does: its rules
    (by the device each names) and, with the npu category held, its chips with a public fault."""
    out: dict[DeviceRef, Isolation] = {}
    for rule in rules:
        ref = _ref_of(str((rule["metadata"].get("annotations") or {}).get(f"{prefix}/device", "")))
        if ref is None or ref.category not in held or ref in wants:
            continue
        taint = (rule.get("spec") or {}).get("taint") or {}
        spec = RuleSpec(rule["metadata"]["name"], Published("", "", "", ""), rule.get("spec") or {})
        previous = out.get(ref) or Isolation(ref, "dra", str(taint.get("value", "")), str(taint.get("effect", "")))
        out[ref] = replace(previous, rules=(*previous.rules, spec))
    for name in fault_devices:
        ref = _ref_of(name)
        if ref is not None and ref not in wants and ref not in out:
            out[ref] = Isolation(ref, "public_fault", "")
    return list(out.values())


def active_faults(isolations: Sequence[Isolation]) -> dict[FaultKey, ActiveFault]:
    """The public faults that should be `occur`: one per chip and fault code of its problems."""
    out: dict[FaultKey, ActiveFault] = {}
    for isolation in isolations:
        if isolation.mechanism != "public_fault" or isolation.want is None or isolation.physical_id is None:
            continue
        for state in isolation.want.states:
            code = isolation.codes.get(state.finding.reason)
            if code is None:
                continue
            text = f"node-health {state.finding.reason} on {isolation.device}: {state.finding.message}"
            key = (isolation.physical_id, code)
            out.setdefault(key, ActiveFault(isolation.device, isolation.physical_id, code, text))
    return out


# --- what the Node carries ------------------------------------------------------------------------------------


def _merge(first: TaintIntent, second: TaintIntent) -> TaintIntent:
    """The stronger of two taint intents of one category: a set beats a hold, a hold beats none."""
    sets = [t for t in (first, second) if t.action == "set"]
    if sets:
        return min(sets, key=lambda t: EFFECT_RANK.get(t.effect, 3))
    return first if first.action == "hold" else second


def _prefer_policy(policy: KubernetesConfig, reasons: set[str]) -> KubernetesConfig:
    """The policy with every blocking effect of these reasons softened to PreferNoSchedule."""
    softened = {
        reason: "PreferNoSchedule"
        for reason in reasons
        if policy.effects.get(reason, policy.default_effect) in BLOCKING_EFFECTS
    }
    return policy.model_copy(update={"effects": {**policy.effects, **softened}})


def _category_taint(
    category: str,
    snapshot: Snapshot,
    isolations: Sequence[Isolation],
    policy: KubernetesConfig,
    devices_known: int,
) -> TaintIntent:
    grouped = snapshot.categories().get(category, ())
    handled = {key for i in isolations if i.want is not None and i.mechanism != "node" for key in i.want.keys}
    taint, _ = category_intents(category, [s for s in grouped if s.finding.key not in handled], policy)
    prefer = [i for i in isolations if i.mechanism == "prefer" and i.want is not None]
    if not prefer:
        return taint
    bad = len({i.ref for i in isolations if i.want is not None})
    states = [s for i in prefer if i.want is not None for s in i.want.states]
    soft = bad / max(devices_known, bad, 1) < policy.device_fallback_max_fraction
    effective = _prefer_policy(policy, {s.finding.reason for s in states}) if soft else policy
    return _merge(taint, category_intents(category, states, effective)[0])


def _note(isolation: Isolation) -> str:
    device = isolation.device
    if isolation.mechanism == "dra":
        rules = ", ".join(rule.name for rule in isolation.rules)
        return f"{device} isolated by DeviceTaintRule {rules} ({isolation.effect})"
    if isolation.mechanism == "public_fault":
        codes = ", ".join(sorted(set(isolation.codes.values())))
        return f"{device} isolated by MindCluster public fault {codes}"
    if isolation.mechanism == "withheld":
        return f"{device} isolation withheld: {isolation.why}"
    if isolation.mechanism == "none":
        return f"{device} not isolated (device_fallback none; the pre-flight turns jobs away): {isolation.why}"
    how = "node taint" if isolation.mechanism == "node" else "node taint, PreferNoSchedule while few devices are bad"
    return f"{device} falls back to the {how}: {isolation.why}"


def _condition(intent: ConditionIntent, notes: list[str], counts: str) -> ConditionIntent:
    """Notes head the summary (a change of them is a change of the condition); counts that change while nothing else
    does (the device budget's use) go with the measured details, written at the heartbeat."""
    if intent.action != "set" or not notes:
        return intent
    summary = clip("; ".join([*notes, intent.summary]), SUMMARY_LIMIT)
    details = "; ".join(p for p in (counts, intent.message[len(intent.summary) :].removeprefix(DETAILS)) if p)
    message = clip(f"{summary}{DETAILS}{details}" if details else summary, MESSAGE_LIMIT)
    return replace(intent, summary=summary, message=message)


def annotation_value(isolations: Sequence[Isolation]) -> str | None:
    """The `<prefix>/isolated-devices` value: a JSON list, one entry per device. Checked before it is sent: the API
    server refuses a Node whose annotations pass 256 KiB in all, so past ANNOTATION_LIMIT (far more than 16
    chips at their longest need) the entries lose their `why` and rule names, which /status still gives."""
    if not isolations:
        return None
    entries = [i.to_dict() for i in sorted(isolations, key=lambda i: i.ref)]
    value = json.dumps(entries, separators=(",", ":"))
    if len(value.encode()) > ANNOTATION_LIMIT:
        compact = [{k: v for k, v in entry.items() if k not in ("why", "rules")} for entry in entries]
        value = json.dumps(compact, separators=(",", ":"))
    return value


def adjust_desired(
    desired: Desired,
    snapshot: Snapshot,
    isolations: Sequence[Isolation],
    policy: KubernetesConfig,
    devices_known: Mapping[str, int],
    budget: str = "",
) -> Desired:
    """`desired` with the devices isolated finer than the node out of its taints, and each device named in its
    category's condition; devices_known: per category, how many devices the node has (the prefer fraction);
    budget: the device budget's use, for the details of a condition with a withheld device."""
    by_category: dict[str, list[Isolation]] = {}
    for isolation in isolations:
        by_category.setdefault(isolation.ref.category, []).append(isolation)
    taints = tuple(
        _category_taint(t.category, snapshot, by_category[t.category], policy, devices_known.get(t.category, 0))
        if t.category in by_category
        else t
        for t in desired.taints
    )
    conditions = tuple(
        _condition(
            c,
            [_note(i) for i in by_category.get(c.category, ())],
            budget if any(i.mechanism == "withheld" for i in by_category.get(c.category, ())) else "",
        )
        for c in desired.conditions
    )
    annotation = (isolated_devices_key(policy.key_prefix), annotation_value(isolations))
    return replace(desired, taints=taints, conditions=conditions, annotations=(*desired.annotations, annotation))
