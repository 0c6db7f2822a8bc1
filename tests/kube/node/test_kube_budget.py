"""The cluster taint budget: a fleet failing at once never carries more blocking taints than the budget, and a
node waiting for a slot costs the API the same whatever the size of the fleet."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kubernetes.client
import pytest
from support.kube_double import ApiDouble, running_double
from support.kube_helpers import (
    BLOCKING,
    BUDGET_NS,
    PREFIX,
    Clock,
    blocking_tainted,
    budget_configmap,
    conditions,
    fleet_record,
    health_state,
    labels,
    make_agent,
    our_taints,
    record,
    slots,
)

from agent.kube import KubeAgent
from agent.kube.slots import budget_limit
from agent.state import HealthState

PROBES = {"network": ("network.dns",)}
CONFIGMAPS = f"/api/v1/namespaces/{BUDGET_NS}/configmaps"


@pytest.mark.parametrize(
    ("text", "nodes", "limit"),
    [("10%", 100, 10), ("10%", 5, 1), ("10%", 0, 0), ("0%", 50, 0), ("3", 100, 3), ("0", 9, 0), ("25%", 10, 3)],
)
def test_budget_limit(text: str, nodes: int, limit: int) -> None:
    assert budget_limit(text, nodes) == limit


class TaintWatch:
    """after_write hook: the blocking-tainted nodes after every stored change, and the most there ever were."""

    def __init__(self) -> None:
        self.tainted: set[str] = set()
        self.most = 0

    def __call__(self, api: ApiDouble) -> None:
        assert api.last_saved is not None
        resource, namespace, name = api.last_saved
        if resource != "nodes":
            return
        node = api._store.objects[(resource, namespace, name)]
        if blocking_tainted([node]):
            self.tainted.add(name)
        else:
            self.tainted.discard(name)
        self.most = max(self.most, len(self.tainted))


def drive(
    pool: ThreadPoolExecutor,
    agents: Iterable[KubeAgent],
    clock: Clock,
    done: Callable[[], bool],
    seconds: float = 5.0,
    rounds: int = 200,
) -> None:
    """What the agents' threads do, in simulated time: every agent polls once per round."""
    agents = list(agents)
    for _ in range(rounds):
        list(pool.map(lambda agent: agent.step(), agents))
        if done():
            return
        clock.advance(seconds)
    raise AssertionError("the fleet did not converge")


@pytest.mark.system
def test_a_fleet_failing_at_once_never_exceeds_the_budget(double: ApiDouble) -> None:
    nodes, limit = 300, 30
    clock = Clock()
    names = [f"gpu-{i:03d}" for i in range(nodes)]
    for name in names:
        double.add_node(name, labels={"pool": "accel"})
    double.add_node("cpu-000", labels={"pool": "cpu"})  # outside the pool the percentage counts
    watch = TaintWatch()
    double.after_write = watch
    configuration = kubernetes.client.Configuration(host=double.host)
    configuration.connection_pool_maxsize = 12  # one kept-alive connection per worker
    client = kubernetes.client.ApiClient(configuration)
    states: dict[str, HealthState] = {}
    agents: dict[str, KubeAgent] = {}
    for i, name in enumerate(names):
        states[name] = health_state(name, clock, PROBES)
        record(states[name], "network", "network.dns", "ok")
        agents[name] = make_agent(double, states[name], clock, seed=i, client=client, budget_node_selector="pool=accel")

    def fail(chosen: Iterable[str], status: str = "fail") -> None:
        for name in chosen:
            record(states[name], "network", "network.dns", status, "DnsFailed" if status == "fail" else "")

    with ThreadPoolExecutor(max_workers=12) as pool:
        drive(pool, agents.values(), clock, lambda: all(a.last_success for a in agents.values()))
        fail(names)  # a cluster-wide DNS outage: every node fails at the same instant
        drive(pool, agents.values(), clock, lambda: len(watch.tainted) == limit and double.events() != [])
        drive(pool, agents.values(), clock, lambda: all(not a.backoff_seconds for a in agents.values()))
        tainted = set(blocking_tainted(double.nodes()))
        assert len(tainted) == limit and watch.most == limit
        assert set(slots(double) or {}) == tainted
        by_name = {n["metadata"]["name"]: n for n in double.nodes()}
        assert {n for n in names if labels(by_name[n]).get(f"{PREFIX}/tainted") == "true"} == tainted
        suppressed = [n for n in names if n not in tainted]
        for name in suppressed:
            condition = conditions(by_name[name])["NetworkHealthy"]
            assert (condition["status"], condition["reason"]) == ("False", "DnsFailed")
            assert condition["message"].startswith("taint node-health/network=DnsFailed withheld"), condition
            assert agents[name].status()["budget"]["suppressed"] == {"network": "DnsFailed"}
        warned = {e["involvedObject"]["name"] for e in double.events() if e["reason"] == "TaintSuppressedByBudget"}
        assert warned == set(suppressed)

        # Half the tainted nodes recover: their slots come back and go to nodes still failing.
        recovered = sorted(tainted)[: limit // 2]
        fail(recovered, "ok")
        drive(pool, agents.values(), clock, lambda: len(watch.tainted) == limit and not set(recovered) & watch.tainted)
        assert watch.most == limit

        fail(names, "ok")  # everyone recovers: no taint and no slot is left
        drive(pool, agents.values(), clock, lambda: not watch.tainted and slots(double) == {})
    assert watch.most == limit


def fleet(double: ApiDouble, size: int) -> None:
    """size nodes with no agent of their own (healthy): what a percentage counts, and nothing else."""
    for i in range(size):
        double.add_node(f"idle-{i:05d}", labels={"pool": "accel"})


def waiting_for_an_hour(double: ApiDouble, size: int) -> tuple[list[tuple[str, str, str]], int, int, int, Any]:
    """A node waiting for a slot for an hour in a fleet of `size` nodes: its requests other than node counts,
    their bytes, its node counts, how many times it asked for a slot, and (metadata reads, full reads) of the
    budget ConfigMap."""
    fleet(double, size)
    clock = Clock()
    agents = []
    for name in ("holder-0", "waiter-0"):  # same name lengths: the ConfigMap is the same size in every run
        double.add_node(name, labels={"pool": "accel"})
        state = health_state(name, clock, PROBES)
        record(state, "network", "network.dns", "fail", "DnsFailed")
        agents.append(make_agent(double, state, clock, max_unhealthy="1", budget_node_selector="pool=accel"))
    for agent in agents:
        agent.reconcile_once()
    assert blocking_tainted(double.nodes()) == ["holder-0"]
    waiter = agents[1]
    start = len(double.log)
    asked = 0
    for _ in range(3600):  # polled every second, as the thread does
        clock.advance(1)
        before = len(double.log)
        waiter.step()
        new = double.log[before:]
        asked += any(r.path == f"{CONFIGMAPS}/node-health-budget" and r.method == "GET" for r in new)
    assert waiter.status()["errors"] == {}
    counts = [r for r in double.log[start:] if r.path == "/api/v1/nodes" and r.query["labelSelector"] == ["pool=accel"]]
    assert all(r.query["resourceVersion"] == ["0"] for r in counts), "counted from the watch cache"
    rest = [r for r in double.log[start:] if r not in counts]
    budget = [r for r in rest if r.method == "GET" and r.path == f"{CONFIGMAPS}/node-health-budget"]
    peeks = sum(1 for r in budget if "as=PartialObjectMetadata" in r.accept)
    return requests_of(rest), sum(r.sent for r in rest), len(counts), asked, (peeks, len(budget) - peeks)


def requests_of(log: Iterable[Any]) -> list[tuple[str, str, str]]:
    return [(r.method, r.path, json.dumps(r.query, sort_keys=True)) for r in log]


@pytest.mark.system
def test_a_waiting_node_costs_the_same_whatever_the_fleet_size(double: ApiDouble) -> None:
    small = waiting_for_an_hour(double, 20)
    with running_double() as other:
        large = waiting_for_an_hour(other, 2000)
    assert small[0] == large[0], "the same requests, in the same order"
    assert abs(small[1] - large[1]) <= 0.02 * small[1], (small[1], large[1])
    assert small[2] == large[2] <= 4, "the fleet is counted at most every budget_recount_seconds (900 s)"
    assert 12 <= small[3] <= 30, "asked every 60 s at first, doubling with jitter up to every 300 s"
    peeks, reads = small[4]
    assert peeks == small[3], "each question is one GET of the ConfigMap's metadata (PartialObjectMetadata)"
    assert reads <= 3600 / 120 + 3600 / 900 + 1, "the slots themselves only when a verification or count is due"
    node_reads = [r for r in small[0] if r[0] == "GET" and r[1].startswith("/api/v1/nodes/")]
    assert len(node_reads) <= 3600 / 600 + 1, "the Node itself is read only at heartbeats"


@pytest.mark.system
def test_retries_back_off_exponentially_with_jitter_up_to_the_cap(double: ApiDouble) -> None:
    clock = Clock()
    double.add_node("holder")
    double.add_node("waiter")
    agents = []
    for name in ("holder", "waiter"):
        state = health_state(name, clock, PROBES)
        record(state, "network", "network.dns", "fail", "DnsFailed")
        agents.append(make_agent(double, state, clock, seed=7, max_unhealthy="1"))
        agents[-1].reconcile_once()
    asked_at = []
    for _ in range(4 * 3600):
        clock.advance(1)
        before = len(double.log)
        agents[1].step()
        if any(r.method == "GET" and r.path == f"{CONFIGMAPS}/node-health-budget" for r in double.log[before:]):
            asked_at.append(clock.now)
    gaps = [b - a for a, b in itertools.pairwise(asked_at)]
    ceilings = [min(300.0, 60.0 * 2 ** (n + 1)) for n in range(len(gaps))]
    for gap, ceiling in zip(gaps, ceilings, strict=True):
        assert ceiling / 2 <= gap <= ceiling + 1, (gaps, ceilings)
    assert len(set(gaps[4:])) > 1, "jittered: the gaps at the cap differ"
    assert max(gaps) <= 301


@pytest.mark.system
def test_the_node_count_is_shared_refreshed_rarely_and_read_from_the_watch_cache(double: ApiDouble) -> None:
    fleet(double, 50)
    clock = Clock()
    agents = []
    for i in range(3):
        name = f"gpu-{i}"
        double.add_node(name, labels={"pool": "accel"})
        state = health_state(name, clock, PROBES)
        record(state, "network", "network.dns", "fail", "DnsFailed")
        agents.append(make_agent(double, state, clock, seed=i, max_unhealthy="5%", budget_node_selector="pool=accel"))
    for agent in agents:
        agent.reconcile_once()

    def node_lists(start: int = 0) -> list[dict[str, list[str]]]:
        return [r.query for r in double.log[start:] if r.method == "GET" and r.path == "/api/v1/nodes"]

    assert node_lists() == [{"labelSelector": ["pool=accel"], "resourceVersion": ["0"]}], "one agent counted"
    assert blocking_tainted(double.nodes()) == ["gpu-0", "gpu-1", "gpu-2"], "5% of 53 nodes is 3"
    record_ = fleet_record(double)
    assert (record_["nodes"], record_["selector"], record_["recount_by"]) == (53, "pool=accel", "")

    # The count ages past budget_recount_seconds: the next agent that needs a slot counts again, once.
    fleet(double, 0)
    double.add_node("gpu-3", labels={"pool": "accel"})
    state = health_state("gpu-3", clock, PROBES)
    record(state, "network", "network.dns", "fail", "DnsFailed")
    late = make_agent(double, state, clock, max_unhealthy="5%", budget_node_selector="pool=accel")
    clock.advance(901)
    start = len(double.log)
    late.reconcile_once()
    assert node_lists(start) == [{"labelSelector": ["pool=accel"], "resourceVersion": ["0"]}]
    assert blocking_tainted(double.nodes()) == ["gpu-0", "gpu-1", "gpu-2"], "5% of 54 is still 3"


@pytest.mark.system
def test_while_another_agent_holds_the_counting_lease_a_first_count_is_awaited(double: ApiDouble) -> None:
    clock = Clock()
    double.add_node("a")
    lease = {"nodes": None, "recount_by": "b", "recount_at": clock.now - 5}
    double.create("configmaps", BUDGET_NS, budget_configmap({}, lease))
    state = health_state("a", clock, PROBES)
    record(state, "network", "network.dns", "fail", "DnsFailed")
    agent = make_agent(double, state, clock, max_unhealthy="50%")
    agent.reconcile_once()
    assert our_taints(double.node("a")) == {}
    condition = conditions(double.node("a"))["NetworkHealthy"]
    assert condition["message"].startswith(
        "taint node-health/network=DnsFailed withheld: the cluster taint budget is being counted"
    )
    assert not any(r.path == "/api/v1/nodes" for r in double.log), "the lease holder counts, nobody else"
    clock.advance(3600)  # the lease holder died: its lease expires and this agent counts
    agent.step()
    assert our_taints(double.node("a")) == {"network": ("DnsFailed", "NoSchedule")}


def slot(at: float) -> str:
    return json.dumps({"acquired_at": at, "taints": "network=DnsFailed"})


@pytest.mark.system
def test_a_full_count_prunes_slots_of_gone_and_untainted_nodes(double: ApiDouble) -> None:
    clock = Clock()
    for name in ("a", "b", "c"):
        double.add_node(name)
    data = {"gone": slot(0), "b": slot(0), "c": slot(clock.now)}  # b's agent died; c is about to taint
    double.create("configmaps", BUDGET_NS, {"metadata": {"name": "node-health-budget"}, "data": data})
    state = health_state("a", clock, PROBES)
    agent = make_agent(double, state, clock, max_unhealthy="2")
    record(state, "network", "network.dns", "fail", "DnsFailed")
    agent.reconcile_once()
    assert our_taints(double.node("a")) == {"network": ("DnsFailed", "NoSchedule")}
    assert set(slots(double) or {}) == {"a", "c"}
    assert agent.status()["budget"]["slot_held"] is True


@pytest.mark.system
def test_when_the_budget_is_spent_holders_are_verified_with_the_tainted_label(double: ApiDouble) -> None:
    clock = Clock()
    tainted = {"key": f"{PREFIX}/storage", "value": "MountMissing", "effect": "NoSchedule"}
    double.add_node("a")
    double.add_node("b")  # holds a slot but its agent died after removing the taint
    double.add_node("c", labels={f"{PREFIX}/tainted": "true"}, taints=[tainted])
    fleet = {"nodes": 3, "selector": "", "counted_at": clock.now - 10, "verified_at": clock.now - 600}
    double.create("configmaps", BUDGET_NS, budget_configmap({"b": slot(0), "c": slot(0)}, fleet))
    state = health_state("a", clock, PROBES)
    record(state, "network", "network.dns", "fail", "DnsFailed")
    agent = make_agent(double, state, clock, max_unhealthy="2")
    start = len(double.log)
    agent.reconcile_once()
    reads = [(r.path, r.query.get("labelSelector")) for r in double.log[start:] if r.method == "GET"]
    assert ("/api/v1/nodes", [f"{PREFIX}/tainted=true"]) in reads
    assert ("/api/v1/nodes/b", None) in reads, "a holder the label list lacks is read on its own"
    assert not [r for r in reads if r == ("/api/v1/nodes", None)], "never the whole fleet"
    assert set(slots(double) or {}) == {"a", "c"}
    assert our_taints(double.node("a")) == {"network": ("DnsFailed", "NoSchedule")}


@pytest.mark.system
def test_a_tainted_node_without_a_slot_counts_and_keeps_its_taint(double: ApiDouble) -> None:
    clock = Clock()
    taint = {"key": f"{PREFIX}/storage", "value": "MountMissing", "effect": "NoSchedule"}
    double.add_node("a", taints=[taint])  # tainted by a previous run; the budget ConfigMap was deleted since
    double.add_node("b")
    state_b = health_state("b", clock, PROBES)
    agent_b = make_agent(double, state_b, clock, max_unhealthy="1")
    record(state_b, "network", "network.dns", "fail", "DnsFailed")
    agent_b.reconcile_once()
    assert our_taints(double.node("b")) == {}, "a's taint already spends the budget of 1"
    assert set(slots(double) or {}) == {"a"}, "found tainted: adopted as a holder"

    state_a = health_state("a", clock, {"storage": ("storage.mounts",)})
    agent_a = make_agent(double, state_a, clock, max_unhealthy="1")
    record(state_a, "storage", "storage.mounts", "fail", "MountMissing")
    agent_a.reconcile_once()
    assert our_taints(double.node("a")) == {"storage": ("MountMissing", "NoSchedule")}
    assert labels(double.node("a"))[f"{PREFIX}/tainted"] == "true", "labelled on its agent's first write"
    assert set(slots(double) or {}) == {"a"}
    assert agent_a.status()["budget"]["slot_held"] is True


def test_blocking_effects_are_the_ones_the_budget_counts() -> None:
    assert BLOCKING == ("NoSchedule", "NoExecute")
    node: dict[str, Any] = {
        "metadata": {"name": "x"},
        "spec": {"taints": [{"key": f"{PREFIX}/npu", "effect": "PreferNoSchedule"}]},
    }
    assert blocking_tainted([node]) == []
