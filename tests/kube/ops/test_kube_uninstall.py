"""Uninstall in one step (`kubectl apply -k deploy/uninstall`, which runs `node-health uninstall`) on the API double:
the install as `kubectl apply -k` creates it, a real agent on a fake node tainting its Node and isolating a GPU,
a test playing the node's kubelet; then nothing of the install is left, and nothing foreign is touched. A rolling
restart of the agent cleans up nothing."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.cli import node_env
from support.fake_node import FakeNode
from support.kube_double import ApiDouble, ApiError
from support.kube_helpers import Clock, budget_configmap, conditions, our_taints
from support.kube_install import resource_of
from support.kustomize import overlay, rendered
from support.rbac import assert_granted, assert_least_privilege, calls
from support.system import REPO, require_fixtures, require_root

from agent.config import parse_config
from agent.kube.client import KubeApi
from agent.kube.devices import publicfault
from agent.kube.devices.match import RULE_LABELS
from agent.kube.ops.uninstall import INSTALLED, uninstall
from probes.base import CATEGORIES

DEPLOY = REPO / "deploy"
UNINSTALL = DEPLOY / "uninstall"
NS = "node-health"
NODE = "fake-node-1"
OURS = "app.kubernetes.io/name=node-health"
AGENT_LABELS = {"app.kubernetes.io/name": "node-health", "app.kubernetes.io/component": "agent"}
COMPONENTS = ("mindcluster-public-faults", "network-policy", "preflight-injection")
MONITORING = [DEPLOY / "prometheus" / "podmonitor.yaml", DEPLOY / "prometheus" / "prometheusrule.yaml"]
UNINSTALL_RBAC = [UNINSTALL / "rbac.yaml"]
PUBLIC_FAULTS_RBAC = DEPLOY / "components" / "mindcluster-public-faults" / "cleanup-rbac.yaml"


def install_documents(tmp_path: Path, monitoring: bool = True) -> list[dict[str, Any]]:
    """Everything an operator applies: deploy/ with its components, the cleanup Job example, deploy/prometheus (into
    the namespace monitoring, where the Prometheus Operator runs), then deploy/uninstall."""
    components = tuple(DEPLOY / "components" / c for c in COMPONENTS)
    docs = rendered(overlay(tmp_path / "install", [DEPLOY], components))
    docs += [d for d in yaml.safe_load_all((DEPLOY / "examples" / "cleanup-job.yaml").read_text()) if d]
    for path in MONITORING if monitoring else []:
        for doc in yaml.safe_load_all(path.read_text()):
            doc["metadata"]["namespace"] = "monitoring"
            docs.append(doc)
    return docs + rendered(UNINSTALL)


def key(doc: dict[str, Any]) -> tuple[str, str, str]:
    return resource_of(doc["kind"]), doc["metadata"].get("namespace", ""), doc["metadata"]["name"]


def install(api: ApiDouble, docs: list[dict[str, Any]]) -> None:
    """As `kubectl apply` creates them: namespaces first."""
    for doc in sorted(docs, key=lambda d: d["kind"] != "Namespace"):
        resource, namespace, _ = key(doc)
        api.create(resource, namespace, doc, api_version=doc["apiVersion"])


def exists(api: ApiDouble, where: tuple[str, str, str]) -> bool:
    try:
        api.get(*where)
    except ApiError:
        return False
    return True


def foreign_objects(api: ApiDouble) -> list[tuple[str, str, str]]:
    """Things that are not the install's, some looking like it: all of them must stay."""
    api.create("clusterroles", "", {"metadata": {"name": "monitoring-reader", "labels": {"team": "sre"}}, "rules": []})
    api.create("namespaces", "", {"metadata": {"name": "mindx-dl"}})
    api.create("configmaps", "mindx-dl", {"metadata": {"name": "clusterd-config"}, "data": {"a": "b"}})
    api.create("roles", "mindx-dl", {"metadata": {"name": "clusterd", "labels": {"app": "clusterd"}}, "rules": []})
    selector = {"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-5"}
    rule = {"deviceSelector": selector, "taint": {"key": "vendor.example.com/maintenance", "effect": "NoSchedule"}}
    api.create("devicetaintrules", "", {"metadata": {"name": "vendor-maintenance"}, "spec": rule})
    return [
        ("clusterroles", "", "monitoring-reader"),
        ("namespaces", "", "mindx-dl"),
        ("configmaps", "mindx-dl", "clusterd-config"),
        ("roles", "mindx-dl", "clusterd"),
        ("devicetaintrules", "", "vendor-maintenance"),
    ]


def agent_pod(api: ApiDouble, name: str, node: str) -> str:
    """An agent pod as the DaemonSet controller creates it: the template's labels, owned by the DaemonSet."""
    daemonset = api.get("daemonsets", NS, "node-health")
    owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "node-health", "uid": daemonset["metadata"]["uid"]}
    meta = {"name": name, "labels": dict(AGENT_LABELS), "ownerReferences": [{**owner, "controller": True}]}
    api.create("pods", NS, {"metadata": meta, "spec": {"nodeName": node}})
    return name


class Kubelet(threading.Thread):
    """The node's kubelet for one agent pod: once the API marks the pod for deletion, it stops the agent (SIGTERM to
    its process group, as the container runtime does) and deletes the pod for good."""

    def __init__(self, api: ApiDouble, pod: str, stop: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self.api, self.pod, self.stop_agent = api, pod, stop
        self.stopped_at: float | None = None

    def run(self) -> None:
        while True:
            try:
                pod = self.api.get("pods", NS, self.pod)
            except ApiError:
                return
            if pod["metadata"].get("deletionTimestamp"):
                self.stop_agent()
                self.stopped_at = time.monotonic()
                self.api.delete("pods", NS, self.pod, grace_seconds=0)
                return
            time.sleep(0.1)


def our_rules(api: ApiDouble) -> list[str]:
    return [r["metadata"]["name"] for r in api.device_taint_rules(OURS)]


def marked(api: ApiDouble) -> bool:
    """The agent has done its work: the storage taint (a stale FileBaton) and a DeviceTaintRule for the held GPU."""
    node = api.node(NODE)
    return "storage" in our_taints(node) and bool(our_rules(api)) and "node-health/ready" in node["metadata"]["labels"]


def ours_on(node: dict[str, Any]) -> list[str]:
    """Everything of the agent's on a Node: keys under node-health/ and its conditions."""
    meta = node["metadata"]
    keys = [*(meta.get("labels") or {}), *(meta.get("annotations") or {})]
    keys += [t["key"] for t in (node.get("spec") or {}).get("taints") or []]
    found = [k for k in keys if k.startswith("node-health/")]
    mine = {c.condition_type for c in CATEGORIES.values()}
    return found + [c["type"] for c in conditions(node).values() if c["type"] in mine]


def run_uninstall(node: FakeNode, api: ApiDouble, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`node-health uninstall` as the Job runs it: the shipped config from the install's ConfigMap, its own
    credentials (the token `uninstall`), its namespace in $POD_NAMESPACE."""
    shipped = yaml.safe_load(api.get("configmaps", NS, "node-health-config")["data"]["config.yaml"])
    shipped.setdefault("kubernetes", {})["kubeconfig"] = str(
        api.write_kubeconfig(tmp_path / "uninstall-kubeconfig", user="uninstall", token="uninstall")
    )
    config = tmp_path / "uninstall.yaml"
    config.write_text(yaml.safe_dump(shipped))
    env = {**node_env(), "POD_NAMESPACE": NS}
    env.pop("NODE_NAME", None)
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "uninstall", "--config", str(config), *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@contextlib.contextmanager
def installed_agent(tmp_path: Path, pod: str) -> Iterator[tuple[FakeNode, ApiDouble, Kubelet, list[dict[str, Any]]]]:
    """The install on the API double, its agent on a fake node (a GPU held outside any pod, isolated by a
    DeviceTaintRule; a stale FileBaton tainting the node for storage) in pod `pod`, played by a Kubelet; yielded
    once the agent has marked its node."""
    require_root()  # mknod of the fake device nodes
    settings = {"max_unhealthy": "100%"}
    with FakeNode(
        tmp_path, require_fixtures(), hold="nvidia3", dra="1.37", publish=("gpu",), kube_settings=settings
    ) as node:
        api = node.api
        assert api is not None
        api.prometheus_operator = True
        docs = install_documents(tmp_path)
        install(api, docs)
        kubelet = Kubelet(api, agent_pod(api, pod, NODE), node.stop_agent)
        kubelet.start()
        node.wait_for("the storage taint, the label and the GPU's DeviceTaintRule", lambda: marked(api))
        yield node, api, kubelet, docs


@pytest.mark.system
def test_uninstall_in_one_step_leaves_nothing_of_the_install(tmp_path: Path) -> None:
    with installed_agent(tmp_path, "node-health-x7k2p") as (node, api, kubelet, docs):
        foreign = foreign_objects(api)
        api.mutate(
            "nodes",
            "",
            NODE,
            lambda n: (
                n["spec"]
                .setdefault("taints", [])
                .append({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"})
            ),
        )
        api.mutate(
            "nodes",
            "",
            NODE,
            lambda n: n["status"]["conditions"].append(
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting"}
            ),
        )
        assert exists(api, ("configmaps", NS, "node-health-budget"))
        assert exists(api, ("configmaps", NS, "node-health-device-budget"))

        done = run_uninstall(node, api, tmp_path)

        assert done.returncode == 0, done.stdout + done.stderr
        assert kubelet.stopped_at is not None and node.agent is not None and node.agent.poll() is not None
        lines = done.stdout.splitlines()
        assert lines[0] == f"daemonset {NS}/node-health: deleted"
        assert "agents: stopped" in lines
        assert lines[-1].startswith(f"namespace {NS}: deleted, with everything in it (this uninstaller too); then ")
        assert ours_on(api.node(NODE)) == [], api.node(NODE)
        assert [t["key"] for t in api.node(NODE)["spec"]["taints"]] == ["nvidia.com/gpu"]
        assert [c["type"] for c in api.node(NODE)["status"]["conditions"]] == ["Ready"]
        assert our_rules(api) == []
        left = [key(doc) for doc in docs if exists(api, key(doc))]
        assert left == [], f"left behind: {left}"
        assert not exists(api, ("namespaces", "", NS))
        assert [where for where in foreign if not exists(api, where)] == [], "a foreign object was deleted"
        # Its role allows every call it made (that it allows nothing more: the test below, which makes them all).
        assert_granted(calls(api.log, token="uninstall"), *UNINSTALL_RBAC, PUBLIC_FAULTS_RBAC)


@pytest.mark.system
def test_a_rolling_restart_cleans_up_nothing(tmp_path: Path) -> None:
    """The DaemonSet's rollout replaces the agent's pod: its node keeps its taint, label, condition and rule
    throughout, and the new agent takes them over without writing them again."""
    with installed_agent(tmp_path, "node-health-old01") as (node, api, kubelet, _):
        before_node, before_rules = ours_on(api.node(NODE)), our_rules(api)
        lost: list[str] = []

        def watch(double: ApiDouble) -> None:
            current = ours_on(double.stored(("nodes", "", NODE)))
            lost.extend(k for k in before_node if k not in current)
            gone = {r["metadata"]["name"] for r in double.list("devicetaintrules", "", OURS)}
            lost.extend(r for r in before_rules if r not in gone)

        api.after_write = watch
        api.delete("pods", NS, "node-health-old01")  # the rollout
        node.wait_for("the old agent stopped", lambda: kubelet.stopped_at is not None)
        writes_before = len(api.writes)
        agent_pod(api, "node-health-new02", NODE)
        node.start_agent()
        node.wait_ready_to_serve()
        node.wait_all_probes_ran()
        time.sleep(3)  # several reconcile passes (poll_seconds 0.5)
        assert lost == [], f"removed during the restart: {lost}"
        assert ours_on(api.node(NODE)) == before_node and our_rules(api) == before_rules
        node_writes = [w for w in api.writes[writes_before:] if w.path.startswith(f"/api/v1/nodes/{NODE}")]
        assert all("taints" not in json.dumps(w.body) for w in node_writes), "the new agent rewrote the taints"
        assert exists(api, ("daemonsets", NS, "node-health")) and exists(api, ("namespaces", "", NS))


# --- the uninstaller alone: waiting for the agents, dry run, what it may delete ----------------------------------


def tainted_cluster(api: ApiDouble, tmp_path: Path, operator: bool) -> list[dict[str, Any]]:
    """The install with two agent pods: on a (Ready) and on b (not Ready: its kubelet is gone); both nodes tainted,
    a GPU of a isolated by a DeviceTaintRule, a chip of b a public fault, both budgets holding slots.
    operator: whether the Prometheus Operator serves its kinds (and deploy/prometheus was applied)."""
    api.prometheus_operator = operator
    api.serve_dra("1.37")
    docs = install_documents(tmp_path, monitoring=operator)
    install(api, docs)
    slot = json.dumps({"acquired_at": 1.0, "taints": "storage=MountMissing"})
    api.create("configmaps", NS, budget_configmap({"a": slot, "b": slot}, {"nodes": 2, "counted_at": 1.0}))
    devices = json.dumps({"devices": ["gpu0"], "at": 1.0})
    api.create("configmaps", NS, {"metadata": {"name": "node-health-device-budget"}, "data": {"a": devices}})
    labels = {**RULE_LABELS, "node-health/node": "a", "node-health/category": "gpu"}
    spec = {
        "deviceSelector": {"driver": "gpu.nvidia.com", "pool": "a", "device": "gpu-0"},
        "taint": {"key": "node-health/gpu", "value": "GpuHeldOutOfBand", "effect": "NoSchedule"},
    }
    api.create(
        "devicetaintrules", "", {"metadata": {"name": "node-health.gpu.a.gpu-0", "labels": labels}, "spec": spec}
    )
    fault = {
        "faultId": "f0000001",
        "faultType": "NPU",
        "faultCode": "160010001",
        "faultTime": 1,
        "assertion": "occur",
        "influence": [{"nodeName": "b", "deviceIds": [1]}],
    }
    message = {"id": "m0000001", "timestamp": 1000, "version": "1.0", "resource": "node-health", "faults": [fault]}
    pf_labels = {**publicfault.LABELS, "node-health/node": "b"}
    body = {
        "metadata": {"name": "node-health-publicfault-b", "labels": pf_labels},
        "data": {"PublicFault": json.dumps(message)},
    }
    api.create("configmaps", "mindx-dl", body)
    taint = {"key": "node-health/storage", "value": "MountMissing", "effect": "NoSchedule"}
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": ""}
    ours = {"type": "StorageHealthy", "status": "False", "reason": "MountMissing", "message": "fail: MountMissing"}
    api.add_node("a", labels={"node-health/ready": "false"}, taints=[taint], conditions=[ready, ours])
    lost = {**ready, "status": "Unknown", "reason": "NodeStatusUnknown"}
    api.add_node("b", labels={"node-health/ready": "false"}, taints=[taint], conditions=[lost])
    agent_pod(api, "node-health-aaaaa", "a")
    agent_pod(api, "node-health-bbbbb", "b")
    return docs


def uninstaller(api: ApiDouble, dry_run: bool = False, wait: float = 60.0) -> tuple[int, list[str]]:
    clock = Clock(0.0)
    out: list[str] = []
    config = parse_config({"kubernetes": {"budget_namespace": NS}})
    code = uninstall(KubeApi(api.client, 5), config, NS, wait, dry_run, out.append, clock, clock.advance)
    return code, out


@pytest.mark.system
def test_while_an_agent_still_runs_nothing_is_cleaned_and_a_second_run_finishes_with_exactly_its_role(
    double: ApiDouble, tmp_path: Path
) -> None:
    docs = tainted_cluster(double, tmp_path, operator=True)
    code, out = uninstaller(double)
    assert code == 1, out
    assert out[0] == f"daemonset {NS}/node-health: deleted"
    assert out[1] == "agents: waiting for 1 pod(s) to stop", "the pod on b, whose node is not Ready, does not count"
    assert out[-1] == "agents: 1 still running after 60s (node-health-aaaaa on a); nothing cleaned yet"
    assert our_taints(double.node("a")) and our_taints(double.node("b")), "nothing cleaned while an agent runs"
    assert exists(double, ("namespaces", "", NS)) and exists(double, ("clusterroles", "", "node-health"))

    double.delete("pods", NS, "node-health-aaaaa", grace_seconds=0)  # a's kubelet has stopped it
    double.foreign_write_before_ours("a")  # a 409: the Node read again
    code, out = uninstaller(double)
    assert code == 0, out
    assert "agents: 1 pod(s) on nodes that are not Ready deleted at once: node-health-bbbbb on b" in out
    assert our_taints(double.node("a")) == {} and our_taints(double.node("b")) == {}
    assert double.device_taint_rules() == []
    recovered = json.loads((double.configmap("mindx-dl", "node-health-publicfault-b") or {})["data"]["PublicFault"])
    assert [f["assertion"] for f in recovered["faults"]] == ["recover"]
    assert [key(d) for d in docs if exists(double, key(d))] == []
    assert not exists(double, ("configmaps", NS, "node-health-budget"))
    # Every verb its role grants was used, and nothing else: its role is exactly what it calls.
    assert_least_privilege(calls(double.log), *UNINSTALL_RBAC, PUBLIC_FAULTS_RBAC)


@pytest.mark.system
def test_a_dry_run_says_what_it_would_do_and_changes_nothing(double: ApiDouble, tmp_path: Path) -> None:
    tainted_cluster(double, tmp_path, operator=False)
    writes = len(double.writes)
    code, out = uninstaller(double, dry_run=True)
    assert code == 0, out
    assert len(double.writes) == writes
    assert f"daemonset {NS}/node-health: would delete" in out
    assert "node b: would remove taint node-health/storage=MountMissing:NoSchedule, label node-health/ready" in out
    assert "devicetaintrules: would remove 1 (node-health.gpu.a.gpu-0)" in out
    assert "public faults mindx-dl/node-health-publicfault-b: would recover 1 fault(s)" in out
    assert f"configmap {NS}/node-health-budget: would delete" in out
    assert "clusterrole node-health: would delete" in out
    assert "validatingadmissionpolicy node-health-own-node: would delete" in out
    assert "role mindx-dl/node-health-public-faults: would delete" in out
    assert not [line for line in out if line.startswith(("podmonitor", "prometheusrule"))], "not served: none"
    assert not [line for line in out if line.startswith(("role ", "rolebinding ")) and f" {NS}/" in line], (
        "what is in the namespace goes with it"
    )
    assert out[-1] == (
        f"namespace {NS}: would delete, with everything in it; "
        "then clusterrolebinding node-health-uninstall, clusterrole node-health-uninstall"
    )


@pytest.mark.system
def test_every_object_the_install_puts_outside_its_namespace_is_one_the_uninstaller_may_delete(
    tmp_path: Path,
) -> None:
    """A kind deploy/ (or a component, example or deploy/prometheus) adds outside the namespace, and the uninstaller
    does not know, would be left behind; a name its role does not list would make it fail with 403."""
    rules = [d for d in yaml.safe_load_all((UNINSTALL / "rbac.yaml").read_text()) if d and d["kind"] == "ClusterRole"]
    deletable: dict[str, set[str]] = {}
    for rule in rules[0]["rules"]:
        if "delete" in rule["verbs"]:
            for resource in rule["resources"]:
                deletable.setdefault(resource, set()).update(rule.get("resourceNames") or ["*"])
    known = {kind.resource for kind in INSTALLED}
    for doc in install_documents(tmp_path):
        resource, namespace, name = key(doc)
        labels = doc["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/name") == "node-health", f"{doc['kind']} {name} lacks the install's label"
        if namespace == NS or resource == "namespaces" or labels.get("app.kubernetes.io/component") == "uninstall":
            continue  # deleted with the namespace (or by the garbage collector, after it)
        assert resource in known, f"the uninstaller does not look for {doc['kind']}"
        assert name in deletable.get(resource, set()), f"the uninstaller may not delete {doc['kind']} {name}"
    namespaces = [d for d in rules[0]["rules"] if "namespaces" in d["resources"]]
    assert namespaces == [
        {"apiGroups": [""], "resources": ["namespaces"], "resourceNames": [NS], "verbs": ["get", "delete"]}
    ]
