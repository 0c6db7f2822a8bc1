"""deploy/: schema-valid manifests and kustomize renders, a shipped config that is ready on a healthy node, and the
taint-safety example and docs (docs/deployment.md) naming every category.

- kubernetes-validate (strict) checks every manifest and every rendered kustomization against Kubernetes 1.30 (the
  oldest supported: v1 admission policies, the node claim in ServiceAccount tokens) and the newest it knows.
- `kubectl kustomize` renders deploy/, an overlay with components/no-admission-policy, and the device-plugin
  tolerations example applied to sample device-plugin DaemonSets.
- The shipped config (taken from the render) runs `node-health check` against a host root whose resolv.conf
  names a loopback DNS server that answers NXDOMAIN for cluster.local names, as datacenter resolvers do.
The admission policy's CEL is evaluated in tests/deploy/test_admission_policy.py.
"""

from __future__ import annotations

import copy
import ctypes
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.cli import check_json
from support.kustomize import kustomize, overlay, rendered
from support.netservers import DnsTestServer, ZoneResolver
from support.system import REPO, require_root, require_tool

from agent.config import parse_config
from probes import all_probes
from probes.base import CATEGORIES

DEPLOY = REPO / "deploy"
MANIFESTS = sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
NO_ADMISSION_POLICY = DEPLOY / "components" / "no-admission-policy"
TOLERATIONS_EXAMPLE = DEPLOY / "examples" / "device-plugin-tolerations"
DEPLOYMENT_DOC = REPO / "docs" / "deployment.md"
# The newest Kubernetes the installed kubernetes-validate knows, and the oldest we support (v1 admission policies).
VERSIONS = [kubernetes_validate.utils.latest_version(), "1.30"]
NAMESPACE = "node-health"
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy"}
CLUSTER_SCOPED |= {"ValidatingAdmissionPolicyBinding"}
TAINT_KEYS = {f"node-health/{category}" for category in CATEGORIES}


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def find(kind: str, name: str | None = None, docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    candidates = docs if docs is not None else [doc for path in MANIFESTS for doc in documents(path)]
    for doc in candidates:
        if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name):
            return doc
    raise AssertionError(f"no {kind} {name or ''} in deploy/")


def kinds(docs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return sorted((doc["kind"], doc["metadata"]["name"]) for doc in docs)


# --- manifests and renders --------------------------------------------------------------------------------


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


@pytest.mark.system
@pytest.mark.parametrize("version", VERSIONS)
def test_rendered_kustomizations_validate(version: str, tmp_path: Path) -> None:
    without_policy = overlay(tmp_path / "older-cluster", [DEPLOY], (NO_ADMISSION_POLICY,))
    for directory in (DEPLOY, without_policy, DEPLOY / "uninstall"):
        docs = rendered(directory)
        assert len(docs) >= 5
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


def test_validator_rejects_a_wrong_manifest() -> None:
    daemonset = copy.deepcopy(find("DaemonSet"))
    daemonset["spec"]["template"]["spec"]["hostPid"] = True  # misspelt: strict validation must catch it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, VERSIONS[0], strict=True)


@pytest.mark.system
def test_kustomization_installs_everything_the_admission_policy_included() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in MANIFESTS}
    docs = rendered(DEPLOY)
    assert kinds(docs) == sorted(kinds([doc for path in MANIFESTS for doc in documents(path)]))
    assert ("ValidatingAdmissionPolicy", "node-health-own-node") in kinds(docs)
    assert ("ValidatingAdmissionPolicyBinding", "node-health-own-node") in kinds(docs)
    for doc in docs:
        namespace = doc["metadata"].get("namespace")
        if doc["kind"] in CLUSTER_SCOPED:
            assert namespace is None, f"{doc['kind']} is cluster-scoped: kustomize must not give it a namespace"
        else:
            assert namespace == NAMESPACE, (doc["kind"], doc["metadata"]["name"])
    images = {i["name"] for i in kustomization.get("images", [])}
    ds_image = find("DaemonSet")["spec"]["template"]["spec"]["containers"][0]["image"].split(":")[0]
    assert ds_image in images


@pytest.mark.system
def test_no_admission_policy_component_leaves_out_only_the_policy(tmp_path: Path) -> None:
    component = yaml.safe_load((NO_ADMISSION_POLICY / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    full = kinds(rendered(DEPLOY))
    older = kinds(rendered(overlay(tmp_path / "older-cluster", [DEPLOY], (NO_ADMISSION_POLICY,))))
    assert set(full) - set(older) == {
        ("ValidatingAdmissionPolicy", "node-health-own-node"),
        ("ValidatingAdmissionPolicyBinding", "node-health-own-node"),
        ("ValidatingAdmissionPolicy", "node-health-own-devices"),
        ("ValidatingAdmissionPolicyBinding", "node-health-own-devices"),
    }
    assert set(older) < set(full)


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
    assert host_path("/dev") == "/dev" and mounts["/dev"]["readOnly"] is True
    assert host_path("/sys") == "/sys" and mounts["/sys"]["readOnly"] is True
    assert host_path("/var/lib/kubelet/pod-resources") == "/var/lib/kubelet/pod-resources"
    config_volume = volumes[mounts["/etc/node-health"]["name"]]
    assert config_volume["configMap"]["name"] == find("ConfigMap", "node-health-config")["metadata"]["name"]
    assert container["args"] == ["run", "--config", "/etc/node-health/config.yaml"]

    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"  # the health port's node reserve

    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["ports"][0]["containerPort"] == 9100
    # The figures follow the measurement (tests/deploy/test_resources.py); here: millicores and MiB, requests <= limits.
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    for key, unit in (("cpu", "m"), ("memory", "Mi")):
        assert requests[key].endswith(unit) and limits[key].endswith(unit), (requests, limits)
        assert int(requests[key][: -len(unit)]) <= int(limits[key][: -len(unit)]), (requests, limits)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod.get("hostNetwork") is False, "port 9100 on the host is node-exporter's"
    # The pod's resolver answers the cluster names (network.dns.cluster_names): ClusterFirst, not the node's.
    assert pod["dnsPolicy"] == "ClusterFirst"


def test_rbac_has_no_wildcards_and_binds_the_agent() -> None:
    # The exact verbs are proven against the calls the kube package makes (tests/kube/).
    for path in MANIFESTS:
        for doc in documents(path):
            for rule in doc.get("rules", []):
                assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], path.name
    role = find("Role", "node-health-budget")
    assert role["metadata"]["namespace"] == NAMESPACE
    for rule in role["rules"]:
        assert rule["resources"] == ["configmaps"]
        if set(rule["verbs"]) != {"create"}:
            assert rule["resourceNames"] == ["node-health-budget", "node-health-device-budget"]
    subjects = [{"kind": "ServiceAccount", "name": "node-health", "namespace": NAMESPACE}]
    assert find("RoleBinding", "node-health-budget")["subjects"] == subjects
    assert find("ClusterRoleBinding", "node-health")["subjects"] == subjects


def test_service_reaches_the_agent_on_the_same_node() -> None:
    service = find("Service", "agent")
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    pod_labels = find("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


@pytest.mark.system
def test_dockerfile_is_hadolint_clean() -> None:
    hadolint = require_tool("hadolint")
    result = subprocess.run(
        [hadolint, "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- the shipped config ----------------------------------------------------------------------------------------


def shipped_config() -> dict[str, Any]:
    """The config.yaml the default kustomization installs (from the render, as the cluster gets it)."""
    configmap = find("ConfigMap", "node-health-config", rendered(DEPLOY))
    return dict(yaml.safe_load(configmap["data"]["config.yaml"]))


@pytest.mark.system
def test_shipped_config_is_valid_and_resolves_no_cluster_name_with_the_node_resolver() -> None:
    raw = shipped_config()
    config = parse_config(raw, all_probes())
    assert config.host.root == "/host"
    assert config.kubernetes.enabled and not config.kubernetes.dry_run
    assert config.kubernetes.max_unhealthy == "10%"
    assert raw["network"]["dns"]["names"] == []
    assert "cluster.local" not in json.dumps(raw)


def kernel_clock_unsynchronised() -> bool:
    """adjtimex(2) with modes 0 only reads; it returns TIME_ERROR (5) while the kernel clock is unsynchronised."""
    libc = ctypes.CDLL(None, use_errno=True)
    timex = ctypes.create_string_buffer(512)  # struct timex is 208 bytes on 64-bit Linux; modes (offset 0) = 0
    return int(libc.adjtimex(timex)) == 5


def hccl_ports_reserved() -> bool:
    reserved = Path("/proc/sys/net/ipv4/ip_local_reserved_ports").read_text().strip()
    return bool(reserved)


def for_this_machine(config: dict[str, Any], host_root: Path) -> dict[str, Any]:
    """What differs between a node's DaemonSet pod and this test machine, and nothing else.

    - host.root: the node's / is mounted at /host in the pod; here a directory whose etc/resolv.conf names the
      loopback DNS server.
    - `nsenter -t 1`: in the pod it leaves the container's mount namespace for the host's. Here the agent already
      runs in the host's namespaces, and PID 1 is the sandbox's init, whose namespaces root may not open; the same
      nsenter command enters this test's own namespaces instead.
    - kubernetes.enabled: there is no API server; the Node side is tested against the API double elsewhere.
    """
    adjusted = copy.deepcopy(config)
    adjusted["host"]["root"] = str(host_root)
    for family, key in (("npu", "smi_command"), ("gpu", "smi_command"), ("time", "chronyc_command")):
        command = adjusted[family][key]
        assert command[:3] == ["nsenter", "-t", "1"], command
        adjusted[family][key] = [command[0], "-t", str(os.getpid()), *command[3:]]
    adjusted["kubernetes"]["enabled"] = False
    return adjusted


@pytest.mark.system
def test_shipped_config_is_ready_on_a_healthy_node(tmp_path: Path) -> None:
    """Nothing fails and nothing is unknown; a check that cannot apply here (no NPU, GPU, Huawei PCIe function,
    mounts, egress targets) skips. Two warns are allowed, each only while this machine really is that way: the
    VM runs no NTP daemon (the kernel says its clock is unsynchronised), and it reserves no HCCL ports."""
    require_root()  # port 53, nsenter
    require_tool("nsenter")
    host_root = tmp_path / "host"
    (host_root / "etc").mkdir(parents=True)
    dns = DnsTestServer(ZoneResolver({"registry.dc.example": "127.0.0.1"}), address="127.83.0.53", port=53)
    try:
        (host_root / "etc" / "resolv.conf").write_text(f"nameserver {dns.host}\n")
        config = for_this_machine(shipped_config(), host_root)
        report = check_json(config, tmp_path, timeout=180)

        explained = set()
        if kernel_clock_unsynchronised():
            explained.add(("time.sync", "ClockUnsynced"))
        if not hccl_ports_reserved():
            explained.add(("network.ports", "PortsNotReserved"))
        findings = report["findings"]
        assert len(findings) >= 15
        for finding in findings:
            what = f"{finding['check']} {finding['subject']}: {finding['reason']}: {finding['message']}"
            assert finding["status"] in ("ok", "skip", "warn"), what
            if finding["status"] == "warn":
                assert (finding["check"], finding["reason"]) in explained, what
            assert "cluster.local" not in finding["subject"], what
        assert report["ready"] is True, report["reasons"]

        # The same set-up catches the old shipped config: a cluster.local name on the node's resolver fails.
        config["network"]["dns"]["names"] = ["kubernetes.default.svc.cluster.local"]
        old = check_json(config, tmp_path, timeout=180)
        failed = [f for f in old["findings"] if f["check"] == "network.dns" and f["status"] == "fail"]
        assert [(f["subject"], f["reason"]) for f in failed] == [("kubernetes.default.svc.cluster.local", "DnsFailed")]
        assert "NXDOMAIN" in failed[0]["message"]
        assert old["ready"] is False
    finally:
        dns.close()


# --- taint safety: tolerations for the device plugins, the autoscaler's status taints ----------------------------

ASCEND_DEVICE_PLUGIN = {
    "apiVersion": "apps/v1",
    "kind": "DaemonSet",
    "metadata": {"name": "ascend-device-plugin-daemonset", "namespace": "kube-system"},
    "spec": {
        "selector": {"matchLabels": {"name": "ascend-device-plugin-ds"}},
        "template": {
            "metadata": {"labels": {"name": "ascend-device-plugin-ds"}},
            "spec": {
                "tolerations": [
                    {"key": "CriticalAddonsOnly", "operator": "Exists"},
                    {"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"},
                ],
                "nodeSelector": {"accelerator": "huawei-Ascend910"},
                "containers": [{"name": "device-plugin-01", "image": "ascend-k8sdeviceplugin:v6.0.0"}],
            },
        },
    },
}


def device_plugin(name: str, tolerations: list[dict[str, str]] | None) -> dict[str, Any]:
    daemonset = copy.deepcopy(ASCEND_DEVICE_PLUGIN)
    daemonset["metadata"]["name"] = name
    spec = daemonset["spec"]["template"]["spec"]
    if tolerations is None:
        del spec["tolerations"]
    else:
        spec["tolerations"] = tolerations
    return daemonset


def tolerates(toleration: dict[str, str], taint: dict[str, str]) -> bool:
    """The Kubernetes rule (k8s.io/api/core/v1 Toleration.ToleratesTaint)."""
    if toleration.get("effect") and toleration["effect"] != taint["effect"]:
        return False
    if toleration.get("key") and toleration["key"] != taint["key"]:
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return True
    return bool(toleration.get("key")) and toleration.get("value", "") == taint.get("value", "")


def test_tolerations_example_names_every_category_once() -> None:
    operations = yaml.safe_load((TOLERATIONS_EXAMPLE / "tolerations.yaml").read_text())
    values = [op["value"] for op in operations]
    assert all(op["op"] == "add" and op["path"] == "/spec/template/spec/tolerations/-" for op in operations)
    assert sorted(v["key"] for v in values) == sorted(TAINT_KEYS)
    assert all(v == {"key": v["key"], "operator": "Exists"} for v in values)


@pytest.mark.system
def test_tolerations_example_adds_to_device_plugin_daemonsets(tmp_path: Path) -> None:
    sources = tmp_path / "device-plugins"
    sources.mkdir()
    nvidia = device_plugin("nvidia-device-plugin-daemonset", [{"key": "nvidia.com/gpu", "operator": "Exists"}])
    exporter = device_plugin("npu-exporter", [])
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "volcano-scheduler", "namespace": "kube-system"},
        "spec": copy.deepcopy(ASCEND_DEVICE_PLUGIN["spec"]),
    }
    for name, doc in (("ascend", ASCEND_DEVICE_PLUGIN), ("nvidia", nvidia), ("exporter", exporter), ("d", deployment)):
        (sources / f"{name}.yaml").write_text(yaml.safe_dump(doc))
    directory = overlay(sources, ["ascend.yaml", "nvidia.yaml", "exporter.yaml", "d.yaml"], (TOLERATIONS_EXAMPLE,))
    docs = {doc["metadata"]["name"]: doc for doc in rendered(directory)}

    for original in (ASCEND_DEVICE_PLUGIN, nvidia, exporter):
        out = docs[original["metadata"]["name"]]
        for version in VERSIONS:
            kubernetes_validate.validate(out, version, strict=True)
        before = original["spec"]["template"]["spec"]["tolerations"]
        after = out["spec"]["template"]["spec"]["tolerations"]
        assert after[: len(before)] == before, "the DaemonSet's own tolerations stay"
        assert {t["key"] for t in after[len(before) :]} == TAINT_KEYS
        for key in TAINT_KEYS:
            for effect in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
                taint = {"key": key, "value": "NpuHealthCritical", "effect": effect}
                assert any(tolerates(t, taint) for t in after), taint
    assert docs["volcano-scheduler"]["spec"] == deployment["spec"], "only DaemonSets are patched"
    # Not tolerated by the DaemonSet's own list: what the DaemonSet controller would do without the example.
    taint = {"key": "node-health/npu", "value": "NpuHealthCritical", "effect": "NoSchedule"}
    assert not any(tolerates(t, taint) for t in ASCEND_DEVICE_PLUGIN["spec"]["template"]["spec"]["tolerations"])


@pytest.mark.system
def test_tolerations_example_stops_loudly_on_a_daemonset_without_tolerations(tmp_path: Path) -> None:
    sources = tmp_path / "bare"
    sources.mkdir()
    (sources / "bare.yaml").write_text(yaml.safe_dump(device_plugin("dcgm-exporter", None)))
    result = kustomize(overlay(sources, ["bare.yaml"], (TOLERATIONS_EXAMPLE,)))
    assert result.returncode != 0
    assert "add operation does not apply" in result.stderr


def test_deployment_docs_list_every_taint_for_tolerations_and_the_autoscaler() -> None:
    text = DEPLOYMENT_DOC.read_text()
    for key in sorted(TAINT_KEYS):
        assert f"--status-taint={key}" in text, key
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    toleration_lists = [b["tolerations"] for b in blocks if isinstance(b, dict) and "tolerations" in b]
    assert toleration_lists, "docs/deployment.md lost its tolerations block"
    documented = toleration_lists[0]
    assert sorted(t["key"] for t in documented) == sorted(TAINT_KEYS)
    assert documented == [op["value"] for op in yaml.safe_load((TOLERATIONS_EXAMPLE / "tolerations.yaml").read_text())]
    for component in ("Ascend device plugin", "npu-exporter", "NodeD", "dcgm-exporter", "NVIDIA device plugin"):
        assert component in text, component
    assert "deploy/examples/device-plugin-tolerations" in text
    assert "deploy/components/no-admission-policy" in text


def test_deployment_docs_table_of_taints_and_conditions_is_the_category_table() -> None:
    rows = re.findall(r"^\| `(node-health/\w+)` \| `(\w+)` \|$", DEPLOYMENT_DOC.read_text(), re.M)
    assert rows == [(f"node-health/{name}", category.condition_type) for name, category in CATEGORIES.items()]


@pytest.mark.system
def test_deployment_docs_kustomizations_render(tmp_path: Path) -> None:
    """The page's overlays, used as written from a directory beside a node-health checkout."""
    (tmp_path / "node-health").symlink_to(REPO, target_is_directory=True)
    blocks = [
        b for b in re.findall(r"```yaml\n(.*?)```", DEPLOYMENT_DOC.read_text(), re.S) if "kind: Kustomization" in b
    ]
    assert len(blocks) == 2
    older, plugins = (yaml.safe_load(block) for block in blocks)
    (tmp_path / "overlay").mkdir()
    (tmp_path / "overlay" / "kustomization.yaml").write_text(blocks[0])
    docs = rendered(tmp_path / "overlay")
    assert older["components"] == ["../node-health/deploy/components/no-admission-policy"]
    assert "ValidatingAdmissionPolicy" not in {doc["kind"] for doc in docs}
    assert ("DaemonSet", "node-health") in kinds(docs)
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "kustomization.yaml").write_text(blocks[1])
    for name in plugins["resources"]:
        (tmp_path / "plugins" / name).write_text(yaml.safe_dump(device_plugin(Path(name).stem, [])))
    for doc in rendered(tmp_path / "plugins"):
        assert {t["key"] for t in doc["spec"]["template"]["spec"]["tolerations"]} == TAINT_KEYS
