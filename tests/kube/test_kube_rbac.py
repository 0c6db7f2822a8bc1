"""deploy/rbac.yaml grants exactly the API calls the kube package makes: every call of a full scenario (a slot
taken, refused, verified and given back; conditions; events; conflicts; heartbeats), recorded by the API double,
against the ClusterRole and Role rules. The cleanup Job's rules against the calls `node-health cleanup` makes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from support.kube_devices import NVIDIA, publish_gpus, record_gpus, record_npus
from support.kube_double import ApiDouble
from support.kube_helpers import BUDGET_NS, Clock, health_state, make_agent, our_taints, record
from support.rbac import assert_least_privilege, calls
from support.system import REPO

from agent.config import parse_config
from agent.kube.client import KubeApi
from agent.kube.devices.match import RULE_LABELS, rule_name
from agent.kube.ops.cleanup import cleanup

PROBES = {"network": ("network.dns",), "gpu": ("gpu.holders",)}
PUBLIC_FAULTS = REPO / "deploy" / "components" / "mindcluster-public-faults" / "rbac.yaml"


def devices_scenario(
    double: ApiDouble, clock: Clock, states: dict[str, Any], agents: dict[str, Any], faults: bool
) -> None:
    """Bad GPUs on a DRA cluster: a rule created; one whose name is taken by a rule of ours (a 409: read, adopted,
    patched); one more refused by the device budget, which verifies its holders by listing the agents' rules (and
    public-fault ConfigMaps); a reason change patches; recovery deletes the rules and gives the slots back. With
    public faults, a chip of b is a public fault throughout (the ConfigMap created), recovered at the end."""

    def step(bad: dict[str, dict[int, str]], chip_bad: bool = True) -> None:
        clock.advance(30)
        for name, state in states.items():
            record(state, "network", "network.dns", "ok")
            record_gpus(state, bad.get(name, {}))
            record_npus(state, {1: "NpuHeldOutOfBand"} if faults and chip_bad and name == "b" else {})
        for agent in agents.values():
            agent.step()

    step({"a": {3: "GpuHeldOutOfBand"}})
    taken = rule_name("node-health", "gpu", "b", NVIDIA, "gpu-4")

    def squat(method: str, path: str) -> None:
        if (
            method == "POST"
            and path.endswith("/devicetaintrules")
            and not double.device_taint_rules("node-health/node=b")
        ):
            labels = {**RULE_LABELS, "node-health/node": "b", "node-health/category": "gpu"}
            selector = {"driver": NVIDIA, "pool": "b", "device": "gpu-4"}
            spec = {"deviceSelector": selector, "taint": {"key": "node-health/gpu", "effect": "None"}}
            double.create("devicetaintrules", "", {"metadata": {"name": taken, "labels": labels}, "spec": spec})

    double.before_write = squat
    step({"a": {3: "GpuHeldOutOfBand"}, "b": {4: "GpuHeldOutOfBand"}})
    double.before_write = None
    assert double.device_taint_rules("node-health/node=b")[0]["spec"]["taint"]["value"] == "GpuHeldOutOfBand"
    step({"a": {3: "GpuHeldOutOfBand", 5: "GpuHeldOutOfBand"}, "b": {4: "GpuHeldOutOfBand"}})
    assert len(double.device_taint_rules()) == 2, "the device budget holds: a's second GPU is withheld"
    for _ in range(6):  # a asks again (metadata only), later verifies the holders against the agents' objects
        step({"a": {3: "GpuSharedByPods", 5: "GpuHeldOutOfBand"}, "b": {4: "GpuHeldOutOfBand"}})
    assert {r["spec"]["taint"]["value"] for r in double.device_taint_rules()} == {"GpuSharedByPods", "GpuHeldOutOfBand"}
    step({}, chip_bad=False)
    step({}, chip_bad=False)
    assert double.device_taint_rules() == []


@pytest.mark.system
@pytest.mark.parametrize("faults", [False, True], ids=["rbac.yaml", "with-public-faults"])
def test_the_agents_role_is_exactly_what_it_calls(double: ApiDouble, faults: bool) -> None:
    clock = Clock()
    double.serve_dra("1.37")
    for name in ("a", "b", "c"):
        double.add_node(name)
        publish_gpus(double, name)
    states = {n: health_state(n, clock, {**PROBES, "npu": ("npu.holders",)}) for n in ("a", "b")}
    pf = {"mindcluster": {"public_fault": {"enabled": True, "namespace": "mindx-dl"}}} if faults else {}
    devices = "3" if faults else "2"
    agents = {
        n: make_agent(double, states[n], clock, seed=i, max_unhealthy="1", max_unhealthy_devices=devices, **pf)
        for i, n in enumerate(states)
    }

    def everyone(status: str, reason: str = "") -> None:
        for state in states.values():
            record(state, "network", "network.dns", status, reason)
            record_gpus(state)
            record_npus(state)
        for agent in agents.values():
            agent.step()

    everyone("ok")
    everyone("fail", "DnsFailed")  # a takes the slot (creating the ConfigMap, counting the nodes); b is refused
    assert our_taints(double.node("a")) and not our_taints(double.node("b"))
    double.foreign_write_before_ours("a")
    record(states["a"], "network", "network.dns", "ok")
    agents["a"].step()  # a recovers through a 409: reads again; gives its slot back
    double.before_write = None
    for _ in range(60):
        clock.advance(60)
        for agent in agents.values():
            agent.step()  # b asks again, verifies the holders, takes the slot; heartbeats
    assert our_taints(double.node("b"))
    devices_scenario(double, clock, states, agents, faults)
    # The node's pods for the device ledger checks (agent/kube/pods.py), through the same client.
    double.add_pod("team-a", "train-0", "a")
    assert agents["a"].pods.refresh() and agents["a"].pods.current() is not None
    used = calls(double.log)
    assert ("", "nodes", "list") in used and ("", "configmaps", "create") in used and ("", "pods", "list") in used
    assert ("resource.k8s.io", "devicetaintrules", "get") in used, "the 409 was read back"
    if faults:
        assert ("mindx-dl", "") in used[("", "configmaps", "list")], "the budget verified the public faults"
        assert_least_privilege(used, REPO / "deploy" / "rbac.yaml", PUBLIC_FAULTS)
    else:
        assert_least_privilege(used, REPO / "deploy" / "rbac.yaml")


@pytest.mark.system
@pytest.mark.parametrize("faults", [False, True], ids=["cleanup-job.yaml", "with-public-faults"])
def test_the_cleanup_jobs_role_is_exactly_what_cleanup_calls(double: ApiDouble, monkeypatch: Any, faults: bool) -> None:
    monkeypatch.setenv("POD_NAMESPACE", BUDGET_NS)
    double.add_node(
        "a", labels={"node-health/ready": "false"}, taints=[{"key": "node-health/npu", "effect": "NoSchedule"}]
    )
    double.add_node("b", conditions=[{"type": "NPUHealthy", "status": "False", "reason": "X"}])
    slot = json.dumps({"acquired_at": 0, "taints": "npu=X"})
    double.create("configmaps", BUDGET_NS, {"metadata": {"name": "node-health-budget"}, "data": {"a": slot}})
    double.serve_dra("1.37")
    labels = {**RULE_LABELS, "node-health/node": "a", "node-health/category": "gpu"}
    spec = {
        "deviceSelector": {"driver": NVIDIA, "pool": "a", "device": "gpu-0"},
        "taint": {"key": "node-health/gpu", "effect": "NoSchedule"},
    }
    double.create("devicetaintrules", "", {"metadata": {"name": "ours", "labels": labels}, "spec": spec})
    devices = json.dumps({"devices": ["gpu0"], "at": 0})
    double.create("configmaps", BUDGET_NS, {"metadata": {"name": "node-health-device-budget"}, "data": {"a": devices}})
    message = {
        "id": "m0000001",
        "faults": [
            {
                "faultId": "f0000001",
                "faultCode": "160010001",
                "faultTime": 1,
                "assertion": "occur",
                "influence": [{"nodeName": "a", "deviceIds": [1]}],
            }
        ],
    }
    pf_labels = {
        "mc-consumer-publicfault": "true",
        "app.kubernetes.io/name": "node-health",
        "app.kubernetes.io/component": "public-fault",
        "node-health/node": "a",
    }
    pf_body = {
        "metadata": {"name": "node-health-publicfault-a", "labels": pf_labels},
        "data": {"PublicFault": json.dumps(message)},
    }
    double.create("configmaps", "mindx-dl", pf_body)
    double.foreign_write_before_ours("a")
    if not faults:  # without the component, its Role for the cleanup is missing too: the list is refused
        double.inject(path="/namespaces/mindx-dl/configmaps$", method="GET", status=403, times=-1)
    out: list[str] = []
    api = KubeApi(double.client, 5)
    config = parse_config({"kubernetes": {"mindcluster": {"public_fault": {"enabled": faults}}}})
    assert cleanup(api, config, None, False, out.append) == 0, out
    assert double.device_taint_rules() == []
    used = calls([r for r in double.log if r.status != 403])  # refused: it needed no grant
    files = [REPO / "deploy" / "examples" / "cleanup-job.yaml"]
    if faults:
        recovered = json.loads((double.configmap("mindx-dl", "node-health-publicfault-a") or {})["data"]["PublicFault"])
        assert [f["assertion"] for f in recovered["faults"]] == ["recover"]
        files.append(PUBLIC_FAULTS.with_name("cleanup-rbac.yaml"))
    assert_least_privilege(used, *files)
