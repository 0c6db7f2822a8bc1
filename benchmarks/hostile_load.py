"""/ready and /healthz for legitimate clients while the agent's port is attacked, against the same legitimate
load with no attack (the baseline) in the same run.

    python benchmarks/hostile_load.py [--duration 10]

For each scenario a fresh `node-health run --no-kube` (default probes) is started, an attacker process runs
one attack from extra loopback addresses (127.0.0.2...: other peers to the agent), and this process measures
meanwhile, from two more addresses of their own (as a job's pre-flight and kubelet come from other
addresses than the agent's):
  - /ready: back to back, each on a fresh connection with a 5 s timeout (p50, p99, max, failures);
  - /healthz: every 0.2 s, fresh connection, 5 s timeout (kubelet's timeoutSeconds): the share answered 200;
  - the agent's connections (/status http.connections) and RSS, sampled every 0.5 s: the peaks; and the
    latency of the first /ready after the attacker left.
Attacks: connections (hold as many as possible), pipeline-metrics (500 connections pipelining /metrics and
never reading), slowloris (1000 connections trickling a header line every 5 s), long-polls (wait= requests
that disconnect), selectors (checks= with one selector repeated 2000 times, pipelined), control-bytes (404s
with control bytes in the path, pipelined). Prints a table; writes benchmarks/results/hostile_load.json.
The attacker shares the machine's cores with the agent, as a hostile pod on the node would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = ("baseline", "connections", "pipeline-metrics", "slowloris", "long-polls", "selectors", "control-bytes")
TCP_CLOSE, TCP_CLOSE_WAIT = 7, 8  # include/net/tcp_states.h
READY_SOURCE = "127.0.0.200"
HEALTHZ_SOURCE = "127.0.0.201"


# --- the attacker (runs in its own process: --attack NAME) --------------------------------------------


class Attacker:
    def __init__(self, port: int, deadline: float) -> None:
        self.port = port
        self.deadline = deadline
        self.selector = selectors.DefaultSelector()
        self.socks: set[socket.socket] = set()

    def open(self, source: str, first: bytes) -> socket.socket | None:
        sock = socket.socket()
        try:
            sock.bind((source, 0))
            sock.connect(("127.0.0.1", self.port))
        except OSError:
            sock.close()
            return None
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.send(first)
        self.socks.add(sock)
        return sock

    def drop(self, sock: socket.socket) -> None:
        self.socks.discard(sock)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(sock)
        sock.close()

    def closed(self, sock: socket.socket, read: bool) -> bool:
        """True when the agent closed it. read=False: the answers stay unread, and only a reset shows."""
        try:
            if not read:  # TCP_INFO's first byte is the state: closed, or closed by the agent (CLOSE_WAIT)
                return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] in (TCP_CLOSE, TCP_CLOSE_WAIT)
            while chunk := sock.recv(65536):
                del chunk
            return True
        except BlockingIOError:
            return False
        except OSError:
            return True

    def hold(
        self, count: int, peers: int, first: bytes, every: float = 1.0, trickle: bytes = b"", read: bool = True
    ) -> None:
        """Keep `count` connections open from `peers` addresses, reopening the ones the agent closes."""
        while time.monotonic() < self.deadline:
            for sock in list(self.socks):
                if self.closed(sock, read):
                    self.drop(sock)
                elif trickle:
                    with contextlib.suppress(OSError):
                        sock.send(trickle)
            index = 0
            while len(self.socks) < count and time.monotonic() < self.deadline and index < count:
                self.open(f"127.0.0.{2 + index % peers}", first)
                index += 1
            time.sleep(every)

    def churn(self, concurrent: int, request: bytes, hold_for: float) -> None:
        """Open requests and walk away from them: connect, send, close after hold_for seconds."""
        opened: list[tuple[float, socket.socket]] = []
        index = 0
        while time.monotonic() < self.deadline:
            now = time.monotonic()
            while opened and now - opened[0][0] > hold_for:
                self.drop(opened.pop(0)[1])
            while len(opened) < concurrent:
                sock = self.open(f"127.0.0.{2 + index % 20}", request)
                index += 1
                if sock is not None:
                    opened.append((time.monotonic(), sock))
            time.sleep(0.01)

    def pipeline_reading(self, connections: int, request: bytes, batch: int) -> None:
        """Pipeline `batch` requests per connection, read the answers, repeat (a CPU attack)."""
        unsent: dict[socket.socket, bytes] = {}
        for index in range(connections):
            sock = self.open(f"127.0.0.{2 + index % 10}", b"")
            if sock is not None:
                self.selector.register(sock, selectors.EVENT_READ)
                unsent[sock] = request * batch
        while time.monotonic() < self.deadline:
            for sock, data in list(unsent.items()):
                if not data:
                    unsent[sock] = data = request * batch
                try:
                    unsent[sock] = data[sock.send(data) :]
                except BlockingIOError:
                    pass
                except OSError:
                    del unsent[sock]
                    self.drop(sock)
            for key, _ in self.selector.select(0.05):
                readable = key.fileobj
                assert isinstance(readable, socket.socket)
                if self.closed(readable, read=True):
                    unsent.pop(readable, None)
                    self.drop(readable)


def attack(name: str, port: int, duration: float) -> None:
    attacker = Attacker(port, time.monotonic() + duration)
    ready = b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n"
    if name == "connections":
        attacker.hold(4000, 40, b"")
    elif name == "pipeline-metrics":
        attacker.hold(500, 10, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 1800, read=False)
    elif name == "slowloris":
        attacker.hold(1000, 20, b"GET /ready HTTP/1.1\r\n", every=5.0, trickle=b"X-Slow: 1\r\n")
    elif name == "long-polls":
        attacker.churn(300, b"GET /ready?wait=300&min_host_mem_mib=999999999 HTTP/1.1\r\n\r\n", 0.2)
    elif name == "selectors":
        selector = ("GET /ready?checks=" + ",".join(["storage"] * 2000) + " HTTP/1.1\r\n\r\n").encode()
        attacker.pipeline_reading(20, selector, 3)
    elif name == "control-bytes":
        attacker.pipeline_reading(20, b"GET /%00%1b[31m\x01\x7f" + b"x" * 200 + b" HTTP/1.1\r\n\r\n" + ready, 20)
    for sock in list(attacker.socks):
        attacker.drop(sock)


# --- the legitimate clients and the agent --------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def request(port: int, path: str, source: str, timeout: float = 5.0) -> tuple[int, float]:
    """One request on a fresh connection: (status or 0 on failure, seconds)."""
    started = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0)) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
    except OSError:
        return 0, time.perf_counter() - started
    try:
        status = int(data.split(b" ", 2)[1])
    except (IndexError, ValueError):
        status = 0
    return status, time.perf_counter() - started


def repeat(until: float, action: Callable[[], None], pause: float = 0.0) -> threading.Thread:
    def loop() -> None:
        while time.monotonic() < until:
            action()
            if pause:
                time.sleep(pause)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def rss_mib(pid: int) -> float:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def start_agent(port: int, config_dir: str) -> subprocess.Popen[bytes]:
    config = Path(config_dir) / "config.yaml"
    config.write_text(f"http:\n  address: 127.0.0.1\n  port: {port}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", "--no-kube", "--config", str(config)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while request(port, "/healthz", READY_SOURCE, 2.0)[0] == 0:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            proc.wait()
            raise RuntimeError("the agent did not start")
        time.sleep(0.2)
    time.sleep(3.0)  # first probe runs
    return proc


def connections_of(port: int) -> int:
    with contextlib.suppress(OSError, ValueError, KeyError):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /status HTTP/1.1\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := sock.recv(1 << 20):
                data += chunk
        return int(json.loads(data.partition(b"\r\n\r\n")[2])["http"]["connections"])
    return -1


def measure(scenario: str, duration: float, config_dir: str) -> dict[str, float]:
    port = free_port()
    agent = start_agent(port, config_dir)
    attacker = None
    try:
        if scenario != "baseline":
            argv = [
                sys.executable,
                __file__,
                "--attack",
                scenario,
                "--port",
                str(port),
                "--duration",
                str(duration + 2),
            ]
            attacker = subprocess.Popen(argv, cwd=REPO)
            time.sleep(1.5)  # let the attack build up
        ready: list[tuple[int, float]] = []
        healthz: list[int] = []
        connections: list[int] = []
        rss: list[float] = []
        until = time.monotonic() + duration

        def sample() -> None:
            connections.append(connections_of(port))
            rss.append(rss_mib(agent.pid))

        threads = [
            repeat(until, lambda: ready.append(request(port, "/ready", READY_SOURCE))),
            repeat(until, lambda: healthz.append(request(port, "/healthz", HEALTHZ_SOURCE)[0]), 0.2),
            repeat(until, sample, 0.5),
        ]
        for thread in threads:
            thread.join(duration + 10)
        if attacker is not None:
            attacker.wait(30)
        after = request(port, "/ready", READY_SOURCE)
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(10)
        except subprocess.TimeoutExpired:
            agent.kill()
    latencies = sorted(seconds * 1000 for status, seconds in ready if status in (200, 503))
    return {
        "ready_requests": len(ready),
        "ready_failures": sum(1 for status, _ in ready if status not in (200, 503)),
        "ready_p50_ms": statistics.median(latencies) if latencies else float("nan"),
        "ready_p99_ms": latencies[int(len(latencies) * 0.99) - 1] if latencies else float("nan"),
        "ready_max_ms": latencies[-1] if latencies else float("nan"),
        "healthz_ok_percent": 100.0 * sum(1 for status in healthz if status == 200) / max(1, len(healthz)),
        "agent_connections_peak": max(connections, default=-1),
        "agent_rss_mib_peak": round(max(rss, default=0.0), 1),
        "first_ready_after_ms": after[1] * 1000 if after[0] in (200, 503) else float("nan"),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "hostile_load.json"))
    parser.add_argument("--attack", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attack:
        attack(args.attack, args.port, args.duration)
        return 0
    print(f"{args.duration:g} s per scenario on {os.cpu_count()} cores; legit /ready and /healthz on fresh connections")
    header = (
        f"{'scenario':17s} {'/ready n':>8s} {'fail':>5s} {'p50 ms':>7s} {'p99 ms':>7s} {'max ms':>7s} "
        f"{'healthz ok':>10s} {'conns':>6s} {'RSS MiB':>7s} {'after ms':>8s}  (conns, RSS: peaks)"
    )
    print(header)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as config_dir:
        for scenario in args.scenarios.split(","):
            row = measure(scenario, args.duration, config_dir)
            results[scenario] = row
            print(
                f"{scenario:17s} {row['ready_requests']:8.0f} {row['ready_failures']:5.0f} {row['ready_p50_ms']:7.2f} "
                f"{row['ready_p99_ms']:7.2f} {row['ready_max_ms']:7.1f} {row['healthz_ok_percent']:9.1f}% "
                f"{row['agent_connections_peak']:6.0f} {row['agent_rss_mib_peak']:7.1f} "
                f"{row['first_ready_after_ms']:8.2f}",
                flush=True,
            )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
