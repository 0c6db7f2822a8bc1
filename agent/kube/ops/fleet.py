"""`node-health fleet`: every node the agents marked, in one table an on-call engineer reads in seconds.

Read-only, from a kubeconfig or in-cluster (the same credentials as `cleanup`): the Nodes (a label selector
narrows them), the agents' DeviceTaintRules and public-fault ConfigMaps (by their labels), and the two budget
ConfigMaps. Per node: whether it is ready, each category's problem with its reason and how long it has stood
(the condition's lastTransitionTime) and whether the node carries its taint, the isolated devices and how
(`gpu3:dra` a DeviceTaintRule, `npu2:fault` a public fault, `npu5:node` the node taint, ...), and what is
withheld (a node taint the cluster taint budget refused, a device isolation the device budget refused), and the
orphans: an agent-owned taint (`<prefix>/<category>`) with no failing condition of its category beside it, left by
an agent that is gone (`kubectl delete -k deploy/`, a crash), with the commands that remove it. Then how much of
each budget is used. `--json` prints the same as one document. Everything shown is escaped: a Node's
fields are not trusted to be printable.
"""

from __future__ import annotations

import calendar
import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from agent.config import Config, KubernetesConfig
from agent.kube.client import KubeApi, agent_namespace, run_command, short_error
from agent.kube.devices.budget import DeviceBudget
from agent.kube.devices.dra import discover, own_rules
from agent.kube.devices.publicfault import occurring_count, own_selector
from agent.kube.node.budget import TaintBudget
from agent.kube.node.policy import isolated_devices_key, ready_label_key, taint_key
from agent.kube.slots import Fleet, budget_limit, slots_count
from probes.base import CATEGORIES
from probes.text import escape

EXIT_DONE, EXIT_API_ERROR = 0, 1
SHORT = {"dra": "dra", "public_fault": "fault", "node": "node", "prefer": "prefer", "none": "none"}
_CONDITIONS = {category.condition_type: name for name, category in CATEGORIES.items()}


@dataclass
class Problem:
    category: str
    status: str  # False, Unknown
    reason: str
    since: str  # RFC 3339, as the condition says
    age_seconds: float | None
    tainted: str = ""  # the node taint's effect, when the node carries it


@dataclass
class NodeView:
    name: str
    ready: str  # the agent's label: true, false, or "" (none)
    problems: list[Problem] = field(default_factory=list)
    isolated: list[dict[str, Any]] = field(default_factory=list)  # device, mechanism, reason (and rules, codes)
    withheld: list[str] = field(default_factory=list)
    # Agent-owned taints with no failing condition of their category: key, effect and the commands that remove it.
    orphans: list[dict[str, str]] = field(default_factory=list)


@dataclass
class Budget:
    name: str
    used: int | None
    limit: int | None
    of: str  # "nodes" or "devices"
    total: int | None
    note: str = ""


def _age(stamp: str, now: float) -> float | None:
    try:
        return max(0.0, now - calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))
    except (ValueError, TypeError):
        return None


def age_text(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def node_view(node: Mapping[str, Any], prefix: str, now: float) -> NodeView:
    metadata = node.get("metadata") or {}
    taints = {str(t.get("key")): str(t.get("effect")) for t in (node.get("spec") or {}).get("taints") or []}
    view = NodeView(str(metadata.get("name", "")), str((metadata.get("labels") or {}).get(ready_label_key(prefix), "")))
    for condition in (node.get("status") or {}).get("conditions") or []:
        category = _CONDITIONS.get(str(condition.get("type")))
        if category is None or condition.get("status") == "True":
            continue
        since = str(condition.get("lastTransitionTime") or "")
        effect = taints.get(taint_key(prefix, category), "")
        view.problems.append(
            Problem(
                category,
                str(condition.get("status")),
                str(condition.get("reason", "")),
                since,
                _age(since, now),
                effect,
            )
        )
        message = str(condition.get("message") or "")
        if message.startswith(f"taint {taint_key(prefix, category)}=") and " withheld" in message.split(";")[0]:
            view.withheld.append(message.split(" withheld")[0].removeprefix(f"taint {prefix}/"))
    view.orphans = orphan_taints(view.name, taints, {p.category for p in view.problems}, prefix)
    try:
        entries = json.loads((metadata.get("annotations") or {}).get(isolated_devices_key(prefix)) or "[]")
    except ValueError:
        entries = []
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and entry.get("mechanism") == "withheld":
            view.withheld.append(f"{entry.get('device')} (device budget)")
        elif isinstance(entry, dict):
            view.isolated.append(
                {k: entry[k] for k in ("device", "mechanism", "reason", "rules", "codes") if k in entry}
            )
    return view


def orphan_taints(node: str, taints: Mapping[str, str], failing: set[str], prefix: str) -> list[dict[str, str]]:
    """The agent's category taints on `node` that no failing condition of their category explains: nothing will
    lift them (the agent that would is gone), so each comes with the commands that do."""
    out = []
    for category in CATEGORIES:
        key = taint_key(prefix, category)
        if key in taints and category not in failing:
            kubectl = f"kubectl taint nodes {node} {key}:{taints[key]}-"
            out.append(
                {
                    "taint": key,
                    "effect": taints[key],
                    "remove": f"node-health cleanup --node {node}",
                    "kubectl": kubectl,
                }
            )
    return out


def marked(view: NodeView) -> bool:
    return bool(view.problems or view.isolated or view.withheld or view.orphans or view.ready == "false")


@dataclass
class FleetView:
    nodes: list[NodeView]
    budgets: list[Budget]
    rules: int | None  # the agents' DeviceTaintRules in the cluster (None: no DRA, or not readable)
    faults: int | None  # chips with a public fault
    notes: list[str]
    total_nodes: int

    def to_document(self) -> dict[str, Any]:
        return {
            "nodes": [asdict(n) for n in self.nodes],
            "budgets": [asdict(b) for b in self.budgets],
            "device_taint_rules": self.rules,
            "public_faults": self.faults,
            "nodes_listed": self.total_nodes,
            "notes": self.notes,
        }


def _budgets(api: KubeApi, policy: KubernetesConfig, notes: list[str]) -> list[Budget]:
    namespace = agent_namespace(policy)
    out = []
    for name, of, setting, kind in (
        (policy.budget_configmap, "nodes", policy.max_unhealthy, TaintBudget),
        (policy.device_budget_configmap, "devices", policy.max_unhealthy_devices, DeviceBudget),
    ):
        try:
            metadata = api.get_configmap_metadata(namespace, name)
        except Exception as exc:  # noqa: BLE001 - shown, the rest of the view stands
            notes.append(f"budget {namespace}/{name}: not read: {short_error(exc)}")
            out.append(Budget(name, None, None, of, None, "not read"))
            continue
        annotations = (metadata or {}).get("annotations") or {}
        fleet = Fleet.parse(annotations.get(f"{policy.key_prefix}/{kind.FLEET_KEY}"))
        try:
            used = slots_count(annotations.get(f"{policy.key_prefix}/{kind.SLOTS_KEY}", "0"))
        except ValueError:  # garbage: shown as not known
            used = None
        percentage = setting.strip().endswith("%")
        counted = fleet.nodes if percentage else None
        limit = None if percentage and counted is None else budget_limit(setting, fleet.nodes or 0)
        note = "" if metadata is not None else "no ConfigMap yet: nothing taken"
        out.append(Budget(name, used if metadata is not None else 0, limit, of, counted, note))
    return out


def _device_objects(api: KubeApi, config: Config, notes: list[str]) -> tuple[int | None, int | None]:
    policy = config.kubernetes
    rules = faults = None
    try:
        version = discover(api, time.time()).rules
        if version is not None:
            rules = len(own_rules(api, version, policy.key_prefix, None))
    except Exception as exc:  # noqa: BLE001
        notes.append(f"devicetaintrules: not read: {short_error(exc)}")
    settings = policy.mindcluster.public_fault
    if settings.enabled:
        try:
            found = api.list_configmaps(settings.namespace, own_selector(policy.key_prefix))
            faults = sum(occurring_count(c) for c in found)
        except Exception as exc:  # noqa: BLE001
            notes.append(f"public faults {settings.namespace}: not read: {short_error(exc)}")
    return rules, faults


def fleet_view(api: KubeApi, config: Config, selector: str, now: float) -> FleetView:
    """Raises when the Nodes cannot be listed; anything else unreadable becomes a note."""
    policy = config.kubernetes
    nodes = api.list_nodes(selector)
    views = [node_view(n, policy.key_prefix, now) for n in nodes]
    views = sorted((v for v in views if marked(v)), key=lambda v: (v.ready != "false", -len(v.problems), v.name))
    notes: list[str] = []
    rules, faults = _device_objects(api, config, notes)
    return FleetView(views, _budgets(api, policy, notes), rules, faults, notes, len(nodes))


def _cell(text: str) -> str:
    return escape(text) or "-"


def format_fleet(view: FleetView) -> str:
    rows = [("NODE", "READY", "PROBLEMS (reason, for how long, * = node tainted)", "ISOLATED DEVICES", "WITHHELD")]
    for node in view.nodes:
        problems = ", ".join(
            [f"{p.category}={p.reason} {age_text(p.age_seconds)}{'*' if p.tainted else ''}" for p in node.problems]
            + [f"{o['taint']}:{o['effect']} ORPHAN (no condition)" for o in node.orphans]
        )
        isolated = " ".join(
            f"{d.get('device')}:{SHORT.get(str(d.get('mechanism')), d.get('mechanism'))}" for d in node.isolated
        )
        rows.append((node.name, node.ready, problems, isolated, "; ".join(node.withheld)))
    cells = [tuple(_cell(str(c)) for c in row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(4)]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(row[:4])) + "  " + row[4] for row in cells]
    if not view.nodes:
        lines.append(f"(no node marked among the {view.total_nodes} listed)")
    lines.append("")
    for budget in view.budgets:
        lines.append(_budget_line(budget))
    devices = [f"DeviceTaintRules of the agents: {view.rules}" if view.rules is not None else "no DeviceTaintRules"]
    if view.faults is not None:
        devices.append(f"chips with a public fault: {view.faults}")
    lines.append("; ".join(devices))
    lines.extend(f"note: {_cell(n)}" for n in view.notes)
    for node in view.nodes:
        lines.extend(
            f"orphan taint {_cell(o['taint'])}:{_cell(o['effect'])} on {_cell(node.name)}: no agent condition explains "
            f"it; remove it with `{_cell(o['remove'])}` (every agent mark) or `{_cell(o['kubectl'])}`"
            for o in node.orphans
        )
    return "\n".join(lines)


def _budget_line(budget: Budget) -> str:
    label = "node taint budget" if budget.of == "nodes" else "device budget"
    if budget.used is None:
        return f"{label} ({budget.name}): {budget.note or 'unknown'}"
    if budget.limit is None:
        return f"{label} ({budget.name}): {budget.used} taken, limit not known until the {budget.of} are counted"
    share = f" ({100 * budget.used / budget.limit:.0f}%)" if budget.limit else ""
    total = f" of {budget.total} {budget.of}" if budget.total is not None else ""
    note = f"; {budget.note}" if budget.note else ""
    return f"{label} ({budget.name}): {budget.used} of {budget.limit} used{share}{total}{note}"


def main_fleet(config: Config, selector: str, as_json: bool, out: Callable[[str], None] = print) -> int:
    def show(api: KubeApi) -> int:
        try:
            view = fleet_view(api, config, selector, time.time())
        except Exception as exc:  # noqa: BLE001 - reported, and the exit status says it
            print(f"node-health fleet: nodes not listed: {short_error(exc)}", file=sys.stderr)
            return EXIT_API_ERROR
        out(json.dumps(view.to_document(), indent=2) if as_json else format_fleet(view))
        return EXIT_DONE

    return run_command(config, "fleet", show)
