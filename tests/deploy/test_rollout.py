"""The DaemonSet at fleet scale and its exposure, on the rendered kustomization (`kubectl kustomize deploy/`):

- no ResourceQuota in the agent's namespace caps the DaemonSet below 10,000 nodes (pods, or its requests and
  limits times the node count), and the check catches the 1,000-pod quota 0.1 shipped;
- rollouts wait `minReadySeconds` for each new pod;
- every hostPath the DaemonSet mounts is where the code reads (the shipped config points the host paths there and
  the probes read through them), no host file is mounted twice, /dev is read-only, the state directory
  (/var/lib/node-health, the counter windows) is the only one written, and a device node on a read-only mount
  still opens read-write (what NVML does);
- the network-policy component: the pre-flight port from everywhere, the metrics port from `monitoring` only;
- the ports the manifests name (DaemonSet, PodMonitor, Service, probes, policy) are the ones a real agent with the
  shipped config opens, each serving what they expect, with and without the component.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes.utils import parse_quantity
from support.kustomize import overlay, rendered
from support.netservers import Netns
from support.system import REPO, require_root, require_tool

from agent.config import STATUS_ON_MAIN_PORT_ENV, parse_config
from agent.version import __version__
from probes import all_probes
from probes.host.config import HostConfig
from probes.interconnect.config import InterconnectConfig
from probes.npu.config import NpuConfig
from probes.runtime.host import Host

DEPLOY = REPO / "deploy"
NETWORK_POLICY = DEPLOY / "components" / "network-policy"
VERSIONS = [kubernetes_validate.utils.latest_version(), "1.30"]
FLEET = 10_000
STATE_DIR = InterconnectConfig().state_dir  # the default the shipped config keeps


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def agent_container(daemonset: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "agent"]
    return container


# --- quota -----------------------------------------------------------------------------------------------------


def quota_applies(quota: dict[str, Any], pod: dict[str, Any], namespace: str) -> bool:
    """Whether the quota counts the pod (its namespace, and its PriorityClass scope if it has one)."""
    if quota["metadata"].get("namespace") != namespace:
        return False
    spec = quota.get("spec", {})
    if "scopes" in spec and set(spec["scopes"]) - {"NotTerminating", "NotBestEffort"}:
        return False  # Terminating / BestEffort / CrossNamespacePodAffinity scopes do not count the agent
    for expression in spec.get("scopeSelector", {}).get("matchExpressions", []):
        if expression["scopeName"] != "PriorityClass":
            continue
        priority = pod.get("priorityClassName", "")
        operator, values = expression["operator"], expression.get("values", [])
        matched = {
            "In": priority in values,
            "NotIn": priority not in values,
            "Exists": bool(priority),
            "DoesNotExist": not priority,
        }[operator]
        if not matched:
            return False
    return True


def daemonset_caps(quota: dict[str, Any], daemonset: dict[str, Any]) -> list[str]:
    """Each limit of the quota that `FLEET` agent pods would exceed, as `resource: what they need > hard`."""
    container = agent_container(daemonset)
    resources = container.get("resources", {})
    per_pod = {"pods": 1, "count/pods": 1}
    for kind in ("requests", "limits"):
        for name, value in resources.get(kind, {}).items():
            per_pod[f"{kind}.{name}"] = parse_quantity(value)
            if kind == "requests":
                per_pod[name] = parse_quantity(value)  # `cpu` and `memory` in a quota mean the requests
    caps = []
    for name, hard in quota["spec"].get("hard", {}).items():
        if name in per_pod and per_pod[name] * FLEET > parse_quantity(hard):
            caps.append(f"{name}: {per_pod[name] * FLEET} > {hard}")
    return caps


@pytest.fixture(scope="module")
def render() -> list[dict[str, Any]]:
    return rendered(DEPLOY)


@pytest.mark.system
def test_no_quota_caps_the_daemonset_below_10000_nodes(render: list[dict[str, Any]]) -> None:
    (daemonset,) = by_kind(render, "DaemonSet")
    namespace = daemonset["metadata"]["namespace"]
    pod = daemonset["spec"]["template"]["spec"]
    quotas = [q for q in by_kind(render, "ResourceQuota") if quota_applies(q, pod, namespace)]
    assert quotas, "the quota that names system-node-critical must count the agent's pods"
    for quota in quotas:
        assert daemonset_caps(quota, daemonset) == [], quota["metadata"]["name"]
    # The check sees a cap: the quota as 0.1 shipped it, and one on the agent's memory requests.
    old = copy.deepcopy(quotas[0])
    old["spec"]["hard"] = {"pods": "1k"}
    assert daemonset_caps(old, daemonset) == ["pods: 10000 > 1k"]
    old["spec"]["hard"] = {"requests.memory": "100Gi", "limits.cpu": "10k"}
    assert daemonset_caps(old, daemonset) == [f"requests.memory: {parse_quantity('160Mi') * FLEET} > 100Gi"]
    # A quota of another priority class does not count the agent.
    other = copy.deepcopy(quotas[0])
    other["spec"]["scopeSelector"]["matchExpressions"][0]["values"] = ["system-cluster-critical"]
    assert not quota_applies(other, pod, namespace)


@pytest.mark.system
def test_rollout_waits_for_each_new_pod_to_stay_ready(render: list[dict[str, Any]]) -> None:
    (daemonset,) = by_kind(render, "DaemonSet")
    assert daemonset["spec"]["minReadySeconds"] >= 30
    assert daemonset["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "10%"
    container = agent_container(daemonset)
    # On the health port, whose pool pods cannot starve (docs/http.md, The kubelet's probes).
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    # Ready once every probe has finished (or timed out in) its first run (docs/http.md, /started).
    assert container["readinessProbe"]["httpGet"] == {"path": "/started", "port": "health"}


# --- mounts ----------------------------------------------------------------------------------------------------


def host_mounts(daemonset: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(host path, mount path, read-only) of every hostPath volume the agent container mounts."""
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    out = []
    for mount in agent_container(daemonset)["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "hostPath" in volume:
            out.append((volume["hostPath"]["path"], mount["mountPath"], bool(mount.get("readOnly"))))
    return out


def shipped_config(render: list[dict[str, Any]]) -> dict[str, Any]:
    (configmap,) = [c for c in by_kind(render, "ConfigMap") if c["metadata"]["name"] == "node-health-config"]
    return dict(yaml.safe_load(configmap["data"]["config.yaml"]))


def code_text() -> str:
    files = [*sorted((REPO / "agent").rglob("*.py")), *sorted((REPO / "probes").rglob("*.py"))]
    return "\n".join(path.read_text() for path in files)


@pytest.mark.system
def test_every_host_path_is_read_by_the_code(render: list[dict[str, Any]]) -> None:
    (daemonset,) = by_kind(render, "DaemonSet")
    config = parse_config(shipped_config(render), all_probes())
    host = Host.from_config(config.section(HostConfig))
    read_through = {str(host.root): r"\.root_path\(", str(host.dev): r"\.dev_path\(", str(host.sys): r"\.sys_path\("}
    # The kubelet's PodResources socket (the device ledger), read by the npu and gpu probes and /ready?pod=.
    read_through[os.path.dirname(config.kubernetes.pod_resources_socket)] = r"kubernetes\.pod_resources_socket\b"
    # The counter windows (interconnect.ports, gpu.links), the one host path written.
    read_through[config.section(InterconnectConfig).state_dir] = r"settings\.state_path\("
    # npu.roce's link-flap window shares that directory.
    assert config.section(NpuConfig).state_dir == config.section(InterconnectConfig).state_dir
    assert re.search(r"Path\(settings\.state_dir\) / STATE_FILE", code_text())
    code = code_text()
    for _, mount_path, _ in host_mounts(daemonset):
        assert mount_path in read_through, f"{mount_path} is mounted but the shipped config does not point there"
        assert re.search(read_through[mount_path], code), f"no code reads {mount_path} ({read_through[mount_path]})"


@pytest.mark.system
def test_no_host_file_is_mounted_twice_and_dev_is_read_only(render: list[dict[str, Any]]) -> None:
    (daemonset,) = by_kind(render, "DaemonSet")
    mounts = host_mounts(daemonset)
    seen: dict[str, str] = {}
    for host_path, mount_path, _ in mounts:
        # A host file's container path through each mount that contains it: /dev/kmsg under a /dev mount at
        # /dev is /dev/kmsg, so a second mount of /dev/kmsg at /dev/kmsg shows the same file twice.
        for other_host, other_mount, _ in mounts:
            if (other_host, other_mount) == (host_path, mount_path) or other_host == "/":
                continue
            inside = os.path.relpath(host_path, other_host)
            if not inside.startswith(".."):
                assert os.path.normpath(os.path.join(other_mount, inside)) != mount_path, (host_path, other_host)
        assert seen.setdefault(mount_path, host_path) == host_path, mount_path
    writable = [(host_path, mount_path) for host_path, mount_path, read_only in mounts if not read_only]
    assert writable == [(STATE_DIR, STATE_DIR)], f"the agent writes to no host path but its state: {writable}"
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    (state,) = [v for v in volumes.values() if v.get("hostPath", {}).get("path") == STATE_DIR]
    assert state["hostPath"]["type"] == "DirectoryOrCreate"  # a new node has no such directory yet


OPEN_READ_WRITE = """
import os, sys
fd = os.open(sys.argv[1] + "/null", os.O_RDWR)
assert os.write(fd, b"x") == 1
try:
    open(sys.argv[1] + "/created", "w")
except OSError as exc:
    print(exc.errno)
"""


@pytest.mark.system
def test_a_device_node_on_a_read_only_mount_opens_read_write(tmp_path: Path) -> None:
    """What a read-only /dev must allow: NVML opens /dev/nvidiactl and /dev/nvidia* read-write. The kernel refuses
    writes to a read-only mount for regular files, directories and links only; creating a file there fails."""
    require_root()
    unshare, mount = require_tool("unshare"), require_tool("mount")
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "null", 0o20666, os.makedev(1, 3))
    script = (
        f"{mount} --bind {dev} {dev} && {mount} -o remount,bind,ro {dev} && "
        f"{sys.executable} -c '{OPEN_READ_WRITE}' {dev}"
    )
    done = subprocess.run([unshare, "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "30", "EROFS for a new file: the mount really was read-only"


# --- network policy --------------------------------------------------------------------------------------------


@pytest.mark.system
def test_network_policy_opens_the_preflight_to_all_and_metrics_to_monitoring(tmp_path: Path) -> None:
    docs = rendered(overlay(tmp_path / "policy", [DEPLOY], (NETWORK_POLICY,)))
    (policy,) = by_kind(docs, "NetworkPolicy")
    (daemonset,) = by_kind(docs, "DaemonSet")
    for doc in (policy, daemonset):
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert policy["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"], "egress (API server, DNS, NTP, probes) stays open"
    ports = {p["name"]: p["containerPort"] for p in agent_container(daemonset)["ports"]}
    assert ports == {"http": 9100, "metrics": 9101, "health": 9102}
    rules = {rule["ports"][0]["port"]: rule for rule in policy["spec"]["ingress"]}
    assert set(rules) == set(ports)
    assert "from" not in rules["http"], "/ready and /healthz from everywhere"
    assert "from" not in rules["health"], "the kubelet's probes, from the node, whatever the implementation"
    (source,) = rules["metrics"]["from"]
    assert source == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    # The component turns /metrics and /status off on the port it opens to everyone.
    assert {"name": STATUS_ON_MAIN_PORT_ENV, "value": "false"} in agent_container(daemonset)["env"]
    # Without the component nothing restricts the agent, which keeps /status on 9100 too.
    plain = rendered(DEPLOY)
    assert by_kind(plain, "NetworkPolicy") == []
    assert STATUS_ON_MAIN_PORT_ENV not in {e["name"] for e in agent_container(by_kind(plain, "DaemonSet")[0])["env"]}


PATHS = ("/ready", "/healthz", "/started", "/metrics", "/status")
ASK_EACH_PORT = """
import json, sys, time, urllib.error, urllib.request
ports = json.loads(sys.argv[1])
def status(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0
deadline = time.monotonic() + 30
while any(status(port, "/healthz") != 200 for port in ports) and time.monotonic() < deadline:
    time.sleep(0.1)
print(json.dumps({port: {path: status(port, path) for path in sys.argv[2:]} for port in ports}))
"""


def served_by_ports(
    tmp_path: Path, http: dict[str, Any], env: dict[str, str], ports: list[int]
) -> dict[int, dict[str, int]]:
    """What `node-health run` with this http section and container env serves on each port: in a network
    namespace of its own, so the manifests' fixed ports clash with nothing on this machine."""
    require_root()
    config = tmp_path / "config.yaml"
    probes = {name: {"enabled": False} for name in all_probes()}
    config.write_text(yaml.safe_dump({"http": http, "kubernetes": {"enabled": False}, "probes": probes}))
    netns = Netns("nhports")
    agent_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    agent = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            netns.name,
            sys.executable,
            "-m",
            "agent.cli",
            "run",
            "--no-kube",
            "--config",
            str(config),
        ],
        cwd=REPO,
        env=agent_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        done = netns.exec([sys.executable, "-c", ASK_EACH_PORT, json.dumps(ports), *PATHS])
        assert done.returncode == 0, done.stderr
        return {int(port): answers for port, answers in json.loads(done.stdout).items()}
    finally:
        agent.terminate()
        agent.wait(10)
        netns.close()


@pytest.mark.system
@pytest.mark.parametrize("policy", [False, True], ids=["deploy", "network-policy"])
def test_the_ports_the_manifests_name_are_the_ones_the_agent_opens(tmp_path: Path, policy: bool) -> None:
    """kubectl apply -k deploy/ (or with the network-policy component): the DaemonSet's ports are the shipped
    config's, the PodMonitor scrapes the one that serves /metrics, the Service and the kubelet's probes use the one
    that serves /ready, and with the policy the port open to every pod serves no /metrics or /status."""
    docs = rendered(overlay(tmp_path / "policy", [DEPLOY], (NETWORK_POLICY,)) if policy else DEPLOY)
    (daemonset,) = by_kind(docs, "DaemonSet")
    container = agent_container(daemonset)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    config = parse_config(shipped_config(docs), all_probes())
    assert ports == {"http": config.http.port, "metrics": config.http.metrics_port, "health": config.http.health_port}
    monitor = yaml.safe_load((DEPLOY / "prometheus" / "podmonitor.yaml").read_text())
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (service,) = by_kind(docs, "Service")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    assert container["readinessProbe"]["httpGet"]["port"] == container["livenessProbe"]["httpGet"]["port"] == "health"
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    served = served_by_ports(tmp_path, shipped_config(docs)["http"], env, list(ports.values()))
    main, metrics, health = served[ports["http"]], served[ports["metrics"]], served[ports["health"]]
    assert metrics == {"/ready": 404, "/healthz": 200, "/started": 200, "/metrics": 200, "/status": 200}
    assert health == {"/ready": 404, "/healthz": 200, "/started": 200, "/metrics": 404, "/status": 404}
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert (main["/ready"], main["/healthz"], main["/started"]) == (200, 200, 200)
    assert (main["/metrics"], main["/status"]) == ((404, 404) if policy else (200, 200))
    if policy:
        (network_policy,) = by_kind(docs, "NetworkPolicy")
        everyone = [r["ports"][0]["port"] for r in network_policy["spec"]["ingress"] if "from" not in r]
        assert everyone == ["http", "health"] and all(served[ports[name]]["/status"] == 404 for name in everyone)


# --- the release the manifests name ----------------------------------------------------------------------------


def test_the_manifests_name_this_release() -> None:
    """agent/version.py sets the version; the manifests follow it (scripts/release.py adds the registry and the
    digest when it releases, docs/release.md)."""
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    (entry,) = [image for image in kustomization["images"] if image["name"] == "node-health"]
    assert entry["newTag"] == __version__
    assert set(entry) <= {"name", "newName", "newTag", "digest"}
    assert ("digest" in entry) == ("newName" in entry), "a release pins both the registry and the digest"
    daemonset = yaml.safe_load((DEPLOY / "daemonset.yaml").read_text())
    assert agent_container(daemonset)["image"] == f"node-health:{__version__}"
    uninstall = yaml.safe_load((DEPLOY / "uninstall" / "kustomization.yaml").read_text())
    assert [image for image in uninstall["images"] if image["name"] == "node-health"] == [entry], "pinned alike"
    cleanup = (DEPLOY / "examples" / "cleanup-job.yaml").read_text()
    expected = (
        f"{entry['newName']}:{__version__}@{entry['digest']}" if "digest" in entry else f"node-health:{__version__}"
    )
    assert f"image: {expected}\n" in cleanup


# --- canary ----------------------------------------------------------------------------------------------------


@pytest.mark.system
def test_the_canary_overlay_runs_one_pool_in_dry_run(tmp_path: Path) -> None:
    """deploy/examples/canary used as docs/deployment.md says: copied next to the checkout."""
    (tmp_path / "node-health").symlink_to(REPO, target_is_directory=True)
    shutil.copytree(DEPLOY / "examples" / "canary", tmp_path / "canary")
    docs = rendered(tmp_path / "canary")
    (daemonset,) = by_kind(docs, "DaemonSet")
    selector = daemonset["spec"]["template"]["spec"]["nodeSelector"]
    assert selector == {"node-health-canary": "true"}
    (configmap,) = [c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"].startswith("node-health-config")]
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == configmap["metadata"]["name"]
    canary = yaml.safe_load(configmap["data"]["config.yaml"])
    assert parse_config(canary, all_probes()).kubernetes.dry_run is True
    shipped = shipped_config(rendered(DEPLOY))
    assert shipped["kubernetes"].pop("dry_run") is False and canary["kubernetes"].pop("dry_run") is True
    assert canary == shipped, "the canary's config is the shipped one but for dry_run"
    for doc in (daemonset, configmap):
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
