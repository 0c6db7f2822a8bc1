"""The health port (http.health_port): /healthz and /started alone, on a pool of its own with slots that only the
node's own addresses can take, on the real server from loopback addresses (each a peer of its own); and how the
node's addresses are found (agent/http/addresses.py), from /proc/net files as the kernel writes them. The same with
pods' addresses in network namespaces: test_http_probes_starved.py."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from agent.config import ConfigError, parse_config
from agent.http import addresses
from agent.http.addresses import NodeAddresses, canonical, from_environment, local_ipv4, local_ipv6
from agent.http.limits import HEALTH_CONNECTIONS, HEALTH_NODE_RESERVE, health_limits
from agent.http.routes import HttpServer
from agent.http.server import Limits
from agent.metrics import MetricsRenderer
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes.base import Finding, Status

NODE = "127.0.0.2"  # the node's address here (NODE_IP); pods are 127.0.1.x

# /proc/net/fib_trie of a node whose kubelet probes pods from flannel's cni0 (10.244.3.1): the kernel's layout,
# the Main and Local tables (trimmed to the entries that matter).
FIB_TRIE = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 10.0.0.0/8 2 0 2
        +-- 10.0.0.0/24 2 0 2
           |-- 10.0.0.0
              /24 link UNICAST
           |-- 10.0.0.17
              /32 host LOCAL
        +-- 10.244.3.0/24 2 0 2
           |-- 10.244.3.0
              /24 link UNICAST
           |-- 10.244.3.1
              /32 host LOCAL
           |-- 10.244.3.255
              /32 link BROADCAST
     +-- 127.0.0.0/8 2 0 2
        +-- 127.0.0.0/31 1 0 0
           |-- 127.0.0.0
              /8 host LOCAL
           |-- 127.0.0.1
              /32 host LOCAL
Local:
  +-- 0.0.0.0/0 3 0 5
     |-- 10.0.0.17
        /32 host LOCAL
"""
IF_INET6 = """00000000000000000000000000000001 01 80 10 80       lo
fe8000000000000000fc00fffe000001 04 40 20 80     eth0
fd000000000000000000000000000011 04 40 00 82     eth0
"""


def test_the_node_addresses_are_the_host_namespaces_own_and_the_downward_apis(tmp_path: Path) -> None:
    assert local_ipv4(FIB_TRIE) == {"10.0.0.17", "10.244.3.1"}  # no loopback, no broadcast, no route
    assert local_ipv6(IF_INET6) == {"fe80::fc:ff:fe00:1", "fd00::11"}
    assert from_environment({"NODE_IP": "10.0.0.17", "NODE_IPS": "10.0.0.17,fd00::11, bogus"}) == {
        "10.0.0.17",
        "fd00::11",
    }
    assert canonical("::ffff:10.0.0.17") == "10.0.0.17" and canonical("FD00:0::11") == "fd00::11"
    (tmp_path / "1" / "net").mkdir(parents=True)
    (tmp_path / "1" / "net" / "fib_trie").write_text(FIB_TRIE)
    (tmp_path / "1" / "net" / "if_inet6").write_text(IF_INET6)
    node = NodeAddresses(str(tmp_path), {"NODE_IP": "192.0.2.9"})
    assert node.refresh() == {"10.0.0.17", "10.244.3.1", "fe80::fc:ff:fe00:1", "fd00::11", "192.0.2.9"}
    assert node.is_node("10.244.3.1") and node.is_node("::ffff:10.0.0.17") and not node.is_node("10.244.3.7")


def test_the_addresses_are_read_again_in_a_thread_and_a_file_gone_keeps_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = tmp_path / "1" / "net"
    net.mkdir(parents=True)
    (net / "fib_trie").write_text(FIB_TRIE)
    node = NodeAddresses(str(tmp_path), {})
    node.refresh()
    (net / "fib_trie").write_text(FIB_TRIE.replace("10.244.3.1\n", "10.244.9.1\n"))
    assert node.is_node("10.244.3.1"), "not read again before REFRESH_SECONDS"
    monkeypatch.setattr(addresses, "REFRESH_SECONDS", 0.0)
    deadline = time.monotonic() + 10
    while not node.is_node("10.244.9.1"):
        assert time.monotonic() < deadline, "never read again"
        time.sleep(0.05)
    assert not node.is_node("10.244.3.1")
    (net / "fib_trie").unlink()
    node.refresh()
    assert node.is_node("10.244.9.1"), "a file that cannot be read leaves what was read from it"


def test_the_health_port_config_key() -> None:
    assert parse_config({}).http.health_port == 9102
    assert parse_config({"http": {"health_port": 0}}).http.health_port == 0
    for bad in ({"port": 9300, "health_port": 9300}, {"metrics_port": 9301, "health_port": 9301}):
        with pytest.raises(ConfigError, match=r"http\.health_port"):
            parse_config({"http": bad})


@contextmanager
def serving(main_limits: Limits) -> Iterator[HttpServer]:
    state = HealthState("node-a", HealthSettings(fail_threshold=1, recovery_threshold=1))
    state.configure([ProbeSpec("storage", ("storage.space",), 60.0, 5.0)])
    state.record("storage", [Finding("storage.space", "/data", Status.OK, "OK", "40% used")])
    server = HttpServer(
        state,
        MetricsRenderer(state.current).render,
        lambda: (True, {"problems": []}),
        lambda: ("storage.space",),
        address="127.0.0.1",
        port=0,
        limits=main_limits,
        metrics_port=None,
        health_port=0,
        node_addresses=NodeAddresses("/nonexistent", {"NODE_IP": NODE}),
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def answer(port: int, path: str, source: str) -> tuple[int, str]:
    """One probe as the kubelet sends it: a connection of its own, Connection: close."""
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def hold(stack: ExitStack, port: int, source: str) -> str:
    """A keep-alive connection that had its answer (or what the server said instead)."""
    sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)))
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n")
    return sock.recv(65536).decode()


def test_pods_holding_both_pools_leave_the_node_its_slots() -> None:
    with serving(Limits(max_connections=8, new_peer_reserve=0, local_reserve=0)) as server, ExitStack() as stack:
        health = server.health_port
        assert health is not None and health != server.port
        assert {path: answer(health, path, NODE)[0] for path in ("/ready", "/healthz", "/started", "/status")} == {
            "/ready": 404,
            "/healthz": 200,
            "/started": 200,
            "/status": 404,
        }
        main_held = [hold(stack, server.port, "127.0.1.1") for _ in range(8)]
        assert all(a.startswith("HTTP/1.1 200") for a in main_held)
        assert "too many connections" in hold(stack, server.port, NODE), "the main port has no slot for the node"
        # Pods take every slot of the health port they can: 4 per address, then one per new address.
        pods = [f"127.0.1.{i}" for i in range(10, 60)]
        held = [a for pod in pods for a in (hold(stack, health, pod) for _ in range(4)) if a.startswith("HTTP/1.1 200")]
        assert len(held) == HEALTH_CONNECTIONS
        assert "too many connections" in hold(stack, health, "127.0.1.200")
        for _ in range(3):  # the kubelet's probes, one after another
            assert answer(health, "/healthz", NODE)[0] == 200
            assert answer(health, "/started", NODE)[0] == 200
        # The node's slots are its own and bounded too.
        node_held = [hold(stack, health, NODE) for _ in range(HEALTH_NODE_RESERVE)]
        assert all(a.startswith("HTTP/1.1 200") for a in node_held)
        assert "too many connections from the node's own addresses" in hold(stack, health, NODE)
        figures = server.stats_from_thread()
        assert figures["health_connections"] >= HEALTH_CONNECTIONS + HEALTH_NODE_RESERVE
        assert figures["node_connections"] == HEALTH_NODE_RESERVE
        assert {"port": health, "routes": ["/healthz", "/started"]} in server.listening()["ports"]  # /status http.ports


def test_the_health_pool_as_docs_http_md_states_it() -> None:
    text = (Path(__file__).resolve().parents[3] / "docs" / "http.md").read_text()
    pool = health_limits()
    stated = (
        f"{pool.max_connections} connections, at most {pool.max_per_peer} per peer, the last "
        f"{pool.new_peer_reserve} for peers holding none, {pool.local_reserve}\nmore for local clients, and "
        f"**{pool.node_reserve} that only the node's own addresses can take**"
    )
    assert stated in text
    assert f"with {pool.head_timeout:g} s\ndeadlines" in text and pool.head_timeout == pool.idle_timeout
    assert pool.send_timeout == pool.head_timeout and f"a listen backlog of {pool.backlog}" in text
