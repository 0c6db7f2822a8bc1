"""Reading the ledger from the agent: the reader child (`reader.py`) started in the background, its answer shared.

`ledger_source(socket, timeout).start()` begins a read at once (a probe starts it before its /proc scan and
tool calls, so the two overlap) and returns a handle; `handle.result(deadline)` waits for the answer, at most
until the read's own deadline or the caller's, whichever comes first. One read is in flight per socket at a
time, and a read that finished less than `MIN_SECONDS_BETWEEN_READS` ago is reused rather than repeated: the npu
and gpu probes running together make one read, and no probe makes more than one per run. A read is two calls
(List, GetAllocatableResources), so the agent stays far below the kubelet's rate limit (100 QPS, burst 10).

The outcome is a `LedgerRead`: ok (the ledger), skip (no socket: no kubelet here, or the directory is not
mounted) or unknown (the kubelet did not answer in time, answered UNAVAILABLE or RESOURCE_EXHAUSTED, or sent
something that is not a ledger). `last_read(socket)` is the latest outcome, for the agent to serve.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probes.runtime.host import run_command
from probes.runtime.podresources.ledger import Ledger, LedgerError, parse_ledger

READER = Path(__file__).resolve().parent / "reader.py"
MIN_SECONDS_BETWEEN_READS = 1.0
# The child's interpreter and imports (~0.1 s of CPU) before its first call; on a loaded node, more.
STARTUP_ALLOWANCE_SECONDS = 2.0
MAX_ANSWER_BYTES = 8 << 20


@dataclass(frozen=True)
class LedgerRead:
    """One attempt to read the ledger."""

    state: str  # "ok", "skip" (no socket), "unknown" (no usable answer)
    socket: str
    ledger: Ledger | None = None
    code: str = ""  # why not ok: MISSING, DISABLED, NOT_A_SOCKET, TIMEOUT, CONNECT, UNAVAILABLE, PARSE, ...
    why: str = ""
    read_at: float = 0.0  # wall clock, when the read began
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return self.state == "ok" and self.ledger is not None

    def observed(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ledger": self.state, "socket": self.socket, "read_seconds": round(self.duration, 3)}
        if self.read_at:
            out["read_at"] = round(self.read_at, 3)
        if self.code:
            out["ledger_error"] = {"code": self.code, "message": self.why}
        return out


def socket_state(path: str) -> LedgerRead | None:
    """Skip or unknown when there is no socket to ask; None when there is one."""
    if not path:
        return LedgerRead("skip", path, code="DISABLED", why="kubernetes.pod_resources_socket is empty")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        why = f"no kubelet PodResources socket at {path} (no kubelet on this host, or its directory not mounted)"
        return LedgerRead("skip", path, code="MISSING", why=why)
    except OSError as exc:
        return LedgerRead("unknown", path, code="NOT_A_SOCKET", why=f"{path}: {exc.strerror or exc}")
    if not stat.S_ISSOCK(mode):
        return LedgerRead("unknown", path, code="NOT_A_SOCKET", why=f"{path} is not a unix socket")
    return None


def read_once(path: str, timeout: float) -> LedgerRead:
    """One read in a child, blocking up to timeout + the child's start-up allowance."""
    began, wall = time.monotonic(), time.time()
    absent = socket_state(path)
    if absent is not None:
        return absent
    argv = [sys.executable, "-E", "-s", str(READER), path, f"{timeout:g}"]
    result = run_command(argv, timeout + STARTUP_ALLOWANCE_SECONDS, max_output_bytes=MAX_ANSWER_BYTES)
    duration = time.monotonic() - began

    def unknown(code: str, why: str) -> LedgerRead:
        return LedgerRead("unknown", path, code=code, why=why, read_at=wall, duration=duration)

    if result.timed_out:
        return unknown("TIMEOUT", f"the ledger reader got no answer within {timeout:g}s (kubelet hung?)")
    if not result.ok:
        detail = (result.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return unknown("READER", f"the ledger reader failed (exit {result.returncode}): {detail}")
    return _parsed(result.stdout, path, wall, duration)


def _parsed(text: str, path: str, wall: float, duration: float) -> LedgerRead:
    try:
        document = json.loads(text)
    except ValueError:
        document = None
    error = document.get("error") if isinstance(document, dict) else None
    if isinstance(error, dict):
        code = str(error.get("code", "UNKNOWN"))[:40]
        why = f"the kubelet answered {code}: {str(error.get('message', ''))[:300]}".rstrip(": ")
        if code in ("CONNECT", "TIMEOUT"):
            why = f"the kubelet did not answer ({code.lower()}): {str(error.get('message', ''))[:300]}"
        return LedgerRead("unknown", path, code=code, why=why, read_at=wall, duration=duration)
    try:
        ledger = parse_ledger(text)
    except LedgerError as exc:
        return LedgerRead("unknown", path, code="PARSE", why=f"not a ledger: {exc}", read_at=wall, duration=duration)
    return LedgerRead("ok", path, ledger, read_at=wall, duration=duration)


class PendingRead:
    """A read under way (or one reused): `result(deadline)` waits for it, at most until `deadline` (monotonic)."""

    def __init__(self, source: LedgerSource, done: LedgerRead | None = None) -> None:
        self._source = source
        self._done = done

    def result(self, deadline: float | None = None) -> LedgerRead:
        if self._done is not None:
            return self._done
        finished = self._source.wait(deadline)
        if finished is None:
            socket = self._source.socket
            why = "the ledger reader had not answered by the probe's deadline"
            return LedgerRead("unknown", socket, code="TIMEOUT", why=why)
        self._done = finished
        return finished


class LedgerSource:
    """The reads of one socket: one in flight at a time, the last one kept."""

    def __init__(self, socket: str) -> None:
        self.socket = socket
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)
        self._running: threading.Thread | None = None
        self._last: LedgerRead | None = None
        self._last_done = 0.0  # monotonic
        self.reads = 0  # reads started, for tests and benchmarks

    def start(self, timeout: float) -> PendingRead:
        absent = socket_state(self.socket)  # a stat: no thread, no child for a host without a kubelet
        if absent is not None:
            with self._lock:
                self._last, self._last_done = absent, time.monotonic()
            return PendingRead(self, absent)
        with self._lock:
            recent = time.monotonic() - self._last_done < MIN_SECONDS_BETWEEN_READS
            if self._running is None and self._last is not None and recent:
                return PendingRead(self, self._last)
            if self._running is None:
                self.reads += 1
                self._running = threading.Thread(
                    target=self._run, args=(timeout,), name="podresources-read", daemon=True
                )
                self._running.start()
        return PendingRead(self)

    def _run(self, timeout: float) -> None:
        try:
            outcome = read_once(self.socket, timeout)
        except Exception as exc:  # noqa: BLE001 - a failed read must leave the ledger unknown, not the thread dead
            outcome = LedgerRead("unknown", self.socket, code="READER", why=f"{type(exc).__name__}: {exc}")
        with self._lock:
            self._last, self._last_done, self._running = outcome, time.monotonic(), None
            self._finished.notify_all()

    def wait(self, deadline: float | None) -> LedgerRead | None:
        with self._lock:
            while self._running is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._finished.wait(left)
            return self._last

    def last(self) -> LedgerRead | None:
        with self._lock:
            return self._last


_SOURCES: dict[str, LedgerSource] = {}
_SOURCES_LOCK = threading.Lock()


def ledger_source(socket: str) -> LedgerSource:
    with _SOURCES_LOCK:
        source = _SOURCES.get(socket)
        if source is None:
            source = _SOURCES[socket] = LedgerSource(socket)
        return source


def last_read(socket: str) -> LedgerRead | None:
    """The latest finished read of this socket (None before the first): what `/ready?pod=` can answer from."""
    with _SOURCES_LOCK:
        source = _SOURCES.get(socket)
    return source.last() if source is not None else None
