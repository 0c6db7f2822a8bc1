"""Clocks and garbage in the Kubernetes part: a wall clock stepped back, a node whose clock runs a year ahead,
and numbers in the budget ConfigMap that are not numbers a count can be.

Every retry, heartbeat and backoff runs on the monotonic clock; the wall clock only stamps what is written out.
Budget records carry other nodes' wall clocks: a record from the future is stale, and garbage is counted again
(without ever tainting beyond the limit, and without leaving a failing node untainted beyond one recount).
"""

from __future__ import annotations

import json
import logging

import pytest
from support.kube_double import ApiDouble
from support.kube_helpers import (
    BUDGET_NS,
    GARBAGE_FLEETS,
    PREFIX,
    YEAR,
    Clock,
    all_ok,
    blocking_tainted,
    budget_configmap,
    conditions,
    fleet_record,
    health_state,
    make_agent,
    our_taints,
    passes_over_garbage,
    record,
    slots,
)

from agent.kube.slots import Fleet, record_age, slots_count

PROBES = {"network": ("network.dns",)}
HOURS = 3600.0
# Slots count annotations (`<prefix>/slots`) that are garbage: each is not believed, the slots are read instead.
GARBAGE_COUNTS = ["4000000000", "1000001", "-1", "1e999", "NaN", "1.0", " 1", "1_0", "\u0663", ""]


def failing(name: str, wall: Clock) -> object:
    state = health_state(name, wall, PROBES)
    record(state, "network", "network.dns", "fail", "DnsFailed")
    return state


@pytest.mark.system
def test_a_wall_clock_stepped_back_3_hours_after_a_failed_call_stops_nothing(double: ApiDouble) -> None:
    wall, mono = Clock(), Clock(start=5000.0)
    double.add_node("n1")
    state = health_state("n1", wall, PROBES)
    all_ok(state, PROBES)
    agent = make_agent(double, state, wall, monotonic=mono, backoff_initial_seconds=1, backoff_max_seconds=2)
    double.inject(r"/nodes/n1$", method="GET", status=500, times=1)
    agent.step()
    assert agent.status()["errors"].get("server") == 1 and agent.backoff_seconds > 0
    wall.advance(-3 * HOURS)  # NTP steps the clock back
    mono.advance(3)  # past the backoff
    record(state, "network", "network.dns", "fail", "DnsFailed")
    agent.step()
    assert our_taints(double.node("n1")) == {"network": ("DnsFailed", "NoSchedule")}, "the retry waited 3 h"
    beat = conditions(double.node("n1"))["NetworkHealthy"]["lastHeartbeatTime"]

    # The heartbeat: due 600 s of this agent's time later, whatever the wall clock did meanwhile.
    wall.advance(-3 * HOURS)
    mono.advance(601)
    agent.step()
    assert conditions(double.node("n1"))["NetworkHealthy"]["lastHeartbeatTime"] != beat


@pytest.mark.system
def test_the_budget_retry_and_the_event_backoff_ignore_a_clock_step(double: ApiDouble) -> None:
    wall, mono = Clock(), Clock(start=5000.0)
    for name in ("a", "b"):
        double.add_node(name)
    holder = failing("b", wall)
    make_agent(double, holder, wall, max_unhealthy="1").reconcile_once()  # b takes the only slot
    state = failing("a", wall)
    agent = make_agent(double, state, wall, monotonic=mono, max_unhealthy="1", budget_retry_seconds=60)
    double.inject(r"/namespaces/default/events$", method="POST", status=503, times=1)
    agent.step()
    assert our_taints(double.node("a")) == {} and agent.suppressed
    assert agent.events.retry_at > mono.now, "the event is queued behind its own backoff"
    record(holder, "network", "network.dns", "ok")  # type: ignore[arg-type]
    make_agent(double, holder, wall, max_unhealthy="1").reconcile_once()  # b recovers: its slot is free
    wall.advance(-3 * HOURS)
    mono.advance(400)  # past the budget retry (60 s, jittered, at most 300) and the event backoff
    agent.step()
    assert our_taints(double.node("a")) == {"network": ("DnsFailed", "NoSchedule")}, "asked again on time"
    assert len(agent.events) == 0, "the queued events went out after their backoff"


@pytest.mark.parametrize(("stamp", "age"), [(100.0, 900.0), (1003.0, 0.0), (1000.0 + YEAR, float("inf"))])
def test_a_record_is_as_old_as_this_agents_clock_says(stamp: float, age: float) -> None:
    assert record_age(stamp, 1000.0) == age


@pytest.mark.system
def test_a_budget_record_from_a_year_ahead_is_stale(double: ApiDouble) -> None:
    """A node whose clock ran a year ahead wrote the fleet record and took a slot, then died: its record must
    neither suppress the recount and verification nor keep its slot young."""
    wall = Clock()
    ahead = wall.now + YEAR
    for name in ("a", "dead", "c"):
        double.add_node(name)
    fleet = {"nodes": 3, "selector": "", "counted_at": ahead, "verified_at": ahead, "recount_by": "dead"}
    fleet["recount_at"] = ahead
    slot = json.dumps({"acquired_at": ahead, "taints": "network=DnsFailed"})
    double.create("configmaps", BUDGET_NS, budget_configmap({"dead": slot}, fleet))
    agent = make_agent(double, failing("a", wall), wall, max_unhealthy="1")  # type: ignore[arg-type]
    agent.reconcile_once()
    assert our_taints(double.node("a")) == {"network": ("DnsFailed", "NoSchedule")}
    assert set(slots(double) or {}) == {"a"}, "the dead node's slot from the future was pruned"
    written = fleet_record(double)
    assert written["counted_at"] == written["verified_at"] == wall.now and written["nodes"] == 3


@pytest.mark.parametrize("raw", GARBAGE_FLEETS)
def test_garbage_fleet_records_are_refused_by_one_function(raw: str) -> None:
    with pytest.raises(ValueError):
        Fleet.validated(raw)
    assert Fleet.parse(raw) == Fleet()


@pytest.mark.system
@pytest.mark.parametrize("raw", GARBAGE_FLEETS)
def test_garbage_in_the_budget_configmap_is_counted_again_never_failing_open(
    double: ApiDouble, raw: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Four nodes, three failing, a budget of 25% (one slot): exactly one taint, after one recount."""
    wall = Clock()
    names = ("a", "b", "c", "d")
    for name in names:
        double.add_node(name)
    garbage_slot = '{"acquired_at": NaN, "taints": "x"}'  # a slot record of garbage too, of a node not tainted
    configmap = budget_configmap({"d": garbage_slot})
    configmap["metadata"]["annotations"][f"{PREFIX}/fleet"] = raw  # type: ignore[index]
    double.create("configmaps", BUDGET_NS, configmap)
    agents = [make_agent(double, failing(n, wall), wall, seed=i, max_unhealthy="25%") for i, n in enumerate("abc")]  # type: ignore[arg-type]
    logged = passes_over_garbage(agents, wall, caplog)
    assert len(blocking_tainted(double.nodes())) == 1, "one slot: 25% of 4 nodes"
    written = fleet_record(double)
    assert written["nodes"] == 4 and Fleet.validated(json.dumps(written)).nodes == 4
    assert "d" not in (slots(double) or {}), "the garbage slot of an untainted node was pruned"
    assert logged >= 1, "the garbage was logged"


@pytest.mark.parametrize("raw", GARBAGE_COUNTS)
def test_garbage_slot_counts_are_refused_by_one_function(raw: str) -> None:
    with pytest.raises(ValueError):
        slots_count(raw)
    assert slots_count("0") == 0 and slots_count("1000000") == 1_000_000


@pytest.mark.system
@pytest.mark.parametrize("raw", GARBAGE_COUNTS)
def test_garbage_in_the_slots_count_is_counted_again_never_failing_open(
    double: ApiDouble, raw: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused node asks again from the ConfigMap's metadata alone (the slots count): garbage there neither
    refuses it a free slot nor grants it a taken one; the slots are read and counted, and the garbage logged once."""
    wall = Clock()
    for name in ("a", "b"):
        double.add_node(name)
    holder = failing("b", wall)
    make_agent(double, holder, wall, max_unhealthy="1").reconcile_once()  # b takes the only slot
    timing = {"budget_retry_seconds": 10, "budget_retry_max_seconds": 10, "budget_grace_seconds": 3600}
    agent = make_agent(double, failing("a", wall), wall, max_unhealthy="1", **timing)  # type: ignore[arg-type]
    agent.step()  # refused (the holders verified): from now on it asks from the metadata first
    assert our_taints(double.node("a")) == {} and agent.suppressed

    def garbage() -> None:
        double.mutate(
            "configmaps",
            BUDGET_NS,
            "node-health-budget",
            lambda c: c["metadata"]["annotations"].update({f"{PREFIX}/slots": raw}),
        )

    garbage()
    with caplog.at_level(logging.WARNING, logger="agent.kube"):
        for _ in range(3):
            wall.advance(11)  # past the budget retry, within the grace: the metadata would say it all
            agent.step()
        assert our_taints(double.node("a")) == {}, "b holds the only slot: never failing open"
        record(holder, "network", "network.dns", "ok")  # type: ignore[arg-type]
        make_agent(double, holder, wall, max_unhealthy="1").reconcile_once()  # b recovers: its slot is free
        garbage()
        wall.advance(11)
        agent.step()
    assert our_taints(double.node("a")) == {"network": ("DnsFailed", "NoSchedule")}, "the free slot taken on time"
    assert set(slots(double) or {}) == {"a"}
    logged = [r for r in caplog.records if "slots count is garbage" in r.getMessage()]
    assert len(logged) == 1, "logged once, not on every ask"
