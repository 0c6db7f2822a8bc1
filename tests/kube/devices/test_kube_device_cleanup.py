"""`node-health cleanup` for devices: the agents' DeviceTaintRules go, foreign rules stay, public faults are
recovered (their ConfigMaps kept), device budget slots are released; what real agents wrote on the API double."""

from __future__ import annotations

import json
from typing import Any

import pytest
from support.kube_devices import NVIDIA, publish_gpus, record_gpus, record_npus
from support.kube_double import ApiDouble
from support.kube_helpers import BUDGET_NS, Clock, health_state, make_agent, record

from agent.config import parse_config
from agent.kube.client import KubeApi
from agent.kube.ops.cleanup import cleanup

PROBES = {"gpu": ("gpu.holders",), "npu": ("npu.holders",), "storage": ("storage.mounts",)}
PF = {"mindcluster": {"public_fault": {"enabled": True, "namespace": "mindx-dl"}}}
FOREIGN = {
    "metadata": {"name": "maintenance-gpu-node-a-gpu-0", "labels": {"team": "infra"}},
    "spec": {
        "deviceSelector": {"driver": NVIDIA, "pool": "a", "device": "gpu-0"},
        "taint": {"key": "example.com/maintenance", "effect": "NoSchedule"},
    },
}


def agents_isolate(double: ApiDouble, monkeypatch: Any) -> None:
    """Nodes a and b: a GPU each on a rule, a chip each with a public fault (written by their agents)."""
    monkeypatch.setenv("POD_NAMESPACE", BUDGET_NS)
    clock = Clock()
    double.serve_dra("1.37")
    for name in ("a", "b"):
        double.add_node(name)
        publish_gpus(double, name)
        state = health_state(name, clock, PROBES)
        agent = make_agent(double, state, clock, max_unhealthy_devices="100%", **PF)
        record(state, "storage", "storage.mounts", "ok")
        record_gpus(state, {3: "GpuHeldOutOfBand"})
        record_npus(state, {1: "NpuHeldOutOfBand"})
        agent.reconcile_once()
    double.create("devicetaintrules", "", FOREIGN, api_version="resource.k8s.io/v1")


def faults(double: ApiDouble, node: str) -> list[str]:
    configmap = double.configmap("mindx-dl", f"node-health-publicfault-{node}") or {}
    return [f["assertion"] for f in json.loads(configmap["data"]["PublicFault"])["faults"]]


def slots(double: ApiDouble) -> dict[str, list[str]]:
    configmap = double.configmap(BUDGET_NS, "node-health-device-budget") or {}
    return {n: json.loads(v)["devices"] for n, v in (configmap.get("data") or {}).items()}


@pytest.mark.system
def test_cleanup_removes_ours_recovers_faults_and_leaves_a_foreign_rule(double: ApiDouble, monkeypatch: Any) -> None:
    agents_isolate(double, monkeypatch)
    assert len(double.device_taint_rules()) == 3 and faults(double, "a") == ["occur"]
    assert slots(double) == {"a": ["gpu3", "npu1"], "b": ["gpu3", "npu1"]}
    out: list[str] = []
    config = parse_config({"kubernetes": PF})
    assert cleanup(KubeApi(double.client, 5), config, None, True, out.append) == 0
    assert len(double.device_taint_rules()) == 3, "a dry run changes nothing"
    assert any(line.startswith("devicetaintrules: would remove 2 (") for line in out), out
    assert "public faults mindx-dl/node-health-publicfault-a: would recover 1 fault(s)" in out
    assert "device budget node-health/node-health-device-budget: would release 4 device slot(s) (a, b)" in out
    out.clear()
    assert cleanup(KubeApi(double.client, 5), config, "a", True, out.append) == 0
    assert "device budget node-health/node-health-device-budget: would release 2 device slot(s) (a)" in out, out
    assert slots(double) == {"a": ["gpu3", "npu1"], "b": ["gpu3", "npu1"]}

    out.clear()
    assert cleanup(KubeApi(double.client, 5), config, None, False, out.append) == 0, out
    assert [r["metadata"]["name"] for r in double.device_taint_rules()] == [FOREIGN["metadata"]["name"]]
    assert faults(double, "a") == ["recover"] and faults(double, "b") == ["recover"], "recovered, and kept"
    assert slots(double) == {}
    assert "device budget node-health/node-health-device-budget: released 4 device slot(s) (a, b)" in out
    out.clear()
    assert cleanup(KubeApi(double.client, 5), config, None, False, out.append) == 0
    assert not [line for line in out if "devicetaintrules" in line or "public faults" in line], "nothing left"


@pytest.mark.system
def test_cleanup_of_one_node_leaves_the_others_devices(double: ApiDouble, monkeypatch: Any) -> None:
    agents_isolate(double, monkeypatch)
    out: list[str] = []
    assert cleanup(KubeApi(double.client, 5), parse_config({"kubernetes": PF}), "a", False, out.append) == 0, out
    left = {r["metadata"]["name"] for r in double.device_taint_rules()}
    assert left == {FOREIGN["metadata"]["name"], "node-health.gpu.b.gpu.nvidia.com.gpu-5"}  # GPU 3 is /dev/nvidia5
    assert faults(double, "a") == ["recover"] and faults(double, "b") == ["occur"]
    assert slots(double) == {"b": ["gpu3", "npu1"]}


@pytest.mark.system
def test_an_api_error_on_the_rules_is_reported_and_keeps_the_slots(double: ApiDouble, monkeypatch: Any) -> None:
    agents_isolate(double, monkeypatch)
    double.inject(path="devicetaintrules/node-health", method="DELETE", status=500, times=-1)
    out: list[str] = []
    assert cleanup(KubeApi(double.client, 5), parse_config({"kubernetes": PF}), None, False, out.append) == 1
    assert any("not removed: HTTP 500" in line for line in out), out
    assert slots(double) != {}, "a slot goes only once what it stands for is gone"


@pytest.mark.system
def test_faults_written_while_on_are_recovered_with_public_faults_off_now(double: ApiDouble, monkeypatch: Any) -> None:
    """Public faults turned off in the config since: the faults the agents wrote are still theirs to recover."""
    agents_isolate(double, monkeypatch)
    off = parse_config({"kubernetes": {"mindcluster": {"public_fault": {"enabled": False, "namespace": "mindx-dl"}}}})
    out: list[str] = []
    assert cleanup(KubeApi(double.client, 5), off, None, True, out.append) == 0
    assert "public faults mindx-dl/node-health-publicfault-a: would recover 1 fault(s)" in out, out
    assert cleanup(KubeApi(double.client, 5), off, None, False, out.append) == 0, out
    assert faults(double, "a") == ["recover"] and faults(double, "b") == ["recover"]
    assert slots(double) == {}


@pytest.mark.system
@pytest.mark.parametrize("status", [403, 404])
def test_public_faults_off_and_not_listable_are_not_checked_not_an_error(double: ApiDouble, status: int) -> None:
    """Off, and the list refused (the public-fault component, with the cleanup's Role, was never installed, so no
    agent could write a fault): said, and the rest of the cleanup goes on."""
    double.serve_dra("1.37")
    double.add_node("a")
    double.inject(path="/namespaces/mindx-dl/configmaps$", method="GET", status=status, times=-1)
    out: list[str] = []
    assert cleanup(KubeApi(double.client, 5), parse_config({}), None, False, out.append) == 0, out
    assert [line for line in out if line.startswith("public faults")] == [
        f"public faults mindx-dl: not checked: public faults are off and their ConfigMaps cannot be listed (HTTP "
        f"{status} {'Forbidden' if status == 403 else 'Not Found'} injected fault)"
    ]
    out.clear()
    assert cleanup(KubeApi(double.client, 5), parse_config({"kubernetes": PF}), None, False, out.append) == 1
    assert any(line.startswith(f"public faults mindx-dl: not read: HTTP {status}") for line in out), "on: an error"
