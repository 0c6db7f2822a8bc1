"""Processes the tests and benchmarks start: a free port on 127.0.0.1 for a server, a server started and waited
for, and a process stopped for sure (terminated, killed when it will not go)."""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

# Ports handed out in this process: a server not yet started still owns its pick.
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now, below the kernel's ephemeral range: a port the kernel picks
    for bind(0) is one it also gives any client's connect() as a source port, so between this pick and the
    server's bind a test's own HTTP or API client could take it (EADDRINUSE, seen in CI). Never the same port
    twice in one process."""
    low = _ephemeral_low()
    first, last = 20000, low - 1
    if last - first < 1000:  # a host with a wide ephemeral range: the kernel's pick is all there is
        first, last = 0, -1
    for _ in range(200):
        port = random.randint(first, last) if last > first else 0
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no free TCP port on 127.0.0.1")


def answers_200(url: str) -> bool:
    """A GET of `url` answered 200 (a server's readiness endpoint); False on any error."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status) == 200
    except OSError:
        return False


def stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str], seconds: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `seconds`; reaped either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def serving(argv: list[str], ready: Callable[[], bool], log: Path, what: str) -> Iterator[subprocess.Popen[bytes]]:
    """A server started (stderr into `log`) and polled with `ready` for up to 30 s, stopped on the way out. Its
    exit before it is ready fails with the log; so does a server never ready."""
    with log.open("w") as errors:
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errors)
    try:
        deadline = time.monotonic() + 30
        while not ready():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"{what} did not become ready"
            time.sleep(0.2)
        yield process
    finally:
        stop(process)
