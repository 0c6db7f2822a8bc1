"""deploy/ manifests and the Dockerfile: schema-valid against current Kubernetes, and saying what the design asks."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.system import REPO, require_tool

from agent.config import parse_config
from probes import all_probes

DEPLOY = REPO / "deploy"
MANIFESTS = sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
# The newest Kubernetes the installed kubernetes-validate knows, and the oldest we support (v1 admission policies).
VERSIONS = [kubernetes_validate.utils.latest_version(), "1.30"]
NAMESPACE = "node-health"


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def find(kind: str, name: str | None = None) -> dict[str, Any]:
    for path in MANIFESTS:
        for doc in documents(path):
            if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name):
                return doc
    raise AssertionError(f"no {kind} {name or ''} in deploy/")


def test_validator_knows_a_current_kubernetes() -> None:
    major, minor = (int(x) for x in kubernetes_validate.utils.latest_version().split(".")[:2])
    assert (major, minor) >= (1, 33)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates(path: Path, version: str) -> None:
    docs = documents(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_validator_rejects_a_wrong_manifest() -> None:
    daemonset = copy.deepcopy(find("DaemonSet"))
    daemonset["spec"]["template"]["spec"]["hostPid"] = True  # misspelt: strict validation must catch it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, VERSIONS[0], strict=True)


def test_kustomization_installs_everything() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    assert kustomization["namespace"] == NAMESPACE
    listed = set(kustomization["resources"])
    for name in listed:
        assert (DEPLOY / name).is_file(), name
    optional = {"admission-policy.yaml"}
    assert listed == {p.name for p in MANIFESTS} - optional
    for path in MANIFESTS:
        for doc in documents(path):
            namespace = doc["metadata"].get("namespace")
            assert namespace in (None, NAMESPACE), (path.name, doc["kind"])
    images = {i["name"] for i in kustomization.get("images", [])}
    ds_image = find("DaemonSet")["spec"]["template"]["spec"]["containers"][0]["image"].split(":")[0]
    assert ds_image in images


def test_daemonset_has_what_the_agent_needs() -> None:
    ds = find("DaemonSet", "node-health")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["serviceAccountName"] == "node-health"
    assert {"operator": "Exists"} in pod["tolerations"], "tolerates every taint, its own node-health/* included"
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}

    def host_path(mount_path: str) -> str:
        return volumes[mounts[mount_path]["name"]]["hostPath"]["path"]

    assert host_path("/host") == "/" and mounts["/host"]["readOnly"] is True
    assert mounts["/host"]["mountPropagation"] == "HostToContainer"
    assert host_path("/dev") == "/dev"
    assert host_path("/dev/kmsg") == "/dev/kmsg"
    assert host_path("/sys") == "/sys" and mounts["/sys"]["readOnly"] is True
    assert host_path("/var/lib/kubelet/pod-resources") == "/var/lib/kubelet/pod-resources"
    config_volume = volumes[mounts["/etc/node-health"]["name"]]
    assert config_volume["configMap"]["name"] == find("ConfigMap", "node-health-config")["metadata"]["name"]
    assert container["args"] == ["run", "--config", "/etc/node-health/config.yaml"]

    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"

    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["ports"][0]["containerPort"] == 9100
    for kind in ("requests", "limits"):
        cpu = container["resources"][kind]["cpu"]
        memory = container["resources"][kind]["memory"]
        assert cpu.endswith("m") and int(cpu[:-1]) <= 100, cpu
        assert memory.endswith("Mi") and int(memory[:-2]) <= 128, memory
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod.get("hostNetwork") is False, "port 9100 on the host is node-exporter's"


def test_rbac_is_least_privilege() -> None:
    cluster_role = find("ClusterRole", "node-health")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in cluster_role["rules"]}
    assert rules == {
        (("",), ("nodes",)): {"get", "list", "watch", "patch"},
        (("",), ("nodes/status",)): {"patch"},
        (("", "events.k8s.io"), ("events",)): {"create", "patch"},
    }
    role = find("Role", "node-health-budget")
    assert role["metadata"]["namespace"] == NAMESPACE
    for rule in role["rules"]:
        assert rule["resources"] == ["configmaps"]
        assert set(rule["verbs"]) <= {"get", "update", "create"}
        if set(rule["verbs"]) != {"create"}:
            assert rule["resourceNames"] == ["node-health-budget"]
    for path in MANIFESTS:
        for doc in documents(path):
            for rule in doc.get("rules", []):
                assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], path.name
    binding = find("RoleBinding", "node-health-budget")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "node-health", "namespace": NAMESPACE}]
    assert find("ClusterRoleBinding", "node-health")["subjects"] == binding["subjects"]


def test_service_reaches_the_agent_on_the_same_node() -> None:
    service = find("Service", "agent")
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(9100, "http")]
    pod_labels = find("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_default_config_is_valid() -> None:
    configmap = find("ConfigMap", "node-health-config")
    config = parse_config(yaml.safe_load(configmap["data"]["config.yaml"]), all_probes())
    assert config.host.root == "/host"
    assert config.kubernetes.enabled and not config.kubernetes.dry_run
    assert config.kubernetes.max_unhealthy == "10%"


def test_admission_policy_binds_its_policy() -> None:
    policy = find("ValidatingAdmissionPolicy", "node-health-own-node")
    binding = find("ValidatingAdmissionPolicyBinding", "node-health-own-node")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "system:serviceaccount:node-health:node-health" in policy["spec"]["matchConditions"][0]["expression"]


def test_dockerfile_is_hadolint_clean() -> None:
    hadolint = require_tool("hadolint")
    result = subprocess.run(
        [hadolint, "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = (REPO / "Dockerfile").read_text()
    assert all(line.startswith("FROM python:3.11-slim") for line in text.splitlines() if line.startswith("FROM"))
    assert "util-linux" in text and "nsenter --version" in text and "py-spy --version" in text
