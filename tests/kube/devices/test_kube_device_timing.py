"""Device isolation over time, by the real reconciler on the API double: its timers run on the monotonic clock (a
wall clock stepped back holds nothing), DRA discovery is cached and checked again after `dra_recheck_seconds`,
and a DeviceTaintRule goes only once the device's recovery passes the health state's hysteresis."""

from __future__ import annotations

from typing import Any

import pytest
from support.kube_devices import publish_gpus, publish_npus, record_gpus, record_npus
from support.kube_double import ApiDouble
from support.kube_helpers import Clock, conditions, health_state, make_agent, our_taints, record

from agent.kube.devices.match import rule_name
from agent.state import HealthState

PROBES = {"gpu": ("gpu.holders",), "npu": ("npu.holders",), "storage": ("storage.mounts",)}
GPU3_RULE = rule_name("node-health", "gpu", "n1", "gpu.nvidia.com", "gpu-5")  # GPU index 3 is /dev/nvidia5
HOURS = 3600.0
DISCOVERY = ("/apis/resource.k8s.io/v1", "/apis/resource.k8s.io/v1beta2")


def node(
    double: ApiDouble, release: str = "1.37", recovery_threshold: int = 1
) -> tuple[HealthState, Any, Clock, Clock]:
    """Node n1 with eight GPUs and eight chips published; its agent's wall and monotonic clocks apart."""
    wall, mono = Clock(), Clock(start=5000.0)
    double.serve_dra(release)
    double.add_node("n1")
    publish_gpus(double, "n1")
    publish_npus(double, "n1")
    state = health_state("n1", wall, PROBES, recovery_threshold=recovery_threshold)
    agent = make_agent(double, state, wall, monotonic=mono, max_unhealthy="100%", max_unhealthy_devices="100%")
    return state, agent, wall, mono


def results(state: HealthState, bad: dict[int, str] | None = None) -> None:
    record(state, "storage", "storage.mounts", "ok")
    record_npus(state)
    record_gpus(state, bad)


def rules(double: ApiDouble) -> list[str]:
    return sorted(r["metadata"]["name"] for r in double.device_taint_rules())


def discoveries(double: ApiDouble) -> int:
    return sum(1 for method, path in double.requests if method == "GET" and path in DISCOVERY)


@pytest.mark.system
def test_a_wall_clock_stepped_back_3_hours_after_a_failed_device_call_holds_nothing(double: ApiDouble) -> None:
    state, agent, wall, mono = node(double)
    double.inject(r"/devicetaintrules$", method="POST", status=500, times=1)
    results(state, {3: "GpuHeldOutOfBand"})
    agent.step()
    assert rules(double) == [] and agent.status()["devices"]["errors"] == {"server": 1}
    assert our_taints(double.node("n1"))["gpu"] == ("GpuHeldOutOfBand", "NoSchedule"), "fail closed: the node"

    wall.advance(-3 * HOURS)  # NTP steps the clock back
    mono.advance(5)  # past the device backoff (1 s at first)
    results(state, {3: "GpuHeldOutOfBand"})
    agent.step()
    assert rules(double) == [GPU3_RULE], "the rule waited 3 h"
    assert "gpu" not in our_taints(double.node("n1"))

    double.inject(r"/devicetaintrules/", method="DELETE", status=500, times=1)
    mono.advance(30)
    results(state)
    agent.step()
    assert rules(double) == [GPU3_RULE] and agent.status()["devices"]["errors"] == {"server": 2}
    wall.advance(-3 * HOURS)
    mono.advance(5)
    results(state)
    agent.step()
    assert rules(double) == [], "the removal waited 3 h"


@pytest.mark.system
def test_dra_discovery_is_cached_and_checked_again_after_the_recheck_period(double: ApiDouble) -> None:
    """Discovery costs its GETs once; a cluster upgraded meanwhile (DeviceTaintRules moving from v1beta2 to v1) is
    seen once `dra_recheck_seconds` (600) of the agent's monotonic time have passed, whatever the wall clock says."""
    state, agent, wall, mono = node(double, "1.36")
    results(state, {3: "GpuHeldOutOfBand"})
    agent.step()
    assert discoveries(double) == 2, "v1 (no DeviceTaintRules in 1.36), then v1beta2"
    assert agent.status()["devices"]["dra"]["rules_version"] == "v1beta2"
    assert rules(double) == [GPU3_RULE]

    double.serve_dra("1.37")  # the control plane is upgraded
    for _ in range(5):  # 500 s: within the recheck period, the version found stands
        mono.advance(100)
        results(state, {3: "GpuHeldOutOfBand"})
        agent.step()
    assert discoveries(double) == 2, "cached: no discovery GET on later passes"
    assert agent.status()["devices"]["dra"]["rules_version"] == "v1beta2"

    wall.advance(-3 * HOURS)  # the wall clock going back does not delay the recheck, nor does it drive it
    mono.advance(101)
    results(state, {3: "GpuHeldOutOfBand"})
    agent.step()
    assert discoveries(double) == 3, "discovered again: v1 serves DeviceTaintRules now"
    assert agent.status()["devices"]["dra"]["rules_version"] == "v1"
    assert ("GET", f"/apis/resource.k8s.io/v1/devicetaintrules/{GPU3_RULE}") in double.requests, "read back in v1"

    mono.advance(30)
    results(state)
    agent.step()
    assert rules(double) == []
    deletes = [w.path for w in double.writes if w.method == "DELETE"]
    assert deletes == [f"/apis/resource.k8s.io/v1/devicetaintrules/{GPU3_RULE}"], "deleted through v1"
    for _ in range(3):  # nothing bad, nothing owned: nothing read, however long it has been
        mono.advance(700)
        results(state)
        agent.step()
    assert discoveries(double) == 3


@pytest.mark.system
def test_a_rule_goes_only_after_recovery_threshold_passing_results(double: ApiDouble) -> None:
    """recovery_threshold 2: one ok result after a failure keeps the rule (and the condition), the second removes
    it, as it does a node taint."""
    state, agent, _wall, mono = node(double, recovery_threshold=2)
    results(state, {3: "GpuHeldOutOfBand"})
    agent.step()
    assert rules(double) == [GPU3_RULE]

    mono.advance(30)
    results(state)
    agent.step()
    assert rules(double) == [GPU3_RULE], "one passing result is not a recovery"
    assert conditions(double.node("n1"))["GPUHealthy"]["status"] == "False"

    mono.advance(30)
    results(state)
    agent.step()
    assert rules(double) == []
    assert conditions(double.node("n1"))["GPUHealthy"]["status"] == "True"
