"""The device budget: a fleet-wide false positive on devices never isolates more than the budget, the rest is
withheld and says so, and a waiting node's cost does not grow with the fleet (O(isolated), not O(fleet))."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import kubernetes.client
import pytest
from support.kube_devices import GPUS, gpu_finding, publish_gpus
from support.kube_double import ApiDouble
from support.kube_helpers import (
    BUDGET_NS,
    GARBAGE_FLEETS,
    PREFIX,
    YEAR,
    Clock,
    conditions,
    health_state,
    make_agent,
    our_taints,
    passes_over_garbage,
)

from agent.kube import KubeAgent
from agent.state import HealthState

PROBES = {"gpu": ("gpu.health",)}
DEVICE_BUDGET = f"/api/v1/namespaces/{BUDGET_NS}/configmaps/node-health-device-budget"


class RuleWatch:
    """after_write hook: the agents' rules after every stored change, and the most there ever were."""

    def __init__(self) -> None:
        self.most = 0

    def __call__(self, api: ApiDouble) -> None:
        count = sum(1 for key in api._store.objects if key[0] == "devicetaintrules")
        self.most = max(self.most, count)


def drive(pool: ThreadPoolExecutor, agents: Iterable[KubeAgent], clock: Clock, done: Callable[[], bool]) -> None:
    agents = list(agents)
    for _ in range(200):
        list(pool.map(lambda agent: agent.step(), agents))
        if done():
            return
        clock.advance(5)
    raise AssertionError("the fleet did not converge")


def every_gpu(state: HealthState, status: str) -> None:
    """A gpu probe run; status warn: a bad driver release marks every GPU of the fleet at once."""
    reason = "GpuThrottled" if status == "warn" else "OK"
    state.record("gpu", [gpu_finding(g, "gpu.health", status, reason) for g in GPUS])


def device_budget_configmap(data: dict[str, str], fleet: str) -> dict[str, object]:
    """A device budget ConfigMap as agents write it: slots in data, the fleet record (as written) in an annotation."""
    used = sum(len(json.loads(raw).get("devices") or []) for raw in data.values())
    annotations = {f"{PREFIX}/device-slots": str(used), f"{PREFIX}/device-fleet": fleet}
    return {"metadata": {"name": "node-health-device-budget", "annotations": annotations}, "data": data}


def device_fleet(double: ApiDouble) -> dict[str, object]:
    configmap = double.configmap(BUDGET_NS, "node-health-device-budget") or {}
    return dict(json.loads(configmap["metadata"]["annotations"][f"{PREFIX}/device-fleet"]))


def device_budget(double: ApiDouble) -> dict[str, list[str]]:
    configmap = double.configmap(BUDGET_NS, "node-health-device-budget") or {}
    return {node: json.loads(raw)["devices"] for node, raw in (configmap.get("data") or {}).items()}


@pytest.mark.system
def test_a_fleet_wide_false_positive_is_capped_by_the_device_budget(double: ApiDouble) -> None:
    nodes, per_node = 40, len(GPUS)
    limit = nodes * per_node // 10  # 10% of 320 GPUs
    clock = Clock()
    double.serve_dra("1.37")
    names = [f"gpu-{i:03d}" for i in range(nodes)]
    for name in names:
        double.add_node(name)
        publish_gpus(double, name)
    watch = RuleWatch()
    double.after_write = watch
    configuration = kubernetes.client.Configuration(host=double.host)
    configuration.connection_pool_maxsize = 8
    client = kubernetes.client.ApiClient(configuration)
    states = {name: health_state(name, clock, PROBES) for name in names}
    agents = {name: make_agent(double, states[name], clock, seed=i, client=client) for i, name in enumerate(names)}
    for state in states.values():
        every_gpu(state, "ok")

    with ThreadPoolExecutor(max_workers=8) as pool:
        drive(pool, agents.values(), clock, lambda: all(a.last_success for a in agents.values()))
        for state in states.values():
            every_gpu(state, "warn")
        drive(pool, agents.values(), clock, lambda: len(double.device_taint_rules()) == limit)
        for _ in range(30):  # a while longer: nobody gets past the budget, however often they ask
            list(pool.map(lambda agent: agent.step(), agents.values()))
            clock.advance(5)

        rules = double.device_taint_rules()
        assert len(rules) == limit and watch.most == limit, "never more than the budget, at any instant"
        assert {r["spec"]["taint"]["effect"] for r in rules} == {"None"}, "a warn is informational"
        assert sum(len(devices) for devices in device_budget(double).values()) == limit
        withheld = [
            n for n in names if agents[n].status()["devices"]["budget"]["held"] != [f"gpu{i}" for i in range(8)]
        ]
        assert withheld, "most nodes could not isolate every GPU"
        for name in withheld:
            node = double.node(name)
            assert our_taints(node) == {}, "a withheld device does not fall back to the node taint"
            message = conditions(node)["GPUHealthy"]["message"]
            assert "isolation withheld: the device budget is spent" in message
            assert f"device budget: {limit} of {limit} devices isolated" in message.split(" — ", 1)[1], "in the details"
            entries = json.loads(node["metadata"]["annotations"]["node-health/isolated-devices"])
            assert "withheld" in {e["mechanism"] for e in entries}
        warned = [
            e["involvedObject"]["name"] for e in double.events() if e["reason"] == "DeviceTaintSuppressedByBudget"
        ]
        assert sorted(warned) == sorted(withheld), "one Event per node, not one per chip"

        # Waiting costs a metadata GET of the budget, whatever the fleet: nothing lists the fleet's Nodes or slices.
        start = len(double.log)
        for _ in range(24):
            list(pool.map(lambda agent: agent.step(), agents.values()))
            clock.advance(5)
        window = double.log[start:]
        assert not [r for r in window if r.path == "/api/v1/nodes"], "no Node list while waiting"
        assert not [r for r in window if r.path.endswith("/resourceslices") and "fieldSelector" not in r.query]
        full = [r for r in window if r.path == DEVICE_BUDGET and "PartialObjectMetadata" not in r.accept]
        metadata = [r for r in window if r.path == DEVICE_BUDGET and "PartialObjectMetadata" in r.accept]
        assert metadata and len(full) <= len(metadata) // 4, (len(full), len(metadata))

        for state in states.values():
            every_gpu(state, "ok")
        drive(pool, agents.values(), clock, lambda: not double.device_taint_rules() and not device_budget(double))
    assert watch.most == limit


@pytest.mark.system
def test_slots_of_a_node_whose_rules_are_gone_are_verified_away(double: ApiDouble) -> None:
    """A node whose agent died holds slots for rules that are gone: when the budget is spent, the next node to ask
    verifies the holders against the agents' labelled rules, and gets the slot."""
    clock = Clock()
    double.serve_dra("1.37")
    for name in ("n1", "n2"):
        double.add_node(name)
        publish_gpus(double, name)
    stale = {"devices": ["gpu0"], "at": clock.now - 3600}
    fleet = {"nodes": 16, "selector": "", "counted_at": clock.now, "verified_at": 0, "recount_by": "", "recount_at": 0}
    double.create(
        "configmaps",
        BUDGET_NS,
        {
            "metadata": {
                "name": "node-health-device-budget",
                "annotations": {"node-health/device-slots": "1", "node-health/device-fleet": json.dumps(fleet)},
            },
            "data": {"gone-node": json.dumps(stale)},
        },
    )
    state = health_state("n1", clock, PROBES)
    agent = make_agent(double, state, clock, max_unhealthy_devices="1")
    state.record("gpu", [gpu_finding(g, "gpu.health", "fail" if g.index == 2 else "ok", "GpuThrottled") for g in GPUS])
    agent.reconcile_once()
    assert len(double.device_taint_rules()) == 1
    assert device_budget(double) == {"n1": ["gpu2"]}, "the dead node's slot was verified away"
    listed = [r for r in double.log if r.path.endswith("/devicetaintrules") and r.method == "GET"]
    assert any(
        "node-health/node" in r.query["labelSelector"][0] and "=" not in r.query["labelSelector"][0].split(",")[-1]
        for r in listed
    )


def gpu_nodes(double: ApiDouble, names: Iterable[str]) -> None:
    double.serve_dra("1.37")
    for name in names:
        double.add_node(name)
        publish_gpus(double, name)


@pytest.mark.system
def test_a_device_budget_record_from_a_year_ahead_is_stale(double: ApiDouble) -> None:
    """A node whose clock ran a year ahead counted the devices (wrongly), took the counting lease and a slot, then
    died: its records must neither suppress the recount and the verification nor keep its slot young."""
    clock = Clock()
    ahead = clock.now + YEAR
    gpu_nodes(double, ("n1", "n2"))
    fleet = {"nodes": 8, "selector": "", "counted_at": ahead, "verified_at": ahead, "recount_by": "dead"}
    fleet["recount_at"] = ahead
    slot = json.dumps({"devices": ["gpu0"], "at": ahead})
    double.create("configmaps", BUDGET_NS, device_budget_configmap({"dead": slot}, json.dumps(fleet)))
    state = health_state("n1", clock, PROBES)
    agent = make_agent(double, state, clock, max_unhealthy_devices="10%")  # of 16 GPUs: 2 (of the bogus 8: 1)
    state.record(
        "gpu", [gpu_finding(g, "gpu.health", "fail" if g.index in (2, 3) else "ok", "GpuThrottled") for g in GPUS]
    )
    agent.reconcile_once()
    assert device_budget(double) == {"n1": ["gpu2", "gpu3"]}, "the dead node's slot from the future was pruned"
    assert len(double.device_taint_rules()) == 2
    written = device_fleet(double)
    assert written["counted_at"] == written["verified_at"] == clock.now and written["nodes"] == 16


@pytest.mark.system
@pytest.mark.parametrize("raw", GARBAGE_FLEETS)
def test_garbage_in_the_device_budget_is_counted_again_never_failing_open(
    double: ApiDouble, raw: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two nodes of 8 GPUs, every GPU failing, a budget of 10% (2 devices): exactly 2 rules, after one recount."""
    clock = Clock()
    gpu_nodes(double, ("a", "b"))
    garbage_slot = '{"devices": ["gpu0"], "at": 1e999}'  # a slot of garbage too, of a node isolating nothing
    double.create("configmaps", BUDGET_NS, device_budget_configmap({"d": garbage_slot}, raw))
    states = [health_state(name, clock, PROBES) for name in ("a", "b")]
    agents = [make_agent(double, s, clock, seed=i, max_unhealthy_devices="10%") for i, s in enumerate(states)]
    for state in states:
        every_gpu(state, "warn")
    logged = passes_over_garbage(agents, clock, caplog)
    assert len(double.device_taint_rules()) == 2, "10% of 16 GPUs: never more, and no fewer once the garbage goes"
    assert "d" not in device_budget(double), "the garbage slot of a node isolating nothing was pruned"
    assert sum(len(devices) for devices in device_budget(double).values()) == 2
    assert device_fleet(double)["nodes"] == 16
    assert logged >= 1, "the garbage was logged"


@pytest.mark.system
def test_a_garbage_device_fleet_record_that_stays_is_logged_once(
    double: ApiDouble, caplog: pytest.LogCaptureFixture
) -> None:
    """The budget ConfigMap cannot be written (every PUT fails): the garbage stays, the agent asks again after
    each backoff and is refused each time (fail closed), and says once that the record is garbage."""
    clock = Clock()
    gpu_nodes(double, ("a",))
    double.create("configmaps", BUDGET_NS, device_budget_configmap({}, '{"nodes": 1e999}'))
    double.inject(path="configmaps/node-health-device-budget", method="PUT", status=500, times=-1)
    state = health_state("a", clock, PROBES)
    agent = make_agent(double, state, clock, max_unhealthy_devices="10%")
    every_gpu(state, "warn")
    with caplog.at_level(logging.WARNING, logger="agent.kube"):
        for _ in range(4):
            agent.reconcile_once()
            clock.advance(600)  # past any backoff
    assert double.device_taint_rules() == [], "no rule without a slot"
    puts = [r for r in double.log if r.method == "PUT" and r.path == DEVICE_BUDGET]
    assert len(puts) >= 3, "it asked again"
    logged = [r for r in caplog.records if "fleet record is garbage" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]
