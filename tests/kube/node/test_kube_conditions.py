"""Conditions read right in `kubectl describe node`, against the API double: True is always reason Healthy (warns
are listed in the message), False carries the worst failing reason, Unknown says why there is no verdict."""

from __future__ import annotations

import pytest
from support.kube_double import ApiDouble
from support.kube_helpers import Clock, all_ok, conditions, finding, health_state, make_agent

from agent.reasons import PROBE_TIMEOUT
from agent.state import HealthState

PROBES = {"time": ("time.sync", "time.ntp"), "storage": ("storage.mounts",)}


def condition(double: ApiDouble, kind: str) -> tuple[str, str, str]:
    c = conditions(double.node("n1"))[kind]
    return c["status"], c["reason"], c["message"]


def clock_checks(state: HealthState, sync: tuple[str, str] = ("ok", ""), ntp: tuple[str, str] = ("ok", "")) -> None:
    """One run of the time probe: both its checks."""
    state.record("time", [finding("time.sync", *sync), finding("time.ntp", *ntp)])


@pytest.mark.system
def test_warming_up_warn_fail_unknown_and_back(double: ApiDouble) -> None:
    clock = Clock()
    double.add_node("n1")
    state = health_state("n1", clock, PROBES)
    agent = make_agent(double, state, clock)
    agent.reconcile_once()
    assert condition(double, "ClockSynced") == (
        "Unknown",
        "WarmingUp",
        "unknown: WarmingUp (time.ntp), WarmingUp (time.sync)",
    )

    all_ok(state, PROBES)
    clock_checks(state, sync=("warn", "ClockUnsynced"))
    agent.reconcile_once()
    assert condition(double, "ClockSynced") == (
        "True",
        "Healthy",
        "warn: ClockUnsynced (time.sync); 2 of 2 checks passed — time.sync: time.sync is warn",
    )
    assert condition(double, "StorageHealthy") == ("True", "Healthy", "1 of 1 checks passed")

    clock.advance(30)
    clock_checks(state, sync=("unknown", PROBE_TIMEOUT.code))
    agent.reconcile_once()
    assert condition(double, "ClockSynced") == (
        "Unknown",
        PROBE_TIMEOUT.code,
        "unknown: ProbeTimeout (time.sync) — time.sync: time.sync is unknown",
    )

    clock.advance(30)
    clock_checks(state, sync=("fail", "ClockSkew"), ntp=("warn", "NtpSlow"))
    agent.reconcile_once()
    assert condition(double, "ClockSynced") == (
        "False",
        "ClockSkew",
        "fail: ClockSkew (time.sync); warn: NtpSlow (time.ntp) — time.sync: time.sync is fail",
    )

    clock.advance(30)
    clock_checks(state)
    agent.reconcile_once()
    assert condition(double, "ClockSynced") == ("True", "Healthy", "2 of 2 checks passed")
    events = [(e["reason"], e["type"]) for e in double.events() if e["message"].startswith("ClockSynced")]
    assert events == [
        ("Healthy", "Normal"),  # Unknown (warming up) -> True
        (PROBE_TIMEOUT.code, "Normal"),
        ("ClockSkew", "Warning"),
        ("Healthy", "Normal"),
    ]


@pytest.mark.system
def test_a_true_condition_never_carries_a_problem_reason(double: ApiDouble) -> None:
    clock = Clock()
    double.add_node("n1")
    state = health_state("n1", clock, PROBES)
    agent = make_agent(double, state, clock, warn_effect="PreferNoSchedule")
    all_ok(state, PROBES)
    for reason in ("ClockUnsynced", "NtpSlow", "Whatever"):
        clock.advance(30)
        clock_checks(state, sync=("warn", reason))
        agent.reconcile_once()
        status, got, message = condition(double, "ClockSynced")
        assert (status, got) == ("True", "Healthy")
        assert message.startswith(f"warn: {reason} (time.sync)"), "a new warn is written at once"
