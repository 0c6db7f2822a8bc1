"""The agent on real Nodes of a real kube-apiserver (1.37 and 1.36), as its own ServiceAccount with a pod-bound
token, the manifests and their admission policies installed: Nodes are born with the not-ready taint and carry
the kubelet's conditions and another controller's taint and label, and the agent's taint, labels, conditions and
Events go among them, all admitted, every foreign one kept in place and in order; two agents failing at once
share a taint budget of one: one taints, the other's taint is withheld."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from support.kube_devices import longest_isolation
from support.kube_helpers import Clock, health_state, kube_config, our_taints, record
from support.realkube import Plane, plane
from support.realkube_objects import install

from agent.config import parse_config
from agent.kube import KubeAgent
from agent.kube.client import load_api_client
from agent.kube.devices.isolation import annotation_value
from agent.kube.ops.cleanup import cleanup

pytestmark = [pytest.mark.system, pytest.mark.realkube]
PROBES = {"storage": ("storage.mounts",), "time": ("time.sync",)}
FOREIGN_TAINT = {"key": "example.com/maintenance", "value": "planned", "effect": "PreferNoSchedule"}


def _node(real: Plane, name: str) -> dict[str, Any]:
    if real.request("GET", f"/api/v1/nodes/{name}")[0] == 404:
        real.register_node(name, {"team": "ml"})
        taints = real.request("GET", f"/api/v1/nodes/{name}")[1]["spec"]["taints"] + [FOREIGN_TAINT]
        status, answer = real.request(
            "PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": taints}}, content_type="application/merge-patch+json"
        )
        assert status == 200, answer
    return dict(real.request("GET", f"/api/v1/nodes/{name}")[1])


def _agent(real: Plane, name: str, tmp: Path, **kube: Any) -> tuple[Any, KubeAgent, Clock]:
    """An agent for `name` as the DaemonSet's would be: its ServiceAccount, a token bound to a pod on the node."""
    config = json.loads(real.kubeconfig.read_text())
    config["users"][0]["user"]["token"] = real.node_token(name)
    path = tmp / f"{name}.kubeconfig"
    path.write_text(json.dumps(config))
    clock = Clock()
    state = health_state(name, clock, PROBES)
    settings = {"max_unhealthy": "100%", "budget_namespace": "node-health", **kube, "kubeconfig": str(path)}
    agent = KubeAgent(
        kube_config(**settings),
        name,
        lambda: state.snapshot,
        _client(path),
        clock=clock,
        monotonic=clock,
        rng=random.Random(0),
    )
    return state, agent, clock


def _client(path: Path) -> Any:
    return load_api_client(parse_config({"kubernetes": {"kubeconfig": str(path)}}))


def _events(real: Plane, node: str) -> list[dict[str, Any]]:
    items = real.request("GET", f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3D{node}")[1]
    return list(items.get("items") or [])


@pytest.mark.parametrize("release", ["1.37", "1.36"])
def test_the_agent_among_foreign_taints_labels_and_conditions(release: str, tmp_path: Path) -> None:
    real = plane(release)
    install(real)
    name = f"agent-{release.replace('.', '')}"
    before = _node(real, name)
    state, agent, clock = _agent(real, name, tmp_path)
    record(state, "time", "time.sync", "ok")
    record(state, "storage", "storage.mounts", "fail", "MountReadOnly")
    agent.reconcile_once()
    status = agent.status()
    assert status["last_success"] and not status["errors"] and not status["events"]["errors"], status
    node = real.request("GET", f"/api/v1/nodes/{name}")[1]
    assert our_taints(node) == {"storage": ("MountReadOnly", "NoSchedule")}, node["spec"]
    foreign = [t for t in node["spec"]["taints"] if not t["key"].startswith("node-health/")]
    assert foreign == before["spec"]["taints"], "the not-ready and the maintenance taint, as they were"
    labels = node["metadata"]["labels"]
    assert labels["team"] == "ml" and labels["node-health/ready"] == "false" and labels["node-health/tainted"] == "true"
    types = [c["type"] for c in node["status"]["conditions"]]
    assert types[:3] == ["MemoryPressure", "DiskPressure", "Ready"], types
    assert set(types[3:]) == {"StorageHealthy", "ClockSynced"}, types
    storage = next(c for c in node["status"]["conditions"] if c["type"] == "StorageHealthy")
    assert (storage["status"], storage["reason"]) == ("False", "MountReadOnly")
    events = _events(real, name)
    assert any(e["reason"] == "MountReadOnly" and e["type"] == "Warning" for e in events), events
    assert all(e["involvedObject"]["kind"] == "Node" and not e["involvedObject"].get("namespace") for e in events)

    record(state, "storage", "storage.mounts", "ok")
    clock.advance(30)
    agent.reconcile_once()
    node = real.request("GET", f"/api/v1/nodes/{name}")[1]
    assert our_taints(node) == {} and node["spec"]["taints"] == before["spec"]["taints"]
    assert [c["type"] for c in node["status"]["conditions"]] == types, "every condition where it was"
    assert node["metadata"]["labels"]["node-health/ready"] == "true"
    assert "node-health/tainted" not in node["metadata"]["labels"]


def test_two_agents_failing_at_once_share_a_budget_of_one(tmp_path: Path) -> None:
    real = plane("1.37")
    install(real)
    # The session's other tests leave nodes marked on this plane: `node-health cleanup --all-nodes` first, so the
    # one slot is free.
    admin = parse_config({"kubernetes": {"kubeconfig": str(real.kubeconfig), "budget_namespace": "node-health"}})
    out: list[str] = []
    assert cleanup(real.api(), admin, None, False, out.append) == 0, out
    agents = []
    for name in ("budget-a", "budget-b"):
        _node(real, name)
        state, agent, _clock = _agent(real, name, tmp_path, max_unhealthy="1")
        record(state, "time", "time.sync", "ok")
        record(state, "storage", "storage.mounts", "fail", "MountReadOnly")
        agents.append(agent)
    for _round in range(2):
        threads = [threading.Thread(target=agent.reconcile_once) for agent in agents]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    nodes = [real.request("GET", f"/api/v1/nodes/{name}")[1] for name in ("budget-a", "budget-b")]
    tainted = [n["metadata"]["name"] for n in nodes if "storage" in our_taints(n)]
    assert len(tainted) == 1, [n["spec"] for n in nodes]
    slots = real.request("GET", "/api/v1/namespaces/node-health/configmaps/node-health-budget")[1]
    assert list(slots.get("data") or {}) == tainted, slots
    withheld = next(n for n in nodes if n["metadata"]["name"] not in tainted)
    storage = next(c for c in withheld["status"]["conditions"] if c["type"] == "StorageHealthy")
    assert storage["status"] == "False", storage
    reasons = {e["reason"] for e in _events(real, withheld["metadata"]["name"])}
    assert "TaintSuppressedByBudget" in reasons, reasons


def test_the_isolated_devices_annotation_of_sixteen_chips_at_their_longest_is_accepted() -> None:
    """What tests/kube/devices/test_kube_annotation_size.py bounds, written to a real Node as the agent's token."""
    real = plane("1.37")
    install(real)
    _node(real, "annotated")
    token = real.node_token("annotated")
    value = annotation_value([longest_isolation(i) for i in range(16)])
    body = {"metadata": {"annotations": {"node-health/isolated-devices": value}}}
    status, answer = real.request(
        "PATCH", "/api/v1/nodes/annotated", body, token=token, content_type="application/merge-patch+json"
    )
    assert status == 200, answer
    assert answer["metadata"]["annotations"]["node-health/isolated-devices"] == value
