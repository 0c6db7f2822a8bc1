"""deploy/examples/preflight.sh, the job pre-flight, run with sh, dash, busybox sh, bash and bash -e against real
agents (`node-health run --no-kube`: one ready, one not), a refused port, packets dropped in a network namespace (what
kube-proxy does for an internalTrafficPolicy Local Service with no ready agent on the node) and a name that does
not resolve; and the manifests around it: the example Job (validated, its ConfigMap the script verbatim) and the
host-port component rendered with `kubectl kustomize`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.kustomize import rendered
from support.netservers import Netns, refused_port
from support.preflight import SCRIPT, SHELLS, Outcome, preflight
from support.system import REPO, require, require_root, require_tool

from probes import all_probes

EXAMPLE_JOB = REPO / "deploy" / "examples" / "preflight-initcontainer.yaml"
HOST_PORT_COMPONENT = REPO / "deploy" / "components" / "host-port"
VERSIONS = [kubernetes_validate.utils.latest_version(), "1.30"]
# The script gives up after about 10 s; this is a correctness bound (it must not hang), not a benchmark.
GIVE_UP_BOUND_SECONDS = 15.0
MISSING_PATH = "/nonexistent/node-health-preflight-data"


def attempts(outcome: Outcome) -> list[str]:
    return [line.strip() for line in outcome.stderr.splitlines() if re.match(r"\s+round \d: ", line)]


# --- real agents -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Agent:
    url: str
    process: subprocess.Popen[str]


def agent_config(space_path: str) -> dict[str, Any]:
    """Only storage.space runs (every other probe off, whatever probes exist): its path decides the verdict."""
    return {
        "http": {"address": "127.0.0.1", "port": 0, "metrics_port": 0},
        "probes": {name: {"enabled": name == "storage.space"} for name in all_probes()},
        "storage": {"space": [{"path": space_path}]},
    }


def ready_answer(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Agent]]:
    """Two real agents: `ready` (storage.space on an existing directory) and `not_ready` (on a missing path),
    each serving its first verdict before the tests start."""
    directory = tmp_path_factory.mktemp("agents")
    started: dict[str, Agent] = {}
    try:
        for name, path in (("ready", str(directory)), ("not_ready", MISSING_PATH)):
            config = directory / f"{name}.yaml"
            config.write_text(yaml.safe_dump(agent_config(path)))
            started[name] = start_agent(config)
        wait_for_verdict(started["ready"].url, 200, "")
        wait_for_verdict(started["not_ready"].url, 503, "PathMissing")
        yield started
    finally:
        for agent in started.values():
            agent.process.send_signal(signal.SIGTERM)
            try:
                agent.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                agent.process.kill()
                agent.process.wait()


def start_agent(config: Path) -> Agent:
    log = config.with_suffix(".log")
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "--no-kube", "--config", str(config)],
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        match = re.search(r"serving on [^:\s]+:(\d+)", log.read_text())
        if match:
            return Agent(f"http://127.0.0.1:{match.group(1)}", process)
        time.sleep(0.1)
    process.kill()
    process.wait()
    raise AssertionError(f"the agent did not start: {log.read_text()}")


def wait_for_verdict(url: str, status: int, reason: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        code, body = ready_answer(url)
        if code == status and (not reason or any(r["reason"] == reason for r in body["reasons"])):
            return
        assert time.monotonic() < deadline, (url, code, body)
        time.sleep(0.2)


# --- answers from an agent -------------------------------------------------------------------------------------


@pytest.mark.system
@pytest.mark.parametrize("shell", SHELLS)
def test_ready_node_exits_0(agents: dict[str, Agent], shell: str) -> None:
    # A job pod's proxy settings must not catch the agent's address: they point at a port that refuses.
    proxy = f"http://127.0.0.1:{refused_port()}"
    env = {"NODE_HEALTH_URL": agents["ready"].url, "http_proxy": proxy, "HTTP_PROXY": proxy, "all_proxy": proxy}
    outcome = preflight(env, shell)
    assert outcome.code == 0, outcome
    assert outcome.lines[0] == f"node-health pre-flight: {agents['ready'].url}/ready answered 200"
    assert outcome.lines[1].startswith("ready on ")
    assert outcome.stderr == ""


@pytest.mark.system
@pytest.mark.parametrize("shell", SHELLS)
def test_not_ready_node_exits_1_with_the_reason_and_its_fix(agents: dict[str, Agent], shell: str) -> None:
    outcome = preflight({"NODE_HEALTH_URL": agents["not_ready"].url}, shell)
    assert outcome.code == 1, outcome
    assert outcome.lines[0] == (
        f"node-health pre-flight: {agents['not_ready'].url}/ready answered 503: this node is not ready for the job"
    )
    assert outcome.lines[1].startswith("not ready on ")
    (reason,) = [line for line in outcome.lines if "PathMissing" in line]
    assert reason.startswith(f"fail storage.space {MISSING_PATH} PathMissing: ")
    assert " -- fix: create the path" in reason


@pytest.mark.system
def test_values_reach_the_agent_url_encoded(agents: dict[str, Agent]) -> None:
    # Unencoded, `&wait=100` would become a parameter of its own (a 100 s long-poll); encoded, the agent sees one
    # devices value, refuses it with 400, and the script says so with exit 2.
    outcome = preflight({"NODE_HEALTH_URL": agents["ready"].url, "NODE_HEALTH_DEVICES": "0&wait=100"})
    assert outcome.code == 2, outcome
    assert outcome.lines[0].lower() == (
        f"node-health pre-flight: {agents['ready'].url}/ready?devices=0%26wait%3d100 answered 400: "
        "the agent refused the question (check the node_health_* values)"
    )
    assert "devices: '0&wait=100' is not a device" in outcome.lines[1]


@pytest.mark.system
@pytest.mark.parametrize("shell", SHELLS)
def test_device_lists_and_minimums_are_sent(agents: dict[str, Agent], shell: str) -> None:
    # Ascend's runtime takes ranges ("0-3"), the agent a list; the host probe is off in this agent, so the
    # requested host memory is unknown and the answer is not ready (fail closed) with that reason.
    env = {
        "NODE_HEALTH_URL": agents["ready"].url,
        "ASCEND_VISIBLE_DEVICES": " 0-3, 5",
        "NVIDIA_VISIBLE_DEVICES": "all",
        "NODE_HEALTH_MIN_HBM_FREE_MIB": "1024",
        "NODE_HEALTH_MIN_HOST_MEM_MIB": "2048",
    }
    outcome = preflight(env, shell)
    assert outcome.code == 1, outcome
    url = f"{agents['ready'].url}/ready?devices=0%2c1%2c2%2c3%2c5&min_hbm_free_mib=1024&min_host_mem_mib=2048"
    assert outcome.lines[0].lower().startswith(f"node-health pre-flight: {url} answered 503")
    assert any("HostMemoryBelowRequest" in line for line in outcome.lines[2:]), outcome.stdout


@pytest.mark.system
def test_nvidia_devices_when_no_ascend_and_all_means_every_device(agents: dict[str, Agent]) -> None:
    url = agents["ready"].url
    outcome = preflight({"NODE_HEALTH_URL": url, "NVIDIA_VISIBLE_DEVICES": "all", "NODE_HEALTH_CHECKS": "storage"})
    assert outcome.code == 0, outcome
    assert outcome.lines[0] == f"node-health pre-flight: {url}/ready?checks=storage answered 200"
    # This agent's node has no GPU: devices 0 and 1 are not its own, never ready on a guess (NoSuchDevice).
    outcome = preflight({"NODE_HEALTH_URL": url, "NVIDIA_VISIBLE_DEVICES": "0,1"})
    assert outcome.code == 1, outcome
    assert outcome.lines[0].lower().startswith(f"node-health pre-flight: {url}/ready?devices=0%2c1 answered 503")


@pytest.mark.system
def test_node_address_is_asked_before_the_service(agents: dict[str, Agent]) -> None:
    not_ready_port = agents["not_ready"].url.rsplit(":", 1)[1]
    env = {"HOST_IP": "127.0.0.1", "NODE_HEALTH_HOST_PORT": not_ready_port, "NODE_HEALTH_URL": agents["ready"].url}
    outcome = preflight(env)
    assert outcome.code == 1, outcome
    assert outcome.lines[0].startswith(f"node-health pre-flight: http://127.0.0.1:{not_ready_port}/ready answered 503")
    # No agent on the node's port (the component is not installed): the Service answers in the same round.
    env["NODE_HEALTH_HOST_PORT"] = str(refused_port())
    outcome = preflight(env)
    assert outcome.code == 0, outcome
    assert outcome.lines[0] == f"node-health pre-flight: {agents['ready'].url}/ready answered 200"


@pytest.mark.system
def test_an_ipv6_node_address_is_bracketed(agents: dict[str, Agent]) -> None:
    port = refused_port()
    env = {"HOST_IP": "::1", "NODE_HEALTH_HOST_PORT": str(port), "NODE_HEALTH_URL": agents["ready"].url}
    outcome = preflight(env)
    assert outcome.code == 0, outcome
    assert outcome.lines[0] == f"node-health pre-flight: {agents['ready'].url}/ready answered 200"
    outcome = preflight({**env, "NODE_HEALTH_URL": f"http://127.0.0.1:{refused_port()}"})
    assert outcome.code == 3, outcome
    assert attempts(outcome)[0].startswith(f"round 1: http://[::1]:{port}/ready: connection refused")


@pytest.mark.system
def test_an_answer_that_is_not_node_health_is_no_answer(tmp_path: Path) -> None:
    # Something else on the address (a web server answering 200 to everything) must not pass a job.
    (tmp_path / "ready").write_text("<html>hello</html>\n")
    port = refused_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while subprocess.run(["curl", "-s", "-o", "/dev/null", f"http://127.0.0.1:{port}/"]).returncode != 0:
            assert time.monotonic() < deadline, "http.server did not start"
            time.sleep(0.1)
        outcome = preflight({"NODE_HEALTH_URL": f"http://127.0.0.1:{port}"})
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert outcome.code == 3, outcome
    assert attempts(outcome)[0] == (
        f"round 1: http://127.0.0.1:{port}/ready: answered 200, but not as node-health does: <html>hello</html>"
    )


# --- no agent --------------------------------------------------------------------------------------------------


@pytest.mark.system
@pytest.mark.parametrize("shell", SHELLS)
def test_refused_port_exits_3_and_lists_every_attempt(shell: str) -> None:
    url = f"http://127.0.0.1:{refused_port()}"
    outcome = preflight({"NODE_HEALTH_URL": url}, shell)
    assert outcome.code == 3, outcome
    assert outcome.stdout == ""
    assert "no node-health agent answered within" in outcome.stderr
    assert attempts(outcome) == [
        f"round {n}: {url}/ready: connection refused or address unreachable (no agent listening there)"
        for n in (1, 2, 3)
    ]
    assert outcome.seconds < GIVE_UP_BOUND_SECONDS


@pytest.mark.system
@pytest.mark.parametrize("shell", SHELLS)
def test_fail_open_warns_and_exits_0(shell: str) -> None:
    url = f"http://127.0.0.1:{refused_port()}"
    outcome = preflight({"NODE_HEALTH_URL": url, "NODE_HEALTH_FAIL_OPEN": "1"}, shell)
    assert outcome.code == 0, outcome
    assert outcome.stdout == ""
    warning = outcome.stderr.splitlines()[0]
    assert warning.startswith("node-health pre-flight: WARNING: no node-health agent answered within ")
    assert "the job starts unchecked (NODE_HEALTH_FAIL_OPEN=1)" in warning
    assert len(attempts(outcome)) == 3
    # Fail-open is for an absent agent only: a not-ready answer still fails (tested above); any other value of
    # the switch keeps failing closed.
    outcome = preflight({"NODE_HEALTH_URL": url, "NODE_HEALTH_FAIL_OPEN": "0"}, shell)
    assert outcome.code == 3, outcome


@pytest.fixture
def black_hole() -> Iterator[Netns]:
    """A network namespace whose TCP ports 9100 and 9123 drop every packet (iptables -j DROP), as kube-proxy drops
    traffic to an internalTrafficPolicy Local Service when the node has no ready endpoint."""
    require_root()
    require_tool("ip")
    iptables = require_tool("iptables")
    ns = Netns("nhpre")
    try:
        for port in ("9100", "9123"):
            done = ns.exec([iptables, "-A", "INPUT", "-p", "tcp", "--dport", port, "-j", "DROP"])
            require(done.returncode == 0, f"iptables in a network namespace: {done.stderr.strip()}")
        yield ns
    finally:
        ns.close()


@pytest.mark.system
def test_dropped_packets_give_up_within_the_budget(black_hole: Netns) -> None:
    env = {"NODE_HEALTH_URL": "http://127.0.0.1:9100", "HOST_IP": "127.0.0.1", "NODE_HEALTH_HOST_PORT": "9123"}
    outcome = preflight(env, netns=black_hole)
    assert outcome.code == 3, outcome
    tried = attempts(outcome)
    assert tried, outcome.stderr
    # Both addresses were asked, the node's first, and each attempt ended on its own timeout: the packets were
    # dropped, not refused.
    assert tried[0].startswith("round 1: http://127.0.0.1:9123/ready: no answer within the timeout")
    assert tried[1].startswith("round 1: http://127.0.0.1:9100/ready: no answer within the timeout")
    assert all("no answer within the timeout" in line for line in tried), tried
    assert outcome.seconds < GIVE_UP_BOUND_SECONDS, outcome


@pytest.fixture
def no_dns() -> Iterator[Netns]:
    """A network namespace with only loopback, whose resolv.conf names a loopback resolver nobody runs: the
    cluster's names do not resolve there, as for a hostNetwork pod without ClusterFirstWithHostNet."""
    require_root()
    require_tool("ip")
    ns = Netns("nhdns")
    etc = Path("/etc/netns") / ns.name
    try:
        etc.mkdir(parents=True)
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        yield ns
    finally:
        shutil.rmtree(etc, ignore_errors=True)
        ns.close()


@pytest.mark.system
def test_default_service_name_that_does_not_resolve_says_so(no_dns: Netns) -> None:
    outcome = preflight({}, netns=no_dns)
    assert outcome.code == 3, outcome
    tried = attempts(outcome)
    assert len(tried) == 3
    assert tried[0] == (
        "round 1: http://agent.node-health.svc:9100/ready: could not resolve the host name "
        "(a hostNetwork pod needs dnsPolicy: ClusterFirstWithHostNet)"
    )
    assert outcome.seconds < GIVE_UP_BOUND_SECONDS


@pytest.mark.system
def test_without_curl_it_says_so_and_exits_2() -> None:
    dash = require_tool("dash")
    done = subprocess.run([dash, str(SCRIPT)], env={"PATH": "/nonexistent"}, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "curl is not installed" in done.stderr


@pytest.mark.system
def test_script_is_posix_sh_by_shellcheck() -> None:
    shellcheck = require_tool("shellcheck")
    done = subprocess.run([shellcheck, "--shell=sh", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout


# --- the manifests ---------------------------------------------------------------------------------------------


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("version", VERSIONS)
def test_example_job_validates(version: str) -> None:
    docs = documents(EXAMPLE_JOB)
    assert [d["kind"] for d in docs] == ["ConfigMap", "Job"]
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_example_job_runs_the_script_from_its_configmap_with_the_node_address() -> None:
    docs = documents(EXAMPLE_JOB)
    configmap, job = by_kind(docs, "ConfigMap"), by_kind(docs, "Job")
    assert configmap["data"]["preflight.sh"] == SCRIPT.read_text(), (
        "the ConfigMap in deploy/examples/preflight-initcontainer.yaml must hold deploy/examples/preflight.sh "
        "verbatim: paste the script in again (indented by 4)"
    )
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (init,) = pod["initContainers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = init["volumeMounts"]
    assert volumes[mount["name"]]["configMap"]["name"] == configmap["metadata"]["name"]
    assert init["command"] == ["/bin/sh", f"{mount['mountPath']}/preflight.sh"]
    env = {e["name"]: e for e in init["env"]}
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert int(env["NODE_HEALTH_HOST_PORT"]["value"]) == component_host_port()
    # The pre-flight names its pod (downward API), and the agent judges the devices the kubelet allocated to it:
    # the init container asks for no devices, so it has no *_VISIBLE_DEVICES (tests/deploy/test_preflight_pod.py).
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    (train,) = pod["containers"]
    assert any("/" in name for name in train["resources"]["limits"]), "the job itself has devices"
    for kind in ("requests", "limits"):
        assert not [name for name in init["resources"][kind] if "/" in name], "the init container asks for none"


def component_host_port() -> int:
    patch = documents(HOST_PORT_COMPONENT / "host-port.yaml")[0]
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    (port,) = container["ports"]
    return int(port["hostPort"])


def overlay(directory: Path, components: list[Path], extra: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    resources = [os.path.relpath(REPO / "deploy", directory)]
    listed = [os.path.relpath(c, directory) for c in components]
    text = f"resources: {json.dumps(resources)}\ncomponents: {json.dumps(listed)}\n{extra}"
    (directory / "kustomization.yaml").write_text(text)
    return directory


def agent_ports(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    daemonset = by_kind(docs, "DaemonSet")
    (agent,) = [c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "agent"]
    return agent["ports"]


# The override docs/preflight.md shows for another host port.
PORT_OVERRIDE = """patches:
  - patch: |-
      apiVersion: apps/v1
      kind: DaemonSet
      metadata: {name: node-health, namespace: node-health}
      spec:
        template:
          spec:
            containers:
              - name: agent
                ports:
                  - {containerPort: 9100, hostPort: 9200, protocol: TCP}
"""


@pytest.mark.system
def test_host_port_component_serves_the_agent_on_the_node_address(tmp_path: Path) -> None:
    assert all("hostPort" not in port for port in agent_ports(rendered(REPO / "deploy"))), "opt-in only"
    docs = rendered(overlay(tmp_path / "host-port", [HOST_PORT_COMPONENT]))
    port, *others = agent_ports(docs)
    assert (port["name"], port["containerPort"], port["hostPort"], port["protocol"]) == ("http", 9100, 9123, "TCP")
    assert [o["name"] for o in others] == ["metrics", "health"]
    assert all("hostPort" not in o for o in others), "only the pre-flight port on the node's IP"
    assert port["hostPort"] != 9100, "node-exporter holds host port 9100 on most nodes"
    daemonset = by_kind(docs, "DaemonSet")
    assert "maxSurge" not in daemonset["spec"]["updateStrategy"].get("rollingUpdate", {}), "two pods, one port"
    for version in VERSIONS:
        kubernetes_validate.validate(daemonset, version, strict=True)
    # The Service still reaches the same port by name.
    service = by_kind(docs, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    docs_page = (REPO / "docs" / "preflight.md").read_text()
    assert "deploy/components/host-port" in docs_page and str(port["hostPort"]) in docs_page


@pytest.mark.system
def test_host_port_is_changed_by_a_patch_after_the_component(tmp_path: Path) -> None:
    docs = rendered(overlay(tmp_path / "other-port", [HOST_PORT_COMPONENT], PORT_OVERRIDE))
    port, *_others = agent_ports(docs)
    assert (port["containerPort"], port["hostPort"]) == (9100, 9200)
    assert PORT_OVERRIDE in (REPO / "docs" / "preflight.md").read_text()
