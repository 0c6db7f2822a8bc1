"""deploy/rbac.yaml grants exactly the API calls the kube package makes: every call of a full scenario (a slot
taken, refused, verified and given back; conditions; events; conflicts; heartbeats), recorded by the API double,
against the ClusterRole and Role rules. The cleanup Job's rules against the calls `node-health cleanup` makes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.kube_double import ApiDouble, Request
from support.kube_helpers import BUDGET_NS, Clock, health_state, make_agent, our_taints, record
from support.system import REPO

from agent.config import parse_config
from agent.kube.cleanup import cleanup
from agent.kube.client import KubeApi

PATH = re.compile(
    r"^/api/v1/(?:namespaces/(?P<ns>[^/]+)/)?(?P<resource>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>status))?$"
)
VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
PROBES = {"network": ("network.dns",)}
Call = tuple[str, str, str]  # (apiGroup, resource, verb)


def calls(log: list[Request]) -> dict[Call, set[tuple[str, str]]]:
    """(group, resource, verb) → the (namespace, name) pairs it was used on."""
    used: dict[Call, set[tuple[str, str]]] = {}
    for request in log:
        match = PATH.match(request.path)
        assert match is not None, request.path
        resource = match["resource"] + (f"/{match['sub']}" if match["sub"] else "")
        if request.method == "GET":
            verb = "watch" if request.query.get("watch") == ["true"] else ("get" if match["name"] else "list")
        else:
            verb = VERBS[request.method]
        used.setdefault(("", resource, verb), set()).add((match["ns"] or "", match["name"] or ""))
    return used


def granted(path: Path) -> tuple[dict[Call, list[str] | None], dict[Call, list[str] | None]]:
    """(cluster-wide grants, namespaced grants): call → resourceNames (None: any name)."""
    cluster: dict[Call, list[str] | None] = {}
    namespaced: dict[Call, list[str] | None] = {}
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc or doc["kind"] not in ("ClusterRole", "Role"):
            continue
        target = cluster if doc["kind"] == "ClusterRole" else namespaced
        for rule in doc["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert (group, resource, verb) not in target, f"granted twice: {group} {resource} {verb}"
                        target[(group, resource, verb)] = rule.get("resourceNames")
    return cluster, namespaced


def assert_least_privilege(used: dict[Call, set[tuple[str, str]]], path: Path, namespace: str) -> None:
    cluster, namespaced = granted(path)
    assert set(used) == set(cluster) | set(namespaced), (
        f"unused grants: {sorted((set(cluster) | set(namespaced)) - set(used))}; "
        f"missing grants: {sorted(set(used) - set(cluster) - set(namespaced))}"
    )
    for call, targets in used.items():
        if call in cluster:
            continue
        names = namespaced[call]
        for ns, name in targets:
            assert ns == namespace, (call, ns)
            assert names is None or name in names, (call, name, names)


@pytest.mark.system
def test_the_agents_role_is_exactly_what_it_calls(double: ApiDouble) -> None:
    clock = Clock()
    for name in ("a", "b", "c"):
        double.add_node(name)
    states = {n: health_state(n, clock, PROBES) for n in ("a", "b")}
    agents = {n: make_agent(double, states[n], clock, seed=i, max_unhealthy="1") for i, n in enumerate(states)}

    def everyone(status: str, reason: str = "") -> None:
        for state in states.values():
            record(state, "network", "network.dns", status, reason)
        for agent in agents.values():
            agent.step()

    everyone("ok")
    everyone("fail", "DnsFailed")  # a takes the slot (creating the ConfigMap, counting the nodes); b is refused
    assert our_taints(double.node("a")) and not our_taints(double.node("b"))
    double.foreign_write_before_ours("a")
    record(states["a"], "network", "network.dns", "ok")
    agents["a"].step()  # a recovers through a 409: reads again; gives its slot back
    double.before_write = None
    for _ in range(60):
        clock.advance(60)
        for agent in agents.values():
            agent.step()  # b asks again, verifies the holders, takes the slot; heartbeats
    assert our_taints(double.node("b"))
    # The node's pods for the device ledger checks (agent/kube/pods.py), through the same client.
    double.add_pod("team-a", "train-0", "a")
    assert agents["a"].pods.refresh() and agents["a"].pods.current() is not None
    used = calls(double.log)
    assert ("", "nodes", "list") in used and ("", "configmaps", "create") in used and ("", "pods", "list") in used
    assert_least_privilege(used, REPO / "deploy" / "rbac.yaml", BUDGET_NS)


@pytest.mark.system
def test_the_cleanup_jobs_role_is_exactly_what_cleanup_calls(double: ApiDouble, monkeypatch: Any) -> None:
    monkeypatch.setenv("POD_NAMESPACE", BUDGET_NS)
    double.add_node(
        "a", labels={"node-health/ready": "false"}, taints=[{"key": "node-health/npu", "effect": "NoSchedule"}]
    )
    double.add_node("b", conditions=[{"type": "NPUHealthy", "status": "False", "reason": "X"}])
    slot = json.dumps({"acquired_at": 0, "taints": "npu=X"})
    double.create("configmaps", BUDGET_NS, {"metadata": {"name": "node-health-budget"}, "data": {"a": slot}})
    double.foreign_write_before_ours("a")
    out: list[str] = []
    api = KubeApi(double.client, 5)
    assert cleanup(api, parse_config({}), None, False, out.append) == 0, out
    used = calls(double.log)
    assert_least_privilege(used, REPO / "deploy" / "examples" / "cleanup-job.yaml", BUDGET_NS)
