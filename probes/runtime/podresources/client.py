"""Reading the ledger from the agent: the reader child (`reader.py`) asked in the background, its answer shared.

`ledger_source(socket, timeout).start()` begins a read at once (a probe starts it before its /proc scan and
tool calls, so the two overlap) and returns a handle; `handle.result(deadline)` waits for the answer, at most
until the read's own deadline or the caller's, whichever comes first. One read is in flight per socket at a
time, and a read that finished less than `MIN_SECONDS_BETWEEN_READS` ago is reused rather than repeated: the npu
and gpu probes running together make one read, and no probe makes more than one per run. A read is two calls
(List, GetAllocatableResources), so the agent stays far below the kubelet's rate limit (100 QPS, burst 10).

The child stays up between reads (`ReaderProcess`: one per socket, started at the first read, asked over a pipe):
a read costs it a few milliseconds instead of an interpreter start and the client's imports (~0.1 s of CPU). A
child that does not answer by the read's deadline, answers garbage or exits is killed and started anew at the
next read; it exits by itself when the agent goes (its stdin closes) or after ten idle minutes.

The outcome is a `LedgerRead`: ok (the ledger), skip (no socket: no kubelet here, or the directory is not
mounted) or unknown (the kubelet did not answer in time, answered UNAVAILABLE or RESOURCE_EXHAUSTED, or sent
something that is not a ledger). `last_read(socket)` is the latest outcome, for the agent to serve.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


class ReaderProcess:
    """The reader child serving requests (`reader.py --serve`); not thread-safe: its LedgerSource serializes."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def ask(self, path: str, timeout: float) -> tuple[str, str]:
        """(answer line, "") or ("", why there is none); a child that failed is killed, the next ask starts one."""
        allowance = timeout + STARTUP_ALLOWANCE_SECONDS
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(f"{path}\t{timeout:g}\n".encode())
            proc.stdin.flush()
        except OSError as exc:
            self.close()
            return "", f"the ledger reader is gone ({exc.strerror or exc})"
        line, why = _read_line(proc.stdout.fileno(), time.monotonic() + allowance)
        if why:
            self.close()
        return line, why

    def _start(self) -> None:
        self.close()
        self.starts += 1
        self._proc = subprocess.Popen(
            [sys.executable, "-E", "-s", str(READER), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # killed with its whole group; never the agent's signals
        )

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)  # one stuck in D state is left; it holds no lock of ours


def _read_line(fd: int, deadline: float) -> tuple[str, str]:
    """One line from the child, at most MAX_ANSWER_BYTES, by the deadline."""
    chunks: list[bytes] = []
    size = 0
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                return "", "TIMEOUT"
            chunk = os.read(fd, 65536)
            if not chunk:
                return "", "the ledger reader exited without an answer"
            chunks.append(chunk)
            size += len(chunk)
            if chunk.endswith(b"\n"):
                return b"".join(chunks).decode("utf-8", "replace"), ""
            if size > MAX_ANSWER_BYTES:
                return "", f"the ledger reader's answer passed {MAX_ANSWER_BYTES} bytes"


def read_once(path: str, timeout: float, reader: ReaderProcess | None = None) -> LedgerRead:
    """One read through the reader child (a child of its own when `reader` is None), blocking at most timeout +
    the child's start-up allowance."""
    began, wall = time.monotonic(), time.time()
    absent = socket_state(path)
    if absent is not None:
        return absent
    own = reader is None
    child = reader or ReaderProcess()
    try:
        text, why = child.ask(path, timeout)
    finally:
        if own:
            child.close()
    duration = time.monotonic() - began
    if why == "TIMEOUT":
        why = f"the ledger reader got no answer within {timeout:g}s (kubelet hung?)"
        return LedgerRead("unknown", path, code="TIMEOUT", why=why, read_at=wall, duration=duration)
    if why:
        return LedgerRead("unknown", path, code="READER", why=why, read_at=wall, duration=duration)
    return _parsed(text, path, wall, duration)


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
        self._reader = ReaderProcess()
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
            outcome = read_once(self.socket, timeout, self._reader)
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

    @property
    def reader_starts(self) -> int:
        return self._reader.starts

    def close(self) -> None:
        """Stop the reader child once no read is in flight (a read in flight keeps it until it is done)."""
        with self._lock:
            while self._running is not None:
                self._finished.wait(10.0)
            self._reader.close()


_SOURCES: dict[str, LedgerSource] = {}
_SOURCES_LOCK = threading.Lock()


def ledger_source(socket: str) -> LedgerSource:
    with _SOURCES_LOCK:
        source = _SOURCES.get(socket)
        if source is None:
            source = _SOURCES[socket] = LedgerSource(socket)
        return source


def forget(socket: str) -> None:
    """Drop a socket's reads and stop its reader child (a socket that is gone for good: tests, a config change)."""
    with _SOURCES_LOCK:
        source = _SOURCES.pop(socket, None)
    if source is not None:
        source.close()


def last_read(socket: str) -> LedgerRead | None:
    """The latest finished read of this socket (None before the first): what `/ready?pod=` can answer from."""
    with _SOURCES_LOCK:
        source = _SOURCES.get(socket)
    return source.last() if source is not None else None
