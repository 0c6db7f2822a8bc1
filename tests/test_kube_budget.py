"""The cluster taint budget: 100 agents failing at once never taint more nodes than the budget allows."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.kube_double import ApiDouble
from support.kube_helpers import (
    BUDGET_NS,
    Clock,
    blocking_tainted,
    conditions,
    health_state,
    make_agent,
    our_taints,
    record,
)

from agent.kube import KubeAgent
from agent.kube_budget import budget_limit
from agent.state import HealthState

NODES = 100
PROBES = {"network": ("network.dns",)}


@pytest.mark.parametrize(
    ("text", "nodes", "limit"),
    [("10%", 100, 10), ("10%", 5, 1), ("10%", 0, 0), ("0%", 50, 0), ("3", 100, 3), ("0", 9, 0), ("25%", 10, 3)],
)
def test_budget_limit(text: str, nodes: int, limit: int) -> None:
    assert budget_limit(text, nodes) == limit


def test_100_agents_failing_at_once_stay_within_the_budget(double: ApiDouble) -> None:
    clock = Clock()
    names = [f"gpu-{i:03d}" for i in range(NODES)]
    for name in names:
        double.add_node(name, labels={"pool": "accel"})
    double.add_node("cpu-000", labels={"pool": "cpu"})  # outside the pool the percentage counts

    most_tainted = [0]
    check_lock = threading.Lock()

    def check_budget(api: ApiDouble) -> None:
        tainted = len(blocking_tainted(api._store.objects[k] for k in api._store.objects if k[0] == "nodes"))
        with check_lock:
            most_tainted[0] = max(most_tainted[0], tainted)

    double.after_write = check_budget
    states: dict[str, HealthState] = {}
    agents: dict[str, KubeAgent] = {}
    for i, name in enumerate(names):
        states[name] = health_state(name, clock, PROBES)
        record(states[name], "network", "network.dns", "ok")
        agents[name] = make_agent(double, states[name], clock, seed=i, budget_node_selector="pool=accel")

    def run_all(pool: ThreadPoolExecutor, rounds: int = 30) -> None:
        """Reconcile every agent until none has an error left (CAS conflicts make some retry)."""
        for _ in range(rounds):
            before = {name: sum(agents[name].status()["errors"].values()) for name in names}
            list(pool.map(lambda name: agents[name].reconcile_once(), names))
            if all(sum(agents[name].status()["errors"].values()) == before[name] for name in names):
                return
        raise AssertionError("agents did not converge")

    with ThreadPoolExecutor(max_workers=12) as pool:
        run_all(pool)
        # A cluster-wide DNS outage: every node fails at the same instant.
        for name in names:
            record(states[name], "network", "network.dns", "fail", "DnsFailed")
        run_all(pool)
        nodes = {n["metadata"]["name"]: n for n in double.nodes()}
        tainted = set(blocking_tainted(nodes.values()))
        assert len(tainted) == 10
        assert most_tainted[0] == 10
        slots = double.configmap(BUDGET_NS, "node-health-budget")["data"]
        assert set(slots) == tainted
        suppressed = [n for n in names if n not in tainted]
        for name in suppressed:
            condition = conditions(nodes[name])["NetworkHealthy"]
            assert (condition["status"], condition["reason"]) == ("False", "TaintSuppressedByBudget")
            assert "DnsFailed" in condition["message"]
            samples = [s for s in agents[name].samples() if s.name == "nodehealth_taint_suppressed"]
            assert [(s.labels["category"], s.labels["reason"], s.value) for s in samples] == [
                ("network", "DnsFailed", 1.0)
            ]
        warned = {
            e["involvedObject"]["name"] for e in double.events("default") if e["reason"] == "TaintSuppressedByBudget"
        }
        assert warned == set(suppressed)

        # Five tainted nodes recover: their slots come back and go to nodes still failing.
        recovered = sorted(tainted)[:5]
        for name in recovered:
            record(states[name], "network", "network.dns", "ok")
        run_all(pool)
        assert len(blocking_tainted(double.nodes())) == 5
        clock.advance(61)  # budget_retry_seconds: suppressed nodes ask again
        run_all(pool)
        now_tainted = set(blocking_tainted(double.nodes()))
        assert len(now_tainted) == 10
        assert now_tainted.isdisjoint(recovered)
        assert most_tainted[0] == 10

        # Everyone recovers: no taint and no slot is left.
        for name in names:
            record(states[name], "network", "network.dns", "ok")
        run_all(pool)
        assert blocking_tainted(double.nodes()) == []
        assert double.configmap(BUDGET_NS, "node-health-budget")["data"] == {}
    for agent in agents.values():
        agent.stop()


def test_slots_of_gone_and_untainted_nodes_are_pruned(double: ApiDouble) -> None:
    clock = Clock()
    for name in ("a", "b", "c"):
        double.add_node(name)
    double.create(
        "configmaps",
        BUDGET_NS,
        {
            "metadata": {"name": "node-health-budget"},
            "data": {
                "gone": '{"acquired_at": 0}',  # the node was deleted
                "b": '{"acquired_at": 0}',  # long ago, and b carries no taint: its agent died
                "c": f'{{"acquired_at": {clock.now}}}',  # just taken: c is about to taint
            },
        },
    )
    state = health_state("a", clock, PROBES)
    agent = make_agent(double, state, clock, max_unhealthy="2")
    record(state, "network", "network.dns", "fail", "DnsFailed")
    agent.reconcile_once()
    assert our_taints(double.node("a")) == {"network": ("DnsFailed", "NoSchedule")}
    assert set(double.configmap(BUDGET_NS, "node-health-budget")["data"]) == {"a", "c"}
    assert agent.status()["budget"]["slot_held"] is True


def test_a_tainted_node_without_slot_counts_and_keeps_its_taint(double: ApiDouble) -> None:
    clock = Clock()
    taint = {"key": "node-health/storage", "value": "MountMissing", "effect": "NoSchedule"}
    double.add_node("a", taints=[taint])  # tainted by a previous run; the budget ConfigMap was deleted since
    double.add_node("b")
    state_b = health_state("b", clock, PROBES)
    agent_b = make_agent(double, state_b, clock, max_unhealthy="1")
    record(state_b, "network", "network.dns", "fail", "DnsFailed")
    agent_b.reconcile_once()
    assert our_taints(double.node("b")) == {}, "a's taint already spends the budget of 1"

    state_a = health_state("a", clock, {"storage": ("storage.mounts",)})
    agent_a = make_agent(double, state_a, clock, max_unhealthy="1")
    record(state_a, "storage", "storage.mounts", "fail", "MountMissing")
    agent_a.reconcile_once()
    assert our_taints(double.node("a")) == {"storage": ("MountMissing", "NoSchedule")}
    assert set(double.configmap(BUDGET_NS, "node-health-budget")["data"]) == {"a"}
