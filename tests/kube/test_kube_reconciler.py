"""The Kubernetes reconciler against the API double, through the real `kubernetes` client."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.kube_double import ApiDouble
from support.kube_helpers import (
    BUDGET_NS,
    DEFAULT_PROBES,
    Clock,
    all_ok,
    conditions,
    configure,
    foreign_taints,
    health_state,
    kube_config,
    labels,
    make_agent,
    our_taints,
    record,
    slots,
)
from support.system import REPO

from agent.config import parse_config
from agent.kube import KubeAgent, load_api_client
from agent.state import HealthSettings, HealthState
from probes.base import Event

FOREIGN_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
FOREIGN_CONDITION = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting"}


def node_writes(double: ApiDouble, node: str) -> int:
    return len(double.node_writes(node))


@pytest.mark.system
def test_failing_check_taints_after_threshold_and_clears_after_recovery(double: ApiDouble) -> None:
    clock = Clock()
    double.add_node("n1", labels={"team": "ml"}, taints=[FOREIGN_TAINT], conditions=[FOREIGN_CONDITION])
    state = health_state("n1", clock, fail_threshold=2, recovery_threshold=2)
    agent = make_agent(double, state, clock)

    agent.reconcile_once()
    node = double.node("n1")
    # Before first results: Unknown conditions, not-ready label, no taint.
    assert {c["type"]: c["status"] for c in conditions(node).values()} == {
        "Ready": "True",
        "StorageHealthy": "Unknown",
        "NPUHealthy": "Unknown",
        "ClockSynced": "Unknown",
    }
    assert conditions(node)["StorageHealthy"]["reason"] == "WarmingUp"
    assert labels(node)["node-health/ready"] == "false"
    assert our_taints(node) == {}

    all_ok(state)
    agent.reconcile_once()
    node = double.node("n1")
    assert labels(node)["node-health/ready"] == "true"
    assert conditions(node)["StorageHealthy"]["status"] == "True"

    record(state, "storage", "storage.mounts", "fail", "MountMissing")
    agent.reconcile_once()
    assert our_taints(double.node("n1")) == {}, "one failure is below the threshold of 2"
    assert conditions(double.node("n1"))["StorageHealthy"]["status"] == "True"

    clock.advance(30)
    record(state, "storage", "storage.mounts", "fail", "MountMissing")
    agent.reconcile_once()
    node = double.node("n1")
    assert our_taints(node) == {"storage": ("MountMissing", "NoSchedule")}
    assert conditions(node)["StorageHealthy"]["status"] == "False"
    assert conditions(node)["StorageHealthy"]["reason"] == "MountMissing"
    assert conditions(node)["StorageHealthy"]["lastTransitionTime"] == "2027-01-15T08:00:30Z"
    assert labels(node)["node-health/ready"] == "false"
    assert foreign_taints(node) == [FOREIGN_TAINT]
    events = [e for e in double.events("default") if e["reason"] == "MountMissing"]
    assert len(events) == 1 and events[0]["type"] == "Warning"
    assert events[0]["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "n1"}
    assert "n1" in slots(double)

    clock.advance(30)
    record(state, "storage", "storage.mounts", "ok")
    agent.reconcile_once()
    assert our_taints(double.node("n1")) == {"storage": ("MountMissing", "NoSchedule")}, "one pass is not recovery"

    clock.advance(30)
    record(state, "storage", "storage.mounts", "ok")
    agent.reconcile_once()
    node = double.node("n1")
    assert our_taints(node) == {}
    assert conditions(node)["StorageHealthy"]["status"] == "True"
    assert labels(node) == {"team": "ml", "node-health/ready": "true"}
    assert foreign_taints(node) == [FOREIGN_TAINT]
    assert conditions(node)["Ready"] == FOREIGN_CONDITION
    assert slots(double) == {}, "the slot came back"
    assert agent.status()["errors"] == {}


@pytest.mark.system
def test_effect_per_reason_and_disabled_reasons(double: ApiDouble) -> None:
    clock = Clock()
    double.add_node("n1")
    state = health_state("n1", clock)
    agent = make_agent(
        double,
        state,
        clock,
        allow_noexecute=True,
        effects={"NpuHealthCritical": "NoExecute", "ClockSkew": "None"},
        warn_effect="PreferNoSchedule",
    )
    record(state, "npu", "npu.health", "fail", "NpuHealthCritical")
    record(state, "time", "time.sync", "fail", "ClockSkew")
    record(state, "storage", "storage.mounts", "warn", "DiskLow")
    agent.reconcile_once()
    node = double.node("n1")
    assert our_taints(node) == {
        "npu": ("NpuHealthCritical", "NoExecute"),
        "storage": ("DiskLow", "PreferNoSchedule"),
    }
    assert conditions(node)["ClockSynced"]["status"] == "False", "an effect of None still reports"
    assert conditions(node)["StorageHealthy"]["status"] == "True", "warn does not make a category unhealthy"
    assert conditions(node)["StorageHealthy"]["reason"] == "Healthy", "True never carries a problem reason"
    assert conditions(node)["StorageHealthy"]["message"].startswith("warn: DiskLow (storage.mounts)")

    agent.reconfigure(
        kube_config(
            allow_noexecute=True, effects={"NpuHealthCritical": "NoExecute"}, disabled_reasons=["NpuHealthCritical"]
        )
    )
    agent.reconcile_once()
    node = double.node("n1")
    assert our_taints(node) == {"time": ("ClockSkew", "NoSchedule")}
    assert conditions(node)["NPUHealthy"]["status"] == "True"


@pytest.mark.system
def test_restart_does_not_flap(double: ApiDouble) -> None:
    clock = Clock()
    double.add_node("n1", taints=[FOREIGN_TAINT])
    state = health_state("n1", clock)
    first = make_agent(double, state, clock)
    all_ok(state)
    record(state, "storage", "storage.mounts", "fail", "MountStale")
    first.reconcile_once()
    before = double.node("n1")
    assert our_taints(before) == {"storage": ("MountStale", "NoSchedule")}
    first.stop()

    # The agent restarts: a new health state with no results yet.
    clock.advance(60)
    writes = len(double.writes)
    state = health_state("n1", clock)
    second = make_agent(double, state, clock, seed=1)
    second.reconcile_once()
    clock.advance(5)
    second.reconcile_once()
    assert double.writes[writes:] == [], "nothing is written while the restarted agent has no results"
    assert double.node("n1") == before

    # Results come one probe at a time: nothing may flip meanwhile.
    record(state, "npu", "npu.health", "ok")
    second.reconcile_once()
    record(state, "time", "time.sync", "ok")
    second.reconcile_once()
    record(state, "storage", "storage.mounts", "fail", "MountStale")
    second.reconcile_once()
    after = double.node("n1")
    assert our_taints(after) == our_taints(before)
    assert conditions(after) == conditions(before), "same status and reason: no write, no new transition time"
    assert labels(after) == labels(before)
    assert node_writes(double, "n1") == 2, "the first agent's two writes; the restarted agent wrote nothing"

    # A fresh result decides: the taint goes only now.
    clock.advance(30)
    record(state, "storage", "storage.mounts", "ok")
    second.reconcile_once()
    assert our_taints(double.node("n1")) == {}


@pytest.mark.system
def test_stale_results_keep_the_taint_and_say_unknown(double: ApiDouble) -> None:
    clock = Clock()
    double.add_node("n1")
    state = health_state("n1", clock)
    agent = make_agent(double, state, clock)
    all_ok(state)
    record(state, "npu", "npu.health", "fail", "NpuHealthAlarm")
    agent.reconcile_once()
    clock.advance(200)  # > 3 intervals + timeout: every result is stale
    state.refresh()
    agent.reconcile_once()
    node = double.node("n1")
    assert our_taints(node) == {"npu": ("NpuHealthAlarm", "NoSchedule")}, "no fresh result: keep the taint"
    assert conditions(node)["NPUHealthy"]["status"] == "Unknown"
    assert conditions(node)["NPUHealthy"]["reason"] == "Stale"
    assert conditions(node)["StorageHealthy"]["reason"] == "Stale"


@pytest.mark.system
def test_removed_checks_are_garbage_collected(double: ApiDouble) -> None:
    clock = Clock()
    double.add_node("n1", labels={"keep": "me"}, taints=[FOREIGN_TAINT], conditions=[FOREIGN_CONDITION])
    state = health_state("n1", clock)
    agent = make_agent(double, state, clock)
    record(state, "storage", "storage.mounts", "fail", "MountMissing")
    record(state, "npu", "npu.health", "fail", "NpuHealthCritical")
    record(state, "time", "time.sync", "ok")
    agent.reconcile_once()
    assert set(our_taints(double.node("n1"))) == {"storage", "npu"}

    configure(state, {"time": ("time.sync",)})  # npu and storage probes removed from config
    agent.reconcile_once()
    node = double.node("n1")
    assert our_taints(node) == {}
    assert set(conditions(node)) == {"Ready", "ClockSynced"}
    assert foreign_taints(node) == [FOREIGN_TAINT]
    assert labels(node) == {"keep": "me", "node-health/ready": "true"}

    # A category whose every check skips (no NPU here) leaves no condition behind either.
    configure(state, {"npu": ("npu.health",), "time": ("time.sync",)})
    record(state, "npu", "npu.health", "skip", "NoNpu")
    agent.reconcile_once()
    assert "NPUHealthy" not in conditions(double.node("n1"))


@pytest.mark.system
def test_dry_run_writes_nothing(double: ApiDouble) -> None:
    clock = Clock()
    double.add_node("n1")
    state = health_state("n1", clock)
    agent = make_agent(double, state, clock, dry_run=True)
    all_ok(state)
    record(state, "storage", "storage.mounts", "fail", "MountMissing", event=Event("LockRemoved", "x"))
    agent.reconcile_once()
    agent.reconcile_once()
    assert double.writes == []
    assert double.configmap(BUDGET_NS, "node-health-budget") is None
    would = agent.status()["would_write"]
    kinds = [w["kind"] for w in would]
    assert "node" in kinds and "node_status" in kinds and "budget" in kinds
    assert any("+taint node-health/storage=MountMissing:NoSchedule" in w["what"] for w in would)
    samples = {s.name: s.value for s in agent.samples() if not s.labels}
    assert samples["nodehealth_kube_dry_run_pending_writes"] >= 3


@pytest.mark.system
def test_finding_events_are_emitted_once_per_distinct_event(double: ApiDouble) -> None:
    clock = Clock()
    double.add_node("n1")
    state = health_state("n1", clock)
    agent = make_agent(double, state, clock)
    all_ok(state)
    agent.reconcile_once()
    lock = Event("StaleLockRemoved", "removed /root/.cache/torch_extensions/x/lock (2 h old)")
    for _ in range(3):
        clock.advance(30)
        record(state, "storage", "storage.mounts", "ok", event=lock)
        agent.reconcile_once()
    other = Event("StaleLockRemoved", "removed /root/.cache/torch_extensions/y/lock (3 h old)")
    record(state, "storage", "storage.mounts", "ok", event=other)
    agent.reconcile_once()
    messages = [e["message"] for e in double.events("default") if e["reason"] == "StaleLockRemoved"]
    assert messages == [
        "storage.mounts : removed /root/.cache/torch_extensions/x/lock (2 h old)",
        "storage.mounts : removed /root/.cache/torch_extensions/y/lock (3 h old)",
    ]


@pytest.mark.system
def test_write_economy_per_transition_and_per_hour(double: ApiDouble) -> None:
    clock = Clock()
    double.add_node("n1")
    state = health_state("n1", clock)
    agent = make_agent(double, state, clock)
    all_ok(state)
    agent.reconcile_once()

    def steady_hour(failing: bool) -> int:
        start = len(double.writes)
        for _ in range(120):  # one hour: every probe reports every 30 s, the agent polls in between
            clock.advance(30)
            all_ok(state)
            if failing:
                record(state, "storage", "storage.mounts", "fail", "MountMissing")
            agent.reconcile_once()
        return len(double.writes) - start

    assert steady_hour(failing=False) <= 6, "steady state: only the condition heartbeat, every 10 minutes"

    for transition, failing in enumerate((True, False, True, False)):
        start = len(double.writes)
        node_start = node_writes(double, "n1")
        clock.advance(30)
        all_ok(state)
        if failing:
            record(state, "storage", "storage.mounts", "fail", "MountMissing")
        agent.reconcile_once()
        agent.reconcile_once()
        assert node_writes(double, "n1") - node_start <= 2, "at most 2 Node writes per transition"
        events = [w.path for w in double.writes[start:] if "/events" in w.path]
        budget = [w.path for w in double.writes[start:] if "/configmaps" in w.path]
        assert len(events) <= 1, events
        # The first slot ever taken also counts the nodes for the fleet: a lease write before the slot's.
        assert len(budget) <= (2 if transition == 0 else 1), budget

    record(state, "storage", "storage.mounts", "fail", "MountMissing")
    agent.reconcile_once()
    assert steady_hour(failing=True) <= 6

    # The heartbeat refreshes lastHeartbeatTime, never lastTransitionTime.
    condition = conditions(double.node("n1"))["StorageHealthy"]
    assert condition["lastTransitionTime"] < condition["lastHeartbeatTime"]


@pytest.mark.system
def test_the_heartbeat_repairs_drift(double: ApiDouble) -> None:
    clock = Clock()
    double.add_node("n1", taints=[FOREIGN_TAINT])
    state = health_state("n1", clock)
    agent = make_agent(double, state, clock)
    all_ok(state)
    record(state, "storage", "storage.mounts", "fail", "MountMissing")
    agent.reconcile_once()
    assert our_taints(double.node("n1")) == {"storage": ("MountMissing", "NoSchedule")}

    def strip(node: dict[str, Any]) -> None:  # someone deletes the agent's taint and condition by hand
        node["spec"]["taints"] = [FOREIGN_TAINT]
        node["status"]["conditions"] = [c for c in node["status"]["conditions"] if c["type"] != "StorageHealthy"]

    double.mutate("nodes", "", "n1", strip)
    for _ in range(19):  # nothing changed in the agent's view: nothing is read before the heartbeat
        clock.advance(30)
        all_ok(state)
        record(state, "storage", "storage.mounts", "fail", "MountMissing")
        agent.reconcile_once()
    assert our_taints(double.node("n1")) == {}
    clock.advance(30)  # 600 s: the heartbeat reads the Node again and puts back what is missing
    agent.reconcile_once()
    node = double.node("n1")
    assert our_taints(node) == {"storage": ("MountMissing", "NoSchedule")}
    assert conditions(node)["StorageHealthy"]["status"] == "False"
    assert foreign_taints(node) == [FOREIGN_TAINT]


@pytest.mark.system
def test_api_faults_back_off_and_converge(double: ApiDouble) -> None:
    double.add_node("n1", taints=[FOREIGN_TAINT])
    state = HealthState("n1", HealthSettings(fail_threshold=1, recovery_threshold=1))
    configure(state, DEFAULT_PROBES)
    agent = KubeAgent(
        kube_config(
            backoff_initial_seconds=0.05, backoff_max_seconds=0.2, poll_seconds=0.02, request_timeout_seconds=0.5
        ),
        "n1",
        state.current,
        double.client(),
    )
    all_ok(state)
    agent.start()
    try:
        wait_for(lambda: double.node("n1")["metadata"]["labels"].get("node-health/ready") == "true")

        double.outage()
        record(state, "storage", "storage.mounts", "fail", "MountMissing")
        wait_for(lambda: agent.status()["errors"].get("unreachable", 0) >= 2)
        double.restore()
        wait_for(lambda: our_taints(double.node("n1")) == {"storage": ("MountMissing", "NoSchedule")})

        # The client itself retries a 429 with Retry-After 3 times (urllib3): the agent sees the 4th.
        double.inject(r"/nodes/n1$", method="GET", status=429, retry_after=0, times=4)
        double.inject(r"/nodes/n1$", method="PATCH", status=500, times=1)
        double.inject(r"/nodes/n1/status$", status=403, times=1)
        # Slower than the request timeout, on every try the client makes.
        double.inject(r"/nodes/n1$", method="GET", delay=0.6, times=4)
        record(state, "storage", "storage.mounts", "ok")
        record(state, "npu", "npu.health", "fail", "NpuHealthCritical")
        wait_for(lambda: our_taints(double.node("n1")) == {"npu": ("NpuHealthCritical", "NoSchedule")})
        wait_for(lambda: conditions(double.node("n1")).get("NPUHealthy", {}).get("status") == "False")
        errors = agent.status()["errors"]
        for kind in ("unreachable", "throttled", "server", "forbidden", "timeout"):
            assert errors.get(kind, 0) >= 1, (kind, errors)
        totals = {s.labels["kind"]: s.value for s in agent.samples() if s.name == "nodehealth_kube_errors_total"}
        assert totals["throttled"] == errors["throttled"]
        assert foreign_taints(double.node("n1")) == [FOREIGN_TAINT]
    finally:
        agent.stop()


@pytest.mark.system
def test_load_api_client_from_kubeconfig(double: ApiDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    double.add_node("n1")
    kubeconfig = double.write_kubeconfig(tmp_path / "kubeconfig", user="me")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    double.token = "t"  # the kubeconfig's user token must reach the API on every call
    for config in (parse_config({"kubernetes": {"kubeconfig": str(kubeconfig)}}), None):
        if config is None:
            monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
            config = parse_config({})
        clock = Clock()
        state = health_state("n1", clock)
        agent = KubeAgent(kube_config(kubeconfig=config.kubernetes.kubeconfig), "n1", state.current)
        agent.reconcile_once()
        agent.stop()
        assert agent.status()["errors"] == {}
        assert load_api_client(config).configuration.host == double.host
    assert "node-health/ready" in labels(double.node("n1"))
    assert 401 not in {request.status for request in double.log}

    double.token = "another"  # a token the API no longer accepts: counted as forbidden, the Node left alone
    writes = len(double.writes)
    agent = KubeAgent(kube_config(kubeconfig=str(kubeconfig)), "n1", state.current)
    agent.reconcile_once()
    agent.stop()
    assert set(agent.status()["errors"]) == {"forbidden"}
    assert double.log[-1].status == 401 and len(double.writes) == writes


@pytest.mark.system
def test_api_calls_never_load_the_generated_api_classes(double: ApiDouble) -> None:
    """KubeApi goes through ApiClient: CoreV1Api (~250 pydantic models, 22 MiB of RSS) is never imported."""
    double.add_node("n1")
    script = f"""
import sys
import kubernetes.client
from agent.kube.client import KubeApi
api = KubeApi(lambda: kubernetes.client.ApiClient(kubernetes.client.Configuration(host={double.host!r})), 5.0)
assert api.get_node("n1")["metadata"]["name"] == "n1"
assert [node["metadata"]["name"] for node in api.list_nodes(from_cache=True)] == ["n1"]
api.patch_node("n1", {{"metadata": {{"labels": {{"a": "b"}}}}}})
assert api.get_configmap("node-health", "missing") is None
loaded = sorted(name for name in sys.modules if name.startswith("kubernetes.client.api."))
models = sum(name.startswith("kubernetes.client.models.") for name in sys.modules)
print(loaded, models)
assert not loaded and models < 10, (loaded, models)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert double.node("n1")["metadata"]["labels"] == {"a": "b"}


def wait_for(condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except Exception:  # noqa: BLE001 - the condition may race the agent; retry until the deadline
            pass
        time.sleep(0.02)
    raise AssertionError("condition not met in time")
