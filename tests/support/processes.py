"""Processes the tests and benchmarks start: a free port on 127.0.0.1 for a server, a server started and waited
for, and a process stopped for sure (terminated, killed when it will not go)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (the kernel's pick: tests running at once get others)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
