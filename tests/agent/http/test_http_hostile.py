"""The agent's port under hostile load: each attack reproduced on raw sockets against the real server.

The agent's port is reachable by every pod of the cluster. Each test runs one attack for real (hundreds of
connections, pipelining without reading, slowloris, long-polls that disconnect, repeated selectors) from
extra loopback addresses (127.0.0.2...: each a different peer to the server), and asserts the bound: the
connections are closed, the server's connections, tasks and unsent bytes go back down, and a legitimate
client (the node itself on 127.0.0.1, or a fresh peer) is answered meanwhile. Deadlines are generous
correctness bounds, not performance measurements (benchmarks/hostile_load.py measures).
"""

from __future__ import annotations

import contextlib
import http.client
import resource
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from support.system import require

from agent.http.routes import MAX_LONG_POLLS, HttpServer
from agent.http.server import Limits
from agent.metrics import MetricsRenderer
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes.base import Finding, Sample, Status

pytestmark = pytest.mark.system

DEFAULTS = Limits()


def require_fds(count: int) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    require(soft == resource.RLIM_INFINITY or soft >= count, f"RLIMIT_NOFILE >= {count}")


@dataclass
class Served:
    server: HttpServer
    state: HealthState
    renderer: MetricsRenderer

    @property
    def port(self) -> int:
        return self.server.port

    def stats(self) -> dict[str, int]:
        return self.server.stats_from_thread()


def serve(limits: Limits | None = None, ready: bool = True, samples: int = 0) -> Served:
    state = HealthState("node-a", HealthSettings(fail_threshold=1, recovery_threshold=1))
    state.configure([ProbeSpec("storage", ("storage.space",), 60.0, 5.0)])
    status = Status.OK if ready else Status.FAIL
    exported = [Sample("nodehealth_test_series", "A series.", float(i), {"i": str(i)}) for i in range(samples)]
    state.record("storage", [Finding("storage.space", "/data", status, "OK" if ready else "DiskFull", "x")], exported)
    renderer = MetricsRenderer(state.current)
    server = HttpServer(
        state,
        renderer.render,
        lambda: (True, {"problems": []}),
        lambda: ("storage.space",),
        address="127.0.0.1",
        port=0,
        limits=limits,
    )
    server.start()
    return Served(server, state, renderer)


@contextlib.contextmanager
def served(limits: Limits | None = None, ready: bool = True, samples: int = 0) -> Iterator[Served]:
    running = serve(limits, ready, samples)
    try:
        yield running
    finally:
        running.server.stop()


def connect(port: int, source: str, timeout: float = 10.0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def legit(port: int, path: str = "/ready", source: str = "127.0.0.1") -> int:
    """One request as kubelet or a job's pre-flight sends it: a fresh connection, a 5 s timeout."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=(source, 0))
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def read_until_closed(sock: socket.socket, seconds: float = 20.0) -> bytes:
    sock.settimeout(seconds)
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def wait_until(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds:g}s: {what}"
        time.sleep(0.05)


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()
    socks.clear()


def test_one_peer_cannot_take_the_connections_of_others() -> None:
    require_fds(1024)
    with served() as running:
        attacker: list[socket.socket] = [connect(running.port, "127.0.0.2") for _ in range(200)]
        wait_until(lambda: running.stats()["refused_total"] >= 200 - DEFAULTS.max_per_peer, 10, "refusals")
        assert running.stats()["connections"] == DEFAULTS.max_per_peer
        answers = [sock.recv(4096) for sock in attacker[DEFAULTS.max_per_peer :]]
        assert all(answer.startswith(b"HTTP/1.1 503 ") for answer in answers)
        assert b"too many connections from 127.0.0.2 (at most 64)" in answers[0]
        # Another pod and the node itself are answered.
        assert legit(running.port, source="127.0.0.3") == 200
        assert legit(running.port, "/healthz") == 200
        close_all(attacker)
        wait_until(lambda: running.stats()["connections"] == 0, 10, "connections closed")
        assert running.stats()["peers"] == 0


def test_the_global_cap_keeps_slots_for_new_peers_and_the_node_itself() -> None:
    limits = Limits(max_connections=40, max_per_peer=64, new_peer_reserve=8, local_reserve=4)
    with served(limits) as running:
        socks = [connect(running.port, "127.0.0.2") for _ in range(50)]
        wait_until(lambda: running.stats()["refused_total"] == 18, 10, "refusals beyond the reserve")
        assert running.stats()["connections"] == 32  # the last 8 slots are kept for peers without one
        for peer in range(3, 11):  # eight other pods: one slot each from the reserve, not two
            socks += [connect(running.port, f"127.0.0.{peer}") for _ in range(2)]
        wait_until(lambda: running.stats()["refused_total"] == 18 + 8, 10, "one slot per new peer")
        assert running.stats()["connections"] == 40
        late = connect(running.port, "127.0.0.11")
        assert late.recv(4096).startswith(b"HTTP/1.1 503 ")
        late.close()
        # The node itself (a client connecting from the address it connects to) still gets in...
        assert legit(running.port, "/healthz") == 200
        assert legit(running.port) == 200
        # ...up to its own reserve beyond the cap.
        local = [connect(running.port, "127.0.0.1") for _ in range(5)]
        wait_until(lambda: running.stats()["refused_total"] == 18 + 8 + 2, 10, "the local reserve is bounded")
        assert local[-1].recv(4096).startswith(b"HTTP/1.1 503 ")
        assert running.stats()["connections"] == 40 + 4
        socks += local
        close_all(socks)
        wait_until(lambda: running.stats()["connections"] == 0, 10, "connections closed")
        assert legit(running.port, source="127.0.0.11") == 200


def test_pipelining_metrics_without_reading_neither_stalls_others_nor_renders_per_request() -> None:
    require_fds(2048)
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    with served(samples=1500) as running:
        renders_before = running.renderer.renders
        attackers: list[socket.socket] = []
        for peer in range(2, 12):  # 500 connections: 50 from each of ten addresses
            for _ in range(50):
                sock = connect(running.port, f"127.0.0.{peer}")
                sock.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    sock.send(request * 1800)  # ~64 KiB of pipelined requests, never reading an answer
                attackers.append(sock)
        started = time.monotonic()
        wait_until(lambda: running.stats()["connections"] == 500, 20, "all attackers connected")
        for _ in range(5):
            assert legit(running.port) == 200
            assert legit(running.port, "/healthz") == 200
            time.sleep(0.2)
        stats = running.stats()
        # One render per snapshot and second, not one per request.
        assert running.renderer.renders - renders_before <= 2 + (time.monotonic() - started) / 0.9
        # Unsent answers are bounded per connection: one answer (the next is written once it has left).
        body = len(running.renderer.render())
        assert 0 < stats["unsent_bytes"] <= 500 * body
        # Answers left unread past the send timeout: the connections are dropped though the attacker stays.
        wait_until(lambda: running.stats()["connections"] == 0, DEFAULTS.send_timeout + 10, "stalled dropped")
        assert running.stats()["unsent_bytes"] == 0
        close_all(attackers)
        assert legit(running.port) == 200
        assert legit(running.port, "/metrics") == 200


def test_an_attacker_leaving_frees_everything_at_once() -> None:
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    with served(samples=1500) as running:
        attackers = [connect(running.port, f"127.0.0.{2 + i % 5}") for i in range(200)]
        for sock in attackers:
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.send(request * 1800)
        wait_until(lambda: running.stats()["unsent_bytes"] > 0, 20, "answers piling up unread")
        close_all(attackers)
        wait_until(lambda: running.stats()["connections"] == 0, 5, "connections gone with the attacker")
        assert legit(running.port) == 200
        assert legit(running.port, "/healthz") == 200


def test_slowloris_heads_are_cut_at_the_head_deadline() -> None:
    with served() as running:
        trickling = [connect(running.port, f"127.0.0.{2 + i % 4}") for i in range(100)]
        silent = [connect(running.port, "127.0.0.6") for _ in range(20)]  # connect and send nothing
        for sock in trickling:
            sock.sendall(b"GET /ready HTTP/1.1\r\n")
        started = time.monotonic()
        cut: set[int] = set()
        while len(cut) < len(trickling) and time.monotonic() - started < DEFAULTS.head_timeout + 10:
            assert legit(running.port) == 200
            for index, sock in enumerate(trickling):
                if index in cut or _has_answer(sock):
                    cut.add(index)
                else:
                    sock.sendall(b"X-Slow: 1\r\n")  # a header line a second: the head never ends
            time.sleep(1.0)
        for sock in trickling + silent:
            answer = read_until_closed(sock, 5.0)
            assert answer.startswith(b"HTTP/1.1 408 ") and b"request head not complete within 10s" in answer
        assert time.monotonic() - started < DEFAULTS.head_timeout + 10
        wait_until(lambda: running.stats()["connections"] == 0, 5, "slow connections closed")
        close_all(trickling + silent)


def test_disconnecting_long_polls_are_cancelled_and_capped() -> None:
    require_fds(1024)
    with served(ready=False) as running:
        baseline_tasks = running.stats()["tasks"]
        waiting = [connect(running.port, f"127.0.0.{2 + i % 6}") for i in range(MAX_LONG_POLLS + 40)]
        for sock in waiting:
            sock.sendall(b"GET /ready?wait=300 HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_until(lambda: running.stats()["long_polls"] == MAX_LONG_POLLS, 20, "long-polls waiting")
        stats = running.stats()
        assert stats["connections"] == MAX_LONG_POLLS + 40  # waiting or not, each counts as a connection
        assert stats["tasks"] <= baseline_tasks + MAX_LONG_POLLS
        refused = [sock for sock in waiting if _has_answer(sock)]
        assert len(refused) == 40
        assert all(sock.recv(4096).startswith(b"HTTP/1.1 429 ") for sock in refused)
        assert legit(running.port) == 503  # the node is not ready, and says so at once
        close_all(waiting)
        wait_until(lambda: running.stats()["long_polls"] == 0, 5, "long-polls cancelled")
        wait_until(lambda: running.stats()["tasks"] <= baseline_tasks, 5, "their tasks gone")
        wait_until(lambda: running.stats()["connections"] == 0, 5, "their connections gone")


def _has_answer(sock: socket.socket) -> bool:
    timeout = sock.gettimeout()
    sock.settimeout(0.0)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return False
    finally:
        sock.settimeout(timeout)


def test_repeated_selectors_and_parameter_floods_are_refused_cheaply() -> None:
    selectors = "/ready?checks=" + ",".join(["storage"] * 2000)
    fields = "/ready?" + "&".join(["checks=storage"] * 1000)
    with served() as running:
        socks = [connect(running.port, f"127.0.0.{2 + i % 4}") for i in range(40)]
        for sock in socks:
            sock.sendall((f"GET {selectors} HTTP/1.1\r\n\r\nGET {fields} HTTP/1.1\r\n\r\n").encode() * 50)
        assert legit(running.port) == 200
        assert legit(running.port, "/ready?checks=storage,storage,storage") == 200
        for sock in socks:
            answers = b""
            while answers.count(b"HTTP/1.1 ") < 100:
                answers += sock.recv(65536)
            assert answers.count(b"HTTP/1.1 400 Bad Request") == 100
            assert answers.count(b'{"error": "at most 16 query parameters"}') == 50
            assert answers.count(b'{"error": "checks: at most 32 different names, 128 in all"}') == 50
        close_all(socks)
        wait_until(lambda: running.stats()["connections"] == 0, 5, "connections closed")


def test_idle_keep_alive_connections_are_closed() -> None:
    with served(Limits(idle_timeout=1.0)) as running:
        sock = connect(running.port, "127.0.0.2")
        sock.sendall(b"GET /ready HTTP/1.1\r\n\r\n")
        answer = read_until_closed(sock, 10.0)  # answered, then closed once idle past the timeout
        assert answer.startswith(b"HTTP/1.1 200 OK") and answer.count(b"HTTP/1.1") == 1
        wait_until(lambda: running.stats()["connections"] == 0, 5, "idle connection closed")
        sock.close()


def test_a_closed_connection_whose_answer_cannot_be_delivered_is_dropped_after_the_linger() -> None:
    with served(samples=10000) as running:
        assert len(running.renderer.render()) > 4 * DEFAULTS.send_buffer  # more than the kernel buffers hold
        sock = connect(running.port, "127.0.0.2")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and a client that reads nothing
        sock.sendall(b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
        wait_until(lambda: running.stats()["unsent_bytes"] > 0, 10, "the answer stuck unsent")
        started = time.monotonic()
        wait_until(lambda: running.stats()["connections"] == 0, 20, "the connection dropped")
        # Closed after its answer, so the linger drops it, well before the send timeout would.
        assert time.monotonic() - started < DEFAULTS.send_timeout
        sock.close()
