"""The operator's side on a real kube-apiserver 1.37 with kube-controller-manager: an NPU agent's public-fault
ConfigMap for MindCluster, `fleet` showing the node, `cleanup` taking off what the agent put there (the fault
recovered), and `uninstall` deleting the install, its namespace really finalized by the namespace controller.
The uninstall runs last (this module's last test): the session's plane is installed again by whoever needs it."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest
from support.kube_devices import record_gpus, record_npus
from support.kube_helpers import Clock, health_state, kube_config, our_taints, record
from support.realkube import Plane, plane, wait_for
from support.realkube_objects import install, path_of

from agent.config import parse_config
from agent.kube import KubeAgent
from agent.kube.ops.cleanup import cleanup
from agent.kube.ops.fleet import fleet_view
from agent.kube.ops.uninstall import uninstall

pytestmark = [pytest.mark.system, pytest.mark.realkube]
PROBES = {"gpu": ("gpu.holders",), "npu": ("npu.holders",), "npu-smi": ("npu.smi",), "storage": ("storage.mounts",)}
PF = {"enabled": True, "sender": "node-health", "namespace": "mindx-dl"}
FAULTS = "/api/v1/namespaces/mindx-dl/configmaps/node-health-publicfault-pf-1"


def _npu_node(real: Plane, name: str) -> None:
    if real.request("GET", f"/api/v1/nodes/{name}")[0] == 404:
        real.register_node(name, {"accelerator": "huawei-Ascend910"})
    # What the Ascend device plugin advertises: the device budget counts the fleet's chips from it.
    capacity = {"status": {"capacity": {"huawei.com/Ascend910": "8"}}}
    status, answer = real.request(
        "PATCH", f"/api/v1/nodes/{name}/status", capacity, content_type="application/merge-patch+json"
    )
    assert status == 200, answer


def _faults(real: Plane) -> list[str]:
    status, stored = real.request("GET", FAULTS)
    assert status == 200, stored
    return [fault["assertion"] for fault in json.loads(stored["data"]["PublicFault"])["faults"]]


def test_public_faults_fleet_and_cleanup() -> None:
    real = plane("1.37")
    install(real)
    real.ensure_namespace("mindx-dl")
    _npu_node(real, "pf-1")
    clock = Clock(time.time())
    state = health_state("pf-1", clock, PROBES)
    settings: dict[str, Any] = {
        "max_unhealthy": "100%",
        "max_unhealthy_devices": "100%",
        "budget_namespace": "node-health",
    }
    config = kube_config(**settings, mindcluster={"public_fault": PF}, kubeconfig=str(real.kubeconfig))
    agent = KubeAgent(
        config, "pf-1", lambda: state.snapshot, real.api_client(), clock=clock, monotonic=clock, rng=random.Random(0)
    )
    record(state, "storage", "storage.mounts", "ok")
    record(state, "npu-smi", "npu.smi", "ok")
    record_gpus(state)
    record_npus(state, {2: "NpuHeldOutOfBand"})
    agent.reconcile_once()
    assert not agent.status()["devices"]["errors"], agent.status()["devices"]
    assert _faults(real) == ["occur"]
    node = real.request("GET", "/api/v1/nodes/pf-1")[1]
    assert our_taints(node) == {}, "a chip's public fault does not taint the node"
    npu = next(c for c in node["status"]["conditions"] if c["type"] == "NPUHealthy")
    assert npu["status"] == "False" and "npu2 isolated by MindCluster public fault 160010001" in npu["message"]

    view = fleet_view(real.api(), config, "", time.time())
    mine = next(n for n in view.nodes if n.name == "pf-1")
    assert [(i["device"], i["mechanism"]) for i in mine.isolated] == [("npu2", "public_fault")], mine

    out: list[str] = []
    assert cleanup(real.api(), config, "pf-1", False, out.append) == 0, out
    node = real.request("GET", "/api/v1/nodes/pf-1")[1]
    owned = [k for k in {**node["metadata"].get("labels", {}), **node["metadata"].get("annotations", {})}]
    assert not [k for k in owned if k.startswith("node-health/")], node["metadata"]
    assert not [c for c in node["status"]["conditions"] if c["type"] == "NPUHealthy"]
    assert [c["type"] for c in node["status"]["conditions"]] == ["MemoryPressure", "DiskPressure", "Ready"]
    assert _faults(real) == ["recover"], "recovered, and kept for ClusterD"


def _kubelet(real: Plane, namespace: str) -> bool:
    """Plays the kubelets (none run here): a terminating pod bound to a node is deleted for good."""
    pods = real.request("GET", f"/api/v1/namespaces/{namespace}/pods")[1].get("items") or []
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            real.request(
                "DELETE", f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}?gracePeriodSeconds=0"
            )
    return real.request("GET", f"/api/v1/namespaces/{namespace}")[0] == 404


def test_uninstall_deletes_the_install_and_the_namespace_really_goes() -> None:
    real = plane("1.37")
    docs = install(real)
    real.node_token("pf-1")  # a pod in the namespace, bound to a node: the namespace waits for its kubelet
    config = parse_config({"kubernetes": {"kubeconfig": str(real.kubeconfig), "budget_namespace": "node-health"}})
    lines: list[str] = []
    assert uninstall(real.api(), config, "node-health", 30, False, lines.append) == 0, lines
    assert lines[0] == "daemonset node-health/node-health: deleted", lines
    assert lines[-1].startswith("namespace node-health: deleted"), lines
    wait_for("the namespace finalized", lambda: _kubelet(real, "node-health"), timeout=120, every=1)
    left = [path_of(doc) for doc in docs if real.request("GET", path_of(doc))[0] != 404]
    assert left == [], f"left behind: {left}"
