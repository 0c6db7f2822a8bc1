"""MindCluster ClusterD public faults, written by the real reconciler on the API double, checked against the
payload ClusterD takes (its public fault interface: the ConfigMap's label and key, and every field's range)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from support.kube_devices import CHIPS, record_gpus, record_npus
from support.kube_double import ApiDouble
from support.kube_helpers import Clock, conditions, health_state, make_agent, our_taints, record

# npu.smi as a probe of its own here, so each test reports it apart from the chips.
PROBES = {"gpu": ("gpu.holders",), "npu": ("npu.holders",), "npu-smi": ("npu.smi",), "storage": ("storage.mounts",)}
NAMESPACE = "mindx-dl"
NAME = "node-health-publicfault-n1"
ID = re.compile(r"^[A-Za-z0-9_.-]{8,128}$")
JAN_2025_MS = 1735689600000
PF = {"enabled": True, "sender": "node-health", "namespace": NAMESPACE}


def check_payload(text: str, sender: str, node: str) -> dict[str, Any]:
    """ClusterD's rules for a PublicFault message; a message that breaks one is discarded by ClusterD."""
    message = json.loads(text)
    assert set(message) == {"id", "timestamp", "version", "resource", "faults"}
    assert ID.match(message["id"]), message["id"]
    assert isinstance(message["timestamp"], int) and len(str(message["timestamp"])) == 13
    assert message["timestamp"] > JAN_2025_MS
    assert message["version"] == "1.0"
    assert message["resource"] == sender
    assert 0 < len(message["faults"]) <= 100
    for fault in message["faults"]:
        assert set(fault) <= {"faultId", "faultType", "faultCode", "faultTime", "assertion", "influence", "description"}
        assert ID.match(fault["faultId"]), fault["faultId"]
        assert fault["faultType"] == "NPU"
        assert re.fullmatch(r"[0-9]{9}", fault["faultCode"])
        assert isinstance(fault["faultTime"], int) and len(str(fault["faultTime"])) == 13
        assert fault["faultTime"] > JAN_2025_MS
        assert fault["assertion"] in ("occur", "recover")
        assert 0 < len(fault["influence"]) <= 1000
        for influence in fault["influence"]:
            assert influence["nodeName"] == node
            ids = influence["deviceIds"]
            assert 0 < len(ids) <= 32 and len(set(ids)) == len(ids)
            assert all(isinstance(i, int) and 0 <= i < 32 for i in ids)
        assert len(fault.get("description", "")) <= 512
    return dict(message)


def configmap(double: ApiDouble) -> dict[str, Any]:
    found = double.configmap(NAMESPACE, NAME)
    assert found is not None, "no public-fault ConfigMap"
    return found


def setup(double: ApiDouble, release: str = "none", **kube: Any) -> tuple[Any, Any, Clock]:
    clock = Clock()
    if release != "none":
        double.serve_dra(release)
    double.add_node("n1", labels={"accelerator": "huawei-Ascend910"})
    # What the Ascend device plugin advertises: the device budget counts the fleet's chips from it.
    double.mutate("nodes", "", "n1", lambda n: n["status"].update({"capacity": {"huawei.com/Ascend910": "8"}}))
    state = health_state("n1", clock, PROBES)
    settings = {"max_unhealthy": "100%", "max_unhealthy_devices": "100%", "mindcluster": {"public_fault": PF}}
    agent = make_agent(double, state, clock, **{**settings, **kube})
    others_ok(state)
    return state, agent, clock


def others_ok(state: Any) -> None:
    """A fresh result of every other check (results older than three intervals are stale, and hold)."""
    record(state, "storage", "storage.mounts", "ok")
    record(state, "npu-smi", "npu.smi", "ok")
    record_gpus(state)


@pytest.mark.system
def test_a_bad_chip_is_a_public_fault_and_does_not_taint_the_node(double: ApiDouble) -> None:
    state, agent, clock = setup(double)
    record_npus(state, {2: "NpuHeldOutOfBand"})
    agent.reconcile_once()

    stored = configmap(double)
    assert stored["metadata"]["labels"] == {
        "mc-consumer-publicfault": "true",
        "app.kubernetes.io/name": "node-health",
        "app.kubernetes.io/component": "public-fault",
        "node-health/node": "n1",
    }
    assert set(stored["data"]) == {"PublicFault"}
    message = check_payload(stored["data"]["PublicFault"], "node-health", "n1")
    (fault,) = message["faults"]
    assert fault["assertion"] == "occur"
    assert fault["faultCode"] == "160010001"  # NpuHeldOutOfBand's default code
    assert fault["influence"] == [{"nodeName": "n1", "deviceIds": [CHIPS[2].physical_id]}]
    assert fault["faultTime"] == int(clock.now * 1000)
    assert "NpuHeldOutOfBand on npu2" in fault["description"]

    node = double.node("n1")
    assert our_taints(node) == {}, "with public faults on, a per-chip problem does not taint the node"
    message_text = conditions(node)["NPUHealthy"]["message"]
    assert conditions(node)["NPUHealthy"]["status"] == "False"
    assert "npu2 isolated by MindCluster public fault 160010001" in message_text


@pytest.mark.system
def test_recovery_writes_recover_with_the_same_fault_and_keeps_the_configmap(double: ApiDouble) -> None:
    state, agent, clock = setup(double)
    record_npus(state, {2: "NpuHeldOutOfBand"})
    agent.reconcile_once()
    (occurred,) = check_payload(configmap(double)["data"]["PublicFault"], "node-health", "n1")["faults"]

    clock.advance(60)
    others_ok(state)
    record_npus(state, {2: "NpuHeldOutOfBand"})
    agent.reconcile_once()
    writes = [w for w in double.writes if "/configmaps/" + NAME in w.path or w.path.endswith("/configmaps")]
    pf_writes = [w for w in writes if w.body and w.body.get("metadata", {}).get("name") == NAME]
    assert len(pf_writes) == 1, "an unchanged fault is not written again"

    clock.advance(60)
    others_ok(state)
    record_npus(state)
    agent.reconcile_once()
    message = check_payload(configmap(double)["data"]["PublicFault"], "node-health", "n1")
    (recovered,) = message["faults"]
    assert recovered == {**occurred, "assertion": "recover"}, "recover names the fault instance that occurred"

    clock.advance(60)
    others_ok(state)
    record_npus(state, {2: "NpuHeldOutOfBand"})
    agent.reconcile_once()
    faults = check_payload(configmap(double)["data"]["PublicFault"], "node-health", "n1")["faults"]
    assert [f["assertion"] for f in faults] == ["occur"], "the same chip and code again: a new fault instance"
    assert faults[0]["faultId"] != occurred["faultId"]


@pytest.mark.system
def test_a_restarted_agent_keeps_the_fault_instance(double: ApiDouble) -> None:
    state, agent, clock = setup(double)
    record_npus(state, {2: "NpuHeldOutOfBand"})
    agent.reconcile_once()
    version = configmap(double)["metadata"]["resourceVersion"]
    restarted = make_agent(double, state, clock, max_unhealthy="100%", mindcluster={"public_fault": PF})
    restarted.reconcile_once()
    assert configmap(double)["metadata"]["resourceVersion"] == version, "nothing rewritten after a restart"


@pytest.mark.system
def test_npu_smi_failing_still_taints_the_node(double: ApiDouble) -> None:
    state, agent, _clock = setup(double)
    record_npus(state, {2: "NpuHeldOutOfBand"})
    record(state, "npu-smi", "npu.smi", "fail", "NpuSmiFailed")
    agent.reconcile_once()
    assert our_taints(double.node("n1")) == {"npu": ("NpuSmiFailed", "NoSchedule")}, "a node-wide NPU problem"


@pytest.mark.system
def test_public_faults_take_the_chips_even_on_a_dra_cluster(double: ApiDouble) -> None:
    state, agent, _clock = setup(double, "1.37")
    record_npus(state, {2: "NpuHbmLeaked"}, check="npu.holders")
    agent.reconcile_once()
    assert double.device_taint_rules() == []
    (fault,) = check_payload(configmap(double)["data"]["PublicFault"], "node-health", "n1")["faults"]
    assert fault["faultCode"] == "160010003"


@pytest.mark.system
def test_turned_off_on_a_running_agent_the_faults_recover_and_the_node_takes_over(double: ApiDouble) -> None:
    state, agent, _clock = setup(double)
    record_npus(state, {2: "NpuHeldOutOfBand"})
    agent.reconcile_once()
    from support.kube_helpers import kube_config

    agent.reconfigure(kube_config(max_unhealthy="100%", mindcluster={"public_fault": {**PF, "enabled": False}}))
    agent.reconcile_once()
    assert our_taints(double.node("n1")) == {"npu": ("NpuHeldOutOfBand", "NoSchedule")}
    (fault,) = check_payload(configmap(double)["data"]["PublicFault"], "node-health", "n1")["faults"]
    assert fault["assertion"] == "recover"


@pytest.mark.system
def test_an_unreadable_public_fault_configmap_leaves_the_chip_on_the_node_taint(double: ApiDouble) -> None:
    """Fail closed, and no detour through a DeviceTaintRule the next pass would take back."""
    state, agent, clock = setup(double, "1.37")
    double.inject(path=f"/configmaps/{NAME}$", method="GET", status=500)
    record_npus(state, {2: "NpuHeldOutOfBand"})
    agent.reconcile_once()
    assert our_taints(double.node("n1")) == {"npu": ("NpuHeldOutOfBand", "NoSchedule")}
    assert double.device_taint_rules() == []
    assert agent.status()["devices"]["errors"] == {"server": 1}
    clock.advance(5)  # past the backoff: read, and written
    others_ok(state)
    record_npus(state, {2: "NpuHeldOutOfBand"})
    agent.reconcile_once()
    assert our_taints(double.node("n1")) == {}
    assert [f["assertion"] for f in json.loads(configmap(double)["data"]["PublicFault"])["faults"]] == ["occur"]
