"""The operator's side on a real kube-apiserver 1.37 with kube-controller-manager: an NPU agent's public-fault
ConfigMap for MindCluster (written as the agent's ServiceAccount, with the component's Role), `fleet` showing the
node, `cleanup` taking off what the agent put there (the fault recovered), and `uninstall` deleting the install,
its namespace really finalized by the namespace controller. The uninstall runs last (this module's last test), as
its Job would: the session's plane is installed again by whoever needs it."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.kube_devices import record_gpus, record_npus
from support.kube_helpers import Clock, health_state, kube_config, our_taints, record
from support.realkube import Plane, plane, wait_for
from support.realkube_objects import apply, install, path_of
from support.system import REPO

from agent.config import parse_config
from agent.kube import KubeAgent
from agent.kube.client import load_api_client
from agent.kube.ops.cleanup import cleanup
from agent.kube.ops.fleet import fleet_view

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


def test_public_faults_fleet_and_cleanup(tmp_path: Path) -> None:
    real = plane("1.37")
    install(real)
    real.ensure_namespace("mindx-dl")
    # The component deploy/components/mindcluster-public-faults: the agent's Role in MindCluster's namespace.
    component = REPO / "deploy" / "components" / "mindcluster-public-faults" / "rbac.yaml"
    refused = [a for a in apply(real, [d for d in yaml.safe_load_all(component.read_text()) if d]) if a[1] >= 300]
    assert not refused, refused
    _npu_node(real, "pf-1")
    as_agent = json.loads(real.kubeconfig.read_text())
    as_agent["users"][0]["user"]["token"] = real.node_token("pf-1")  # the DaemonSet pod's token on pf-1
    (tmp_path / "agent.kubeconfig").write_text(json.dumps(as_agent))
    clock = Clock(time.time())
    state = health_state("pf-1", clock, PROBES)
    settings: dict[str, Any] = {
        "max_unhealthy": "100%",
        "max_unhealthy_devices": "100%",
        "budget_namespace": "node-health",
    }
    config = kube_config(**settings, mindcluster={"public_fault": PF}, kubeconfig=str(real.kubeconfig))
    client = load_api_client(parse_config({"kubernetes": {"kubeconfig": str(tmp_path / "agent.kubeconfig")}}))
    agent = KubeAgent(
        config, "pf-1", lambda: state.snapshot, client, clock=clock, monotonic=clock, rng=random.Random(0)
    )
    record(state, "storage", "storage.mounts", "ok")
    record(state, "npu-smi", "npu.smi", "ok")
    record_gpus(state)
    record_npus(state, {2: "NpuHeldOutOfBand"})
    agent.reconcile_once()
    status = agent.status()
    assert not status["errors"] and not status["devices"]["errors"], status  # every call allowed as the agent
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


def _run_uninstall(real: Plane, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`node-health uninstall` as the Job runs it: the shipped config from the install's ConfigMap, the
    uninstaller's own ServiceAccount token, its namespace in $POD_NAMESPACE."""
    shipped = yaml.safe_load(
        real.request("GET", "/api/v1/namespaces/node-health/configmaps/node-health-config")[1]["data"]["config.yaml"]
    )
    kubeconfig = json.loads(real.kubeconfig.read_text())
    kubeconfig["users"][0]["user"]["token"] = real.unbound_token(account="node-health-uninstall")
    (tmp_path / "uninstall.kubeconfig").write_text(json.dumps(kubeconfig))
    shipped.setdefault("kubernetes", {})["kubeconfig"] = str(tmp_path / "uninstall.kubeconfig")
    (tmp_path / "uninstall.yaml").write_text(yaml.safe_dump(shipped))
    env = {**os.environ, "POD_NAMESPACE": "node-health"}
    env.pop("NODE_NAME", None)
    argv = [sys.executable, "-m", "agent.cli", "uninstall", "--config", str(tmp_path / "uninstall.yaml")]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_uninstall_as_its_job_deletes_the_install_and_the_namespace_really_goes(tmp_path: Path) -> None:
    """Its own RBAC is enough for every call on a real server; the namespace controller finalizes the namespace
    (once the kubelet, played here, lets its pods go) and the garbage collector takes the uninstaller's
    cluster-scoped role and binding with it."""
    real = plane("1.37")
    docs = install(real) + install(real, REPO / "deploy" / "uninstall")
    real.node_token("pf-1")  # a pod in the namespace, bound to a node: the namespace waits for its kubelet
    done = _run_uninstall(real, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "daemonset node-health/node-health: deleted", lines
    assert "agents: stopped" in lines
    assert lines[-1].startswith("namespace node-health: deleted"), lines
    wait_for("the namespace finalized", lambda: _kubelet(real, "node-health"), timeout=120, every=1)

    def left() -> list[str]:
        return [path_of(doc) for doc in docs if real.request("GET", path_of(doc))[0] != 404]

    wait_for("the garbage collector", lambda: not left(), timeout=60, every=1)
