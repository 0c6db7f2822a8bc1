"""The agent's memory under a burst of pipelined requests from every connection a cluster's pods may hold.

A real `node-health run --no-kube` process; 40 peer addresses x 64 connections (the per-peer cap), each
sending one burst of pipelined /metrics requests (the largest answer) and never reading. Before input was
bounded by the transport's read size, asyncio read up to 256 KiB per connection at once and kept it: this
attack took the agent from 45 to 363 MiB, past its 256 MiB limit. The agent's RSS is sampled throughout.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml
from support.processes import free_port, stop
from support.system import REPO, require

pytestmark = pytest.mark.system

PEERS, PER_PEER = 40, 64
BURST = 256 * 1024  # what one connection sends before it stops, never reading
RSS_LIMIT_MIB = 128
MIB = 1024 * 1024


def status_of(port: int, path: str, source: str) -> int:
    """One request from an address of its own, as kubelet's probe comes (a fresh connection, 5 s timeout)."""
    try:
        with contextlib.closing(socket.create_connection(("127.0.0.1", port), 5, (source, 0))) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n".encode())
            head = sock.recv(64)
        return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
    except OSError:
        return 0


def raise_fd_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def test_a_burst_of_pipelined_requests_on_every_connection_keeps_rss_under_128_mib(tmp_path: Path) -> None:
    raise_fd_limit()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    require(soft == resource.RLIM_INFINITY or soft >= PEERS * PER_PEER + 512, "RLIMIT_NOFILE >= 3072")
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"http": {"address": "127.0.0.1", "port": port}}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", "--no-kube", "--config", str(config)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=raise_fd_limit,  # as in the DaemonSet's container: the fd limit is no bound here
    )
    socks: list[socket.socket] = []
    samples: list[float] = []
    healthz: list[int] = []
    finished = threading.Event()
    try:
        deadline = time.monotonic() + 60
        while status_of(port, "/healthz", "127.0.4.1") == 0:
            assert proc.poll() is None and time.monotonic() < deadline, "the agent did not serve"
            time.sleep(0.2)
        agent = psutil.Process(proc.pid)
        baseline = agent.memory_info().rss / MIB

        def sample() -> None:
            while not finished.wait(0.1):
                with contextlib.suppress(psutil.Error):
                    samples.append(agent.memory_info().rss / MIB)

        def probe() -> None:
            while not finished.wait(0.5):
                healthz.append(status_of(port, "/healthz", "127.0.4.2"))

        threads = [threading.Thread(target=sample, daemon=True), threading.Thread(target=probe, daemon=True)]
        for thread in threads:
            thread.start()
        burst = b"GET /metrics HTTP/1.1\r\nHost: agent\r\n\r\n" * (BURST // 38)
        for peer in range(PEERS):
            for _ in range(PER_PEER):
                sock = socket.socket()
                sock.setblocking(False)
                sock.bind((f"127.0.3.{peer + 1}", 0))
                with contextlib.suppress(BlockingIOError):
                    sock.connect(("127.0.0.1", port))
                socks.append(sock)
        time.sleep(1.0)  # handshakes done (the listen backlog holds the rest)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.send(burst)  # what fits: the rest stays in this process
        time.sleep(8.0)
        finished.set()
        for thread in threads:
            thread.join(5)
        peak = max(samples)
        print(f"agent RSS: {baseline:.1f} MiB before, {peak:.1f} MiB peak under the burst ({len(samples)} samples)")
        assert proc.poll() is None, "the agent died"
        assert peak < RSS_LIMIT_MIB, f"RSS peaked at {peak:.1f} MiB (was {baseline:.1f} MiB)"
        assert healthz and all(code == 200 for code in healthz), healthz
    finally:
        finished.set()
        for sock in socks:
            sock.close()
        stop(proc)


def test_the_sum_in_the_docs_fits_the_memory_limit() -> None:
    """docs/http.md adds up the worst case from the code's limits; it must fit the DaemonSet's limit with room."""
    from agent.http.limits import MAX_CONNECTIONS, Limits, health_limits, worst_case_bytes

    limit = 256 * MIB
    # The ceilings, the health port's pool included.
    worst = worst_case_bytes(Limits(max_connections=MAX_CONNECTIONS, backlog=1024), health=health_limits())
    text = (REPO / "docs" / "http.md").read_text()
    assert f"{worst / MIB:.0f} MiB" in text
    assert worst < limit / 2, f"{worst / MIB:.0f} MiB of a {limit / MIB:.0f} MiB limit"
