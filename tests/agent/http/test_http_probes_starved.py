"""The kubelet's probes are never starved by pods (issue 30 item 14): a real agent in a pod's network namespace,
pods' addresses in network namespaces of their own holding every slot of the main port and every slot of the
health port that pods can take (keep-alive connections, each having had its answer, kept busy), and a kubelet-like
client in the node's namespace, whose address only the host's /proc/1/net tells the agent (as flannel's cni0 is
the source of the kubelet's probes, not the InternalIP): it gets 200 on /healthz and /started at the health port,
probe after probe, while the main port refuses it.

Topology, all on one bridge (the "node" namespace's, so the machine's own firewall plays no part):

    node netns: br0 10.231.0.1/16 (the kubelet-like client)
      ├── agent netns: eth0 10.231.0.2/16 (node-health run; host.proc's "1" is a process in the node netns)
      └── pod netns 0..3: eth0 with 24 addresses each, 10.231.(10+i).(1..24)/16 (the holders)
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.netservers import Netns
from support.system import REPO, require_root

from agent.http.limits import HEALTH_CONNECTIONS, MAX_CONNECTIONS
from probes import all_probes

AGENT = "10.231.0.2"
MAIN, HEALTH = 9100, 9102
PODS, ADDRESSES_PER_POD = 4, 24

# Runs in a pod's namespace: from each of its addresses, opens keep-alive connections (each answered) to the main
# port until refused or 64, then to the health port until refused or 4; says how many it holds; then asks again on
# each every second (the health port drops a connection idle for 5 s) until its stdin closes.
HOLDER = r"""
import json, re, select, socket, sys
agent, addresses = sys.argv[1], json.loads(sys.argv[2])
REQUEST = b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n"
def ask(sock):
    sock.sendall(REQUEST)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split()[1])
def fill(port, most):
    held = []
    for address in addresses:
        for _ in range(most):
            sock = socket.create_connection((agent, port), timeout=20, source_address=(address, 0))
            try:
                status = ask(sock)
            except OSError:
                status = 0
            if status != 200:
                sock.close()
                break
            held.append(sock)
    return held
main = fill(int(sys.argv[3]), 64)
health = fill(int(sys.argv[4]), 4)
print(json.dumps({"main": len(main), "health": len(health)}), flush=True)
lost = 0
while not select.select([sys.stdin], [], [], 1.0)[0]:
    for sock in list(main + health):
        try:
            ok = ask(sock) == 200
        except OSError:
            ok = False
        if not ok:
            lost += 1
            (main if sock in main else health).remove(sock)
            sock.close()
print(json.dumps({"lost": lost}), flush=True)
"""

# Runs in the node's namespace, as the kubelet probes: a new connection per probe, `Connection: close`, the
# kubelet's timeoutSeconds (5).
KUBELET = r"""
import json, sys, time, urllib.error, urllib.request
agent, health, probes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def get(port, path):
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://{agent}:{port}{path}", timeout=5) as answer:
            status, body = answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        status, body = error.code, error.read().decode()
    except OSError as error:
        status, body = 0, repr(error)
    return {"path": path, "port": port, "status": status, "body": body[:200], "seconds": time.monotonic() - started}
out = {"probes": []}
for _ in range(probes):
    out["probes"] += [get(health, "/healthz"), get(health, "/started")]
    time.sleep(1.0)
print(json.dumps(out))
"""

# Runs in a pod's or the node's namespace: one more connection to each port, from the namespace's address (or the
# one given); what the server says on it before any request (a refusal is written at once, then the connection
# closed: a request sent meanwhile would turn the close into a reset).
ONE_MORE = r"""
import json, socket, sys
agent, address = sys.argv[1], sys.argv[2]
out = {}
for port in map(int, sys.argv[3:]):
    sock = socket.create_connection((agent, port), timeout=20, source_address=(address, 0) if address else None)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    out[port] = data.split(b"\r\n", 1)[0].decode() + " " + data.rsplit(b"\r\n", 1)[-1].decode()
print(json.dumps(out))
"""


def raise_fd_limit() -> None:
    """As in the DaemonSet (the runtime's fd limit is about a million): the main port's 1,024 slots need about 2,600
    (its listen queue and the health port's pool are part of the fd budget)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def link(node: Netns, other: Netns, name: str, addresses: list[str]) -> None:
    subprocess.run(
        ["ip", "link", "add", name, "netns", node.name, "type", "veth", "peer", "name", "eth0", "netns", other.name],
        check=True,
        capture_output=True,
        timeout=30,
    )
    node.ip("link", "set", name, "master", "br0", "up")
    for address in addresses:
        other.ip("addr", "add", f"{address}/16", "dev", "eth0")
    other.ip("link", "set", "eth0", "up")


def in_netns(netns: Netns, argv: list[str], **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(["ip", "netns", "exec", netns.name, *argv], text=True, **kw)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    require_root()
    spaces: list[Netns] = []
    processes: list[subprocess.Popen[str]] = []
    try:
        node, agent_ns = Netns("nhnode"), Netns("nhagent")
        spaces += [node, agent_ns]
        node.ip("link", "add", "br0", "type", "bridge")
        node.ip("addr", "add", "10.231.0.1/16", "dev", "br0")
        node.ip("link", "set", "br0", "up")
        link(node, agent_ns, "vagent", [AGENT])
        pods = []
        for i in range(PODS):
            pod = Netns(f"nhpod{i}_")
            spaces.append(pod)
            addresses = [f"10.231.{10 + i}.{j}" for j in range(1, ADDRESSES_PER_POD + 1)]
            link(node, pod, f"vpod{i}", addresses)
            pods.append((pod, addresses))
        # The agent reads the node's addresses from <host.proc>/1/net, as it reads the host's init's with hostPID:
        # here "1" is a process of the node namespace.
        anchor = in_netns(node, ["sleep", "3600"])
        processes.append(anchor)
        deadline = time.monotonic() + 30
        while os.readlink(f"/proc/{anchor.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            assert time.monotonic() < deadline, "ip netns exec did not enter the node namespace"
            time.sleep(0.05)
        proc = tmp_path / "proc"
        proc.mkdir()
        (proc / "1").symlink_to(f"/proc/{anchor.pid}")
        config = tmp_path / "config.yaml"
        probes = {name: {"enabled": False} for name in all_probes()}
        http = {"address": "0.0.0.0", "port": MAIN, "metrics_port": 0, "health_port": HEALTH}
        host = {"proc": str(proc)}
        config.write_text(
            yaml.safe_dump({"http": http, "kubernetes": {"enabled": False}, "probes": probes, "host": host})
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "NODE_IP"))}
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        argv = [sys.executable, "-m", "agent.cli", "run", "--no-kube", "--config", str(config)]
        log = (tmp_path / "agent.log").open("w")
        agent = in_netns(
            agent_ns, argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=raise_fd_limit
        )
        processes.append(agent)
        yield {
            "node": node,
            "agent_ns": agent_ns,
            "pods": pods,
            "agent": agent,
            "log": tmp_path / "agent.log",
            "processes": processes,
        }
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.kill()
            process.wait(10)
        for netns in spaces:
            netns.close()


def run_in(netns: Netns, code: str, *args: str, timeout: float = 120) -> Any:
    done = netns.exec([sys.executable, "-c", code, *args], timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_for_health(node: Netns, log: Path) -> None:
    code = (
        "import sys, time, urllib.request\n"
        "deadline = time.monotonic() + 60\n"
        "while True:\n"
        "    try:\n"
        f"        urllib.request.urlopen('http://{AGENT}:{HEALTH}/healthz', timeout=5).read(); break\n"
        "    except OSError:\n"
        "        if time.monotonic() > deadline: sys.exit(1)\n"
        "        time.sleep(0.2)\n"
    )
    done = node.exec([sys.executable, "-c", code], timeout=90)
    assert done.returncode == 0, "the agent's health port never answered:\n" + log.read_text()[-3000:]


@pytest.mark.system
def test_pods_holding_every_slot_never_starve_the_kubelets_probes(cluster: dict[str, Any]) -> None:
    node: Netns = cluster["node"]
    wait_for_health(node, cluster["log"])
    holders = []
    for pod, addresses in cluster["pods"]:
        argv = [sys.executable, "-c", HOLDER, AGENT, json.dumps(addresses), str(MAIN), str(HEALTH)]
        holder = in_netns(pod, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=raise_fd_limit)
        cluster["processes"].append(holder)
        holders.append(holder)
    held = {"main": 0, "health": 0}
    for holder in holders:
        assert holder.stdout is not None
        ready, _, _ = select.select([holder.stdout], [], [], 180)
        assert ready, "a holder did not fill its connections in 3 minutes"
        for key, count in json.loads(holder.stdout.readline()).items():
            held[key] += count
    # Every slot pods can take: the main port's whole pool, the health port's whole pool but the node's reserve.
    assert held == {"main": MAX_CONNECTIONS, "health": HEALTH_CONNECTIONS}, held

    pod, addresses = cluster["pods"][0]
    refused = run_in(pod, ONE_MORE, AGENT, addresses[0], str(MAIN), str(HEALTH))
    assert all(line.startswith("HTTP/1.1 503") and "too many connections" in line for line in refused.values()), refused

    # What made liveness fail: the main port has no slot for the node either.
    (main,) = run_in(node, ONE_MORE, AGENT, "", str(MAIN)).values()
    assert main.startswith("HTTP/1.1 503") and "too many connections" in main, main
    kubelet = run_in(node, KUBELET, AGENT, str(HEALTH), "10", timeout=300)
    # The health port answers every probe, each well within the kubelet's own 5 s timeout.
    answers = kubelet["probes"]
    assert len(answers) == 20 and all(a["status"] == 200 for a in answers), answers
    assert all(a["seconds"] < 5 for a in answers), [a["seconds"] for a in answers]

    # The pods still held everything meanwhile (each connection asked again every second, none lost).
    for holder in holders:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        ready, _, _ = select.select([holder.stdout], [], [], 60)
        assert ready and json.loads(holder.stdout.readline()) == {"lost": 0}
    assert cluster["agent"].poll() is None
