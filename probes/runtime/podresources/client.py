"""Reading the ledger from the agent: the reader child (`reader.py`) asked in the background, its answer shared.

`ledger_source(socket).start(timeout)` begins a read at once (a probe starts it at the start of its run, so the
read overlaps the /proc scan and the tool calls) and returns a handle. `handle.collect(deadline)` is what a probe
run takes once its own checks are done: the answer if it is back, else it waits at most `COLLECT_GRACE_SECONDS`
for the kubelet (and for a reader child still starting, which is the agent's own start-up, not the kubelet's);
a read not back by then leaves the ledger unknown for this run (code PENDING), so a hung or slow kubelet delays
no probe run by more than the grace. `handle.result(deadline)` waits for the answer itself, at most until the
read's own deadline or the caller's, whichever comes first (`/ready?pod=`, tests). One read is in flight per
socket at a time, and a read that finished less than `MIN_SECONDS_BETWEEN_READS` ago is reused rather than
repeated: the npu and gpu probes running together make one read, and no probe makes more than one per run. A
read is two calls (List, GetAllocatableResources), so the agent stays far below the kubelet's rate limit (100
QPS, burst 10).

The child stays up between reads (`ReaderProcess`: one per socket, started at the first read, asked over a pipe):
a read costs it a few milliseconds instead of an interpreter start and the client's imports (~0.1 s of CPU). It
says `ready` once its imports are done, so the agent can tell its start-up from the kubelet's answer. A child
that does not start within `STARTUP_ALLOWANCE_SECONDS`, does not answer by the read's deadline, answers garbage
or exits is killed and started anew at the next read; it exits by itself when the agent goes (its stdin closes)
or after ten idle minutes.

The outcome is a `LedgerRead`: ok (the ledger), skip (no socket: no kubelet here, or the directory is not
mounted) or unknown (the kubelet did not answer in time, answered UNAVAILABLE or RESOURCE_EXHAUSTED, or sent
something that is not a ledger). `last_read(socket)` is the latest finished outcome, for the agent to serve.

Memory: what one answer may hold is bounded (`caps.py`, in the child before it builds anything, and again here);
the answer line is read into one buffer and parsed once; and the previous read is dropped once the next answer is
in, before it is parsed, so the agent holds one ledger at a time.
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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from probes.runtime.podresources.caps import MAX_ANSWER_BYTES
from probes.runtime.podresources.ledger import Ledger, LedgerError, ledger_of

READER = Path(__file__).resolve().parent / "reader.py"
MIN_SECONDS_BETWEEN_READS = 1.0
# The child's interpreter and imports (~0.1 s of CPU) before its first call; on a loaded node, more.
STARTUP_ALLOWANCE_SECONDS = 2.0
# What a probe run waits for the kubelet's answer once its own checks are done: a healthy kubelet has answered
# long before (a read is ~10 ms, started at the run's start); a hung one costs the run no more than this.
COLLECT_GRACE_SECONDS = 0.25
READY = "ready\n"  # the serving child's first line, once its imports are done


@dataclass(frozen=True)
class LedgerRead:
    """One attempt to read the ledger."""

    state: str  # "ok", "skip" (no socket), "unknown" (no usable answer)
    socket: str
    ledger: Ledger | None = None
    code: str = ""  # why not ok: MISSING, DISABLED, NOT_A_SOCKET, TIMEOUT, CONNECT, UNAVAILABLE, TOO_LARGE, PARSE, ...
    why: str = ""
    read_at: float = 0.0  # wall clock, when the read began: shown, and compared with other wall clocks
    read_mono: float = 0.0  # monotonic clock, when the read began: its age (no clock step moves it)
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

    def ask(self, path: str, timeout: float, asking: Callable[[], None] | None = None) -> tuple[bytes | bytearray, str]:
        """(answer line, "") or (b"", why there is none); a child that failed is killed, the next ask starts one.
        `asking` is called once the request is with a started child: from then on the wait is the kubelet's."""
        deadline = time.monotonic() + timeout + STARTUP_ALLOWANCE_SECONDS
        if self._proc is None or self._proc.poll() is not None:
            why = self._start()
            if why:
                self.close()
                return b"", why
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(f"{path}\t{timeout:g}\n".encode())
            proc.stdin.flush()
        except OSError as exc:
            self.close()
            return b"", f"the ledger reader is gone ({exc.strerror or exc})"
        if asking is not None:
            asking()
        line, why = _read_line(proc.stdout.fileno(), deadline)
        if why:
            self.close()
        return line, why

    def _start(self) -> str:
        """Start the child and wait for its `ready`: "" or why it did not start."""
        self.close()
        self.starts += 1
        self._proc = subprocess.Popen(
            [sys.executable, "-E", "-s", str(READER), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # killed with its whole group; never the agent's signals
        )
        assert self._proc.stdout is not None
        line, why = _read_line(self._proc.stdout.fileno(), time.monotonic() + STARTUP_ALLOWANCE_SECONDS)
        if why == "TIMEOUT":
            return f"the ledger reader did not start within {STARTUP_ALLOWANCE_SECONDS:g}s"
        if why or line != READY.encode():
            return f"the ledger reader did not start: {why or repr(line[:80])}"
        return ""

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


def _read_line(fd: int, deadline: float) -> tuple[bytes | bytearray, str]:
    """One line from the child, at most MAX_ANSWER_BYTES, by the deadline: read into one buffer and handed over as
    it is (no list of chunks joined into a second copy; json.loads takes a bytearray)."""
    line = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                return b"", "TIMEOUT"
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"", "the ledger reader exited without an answer"
            line += chunk
            if chunk.endswith(b"\n"):
                return line, ""
            if len(line) > MAX_ANSWER_BYTES:
                return b"", f"the ledger reader's answer passed {MAX_ANSWER_BYTES} bytes"


def read_once(
    path: str,
    timeout: float,
    reader: ReaderProcess | None = None,
    asking: Callable[[], None] | None = None,
    answered: Callable[[], None] | None = None,
) -> LedgerRead:
    """One read through the reader child (a child of its own when `reader` is None), blocking at most timeout +
    the child's start-up allowance; `asking` as in `ReaderProcess.ask`; `answered` is called once the answer is
    in and before it is parsed (LedgerSource drops its previous read there)."""
    began, wall = time.monotonic(), time.time()
    absent = socket_state(path)
    if absent is not None:
        return absent
    own = reader is None
    child = reader or ReaderProcess()
    try:
        text, why = child.ask(path, timeout, asking)
    finally:
        if own:
            child.close()
    if why == "TIMEOUT":
        why = f"the ledger reader got no answer within {timeout:g}s (kubelet hung?)"
        read = LedgerRead("unknown", path, code="TIMEOUT", why=why)
    elif why:
        read = LedgerRead("unknown", path, code="READER", why=why)
    else:
        if answered is not None:
            answered()
        read = _parsed(text, path)
        del text  # the line goes before the caller keeps the ledger
    return replace(read, read_at=wall, read_mono=began, duration=time.monotonic() - began)


def _parsed(text: bytes | bytearray, path: str) -> LedgerRead:
    """The child's line, parsed once: its error, or the ledger."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        return LedgerRead("unknown", path, code="PARSE", why=f"not a ledger: not JSON: {exc}")
    error = document.get("error") if isinstance(document, dict) else None
    if isinstance(error, dict):
        code = str(error.get("code", "UNKNOWN"))[:40]
        message = str(error.get("message", ""))[:300]
        why = f"the kubelet answered {code}: {message}".rstrip(": ")
        if code in ("CONNECT", "TIMEOUT"):
            why = f"the kubelet did not answer ({code.lower()}): {message}"
        elif code == "TOO_LARGE":
            why = f"the kubelet's answer is larger than the agent reads (caps.py), so it was not read: {message}"
        return LedgerRead("unknown", path, code=code, why=why)
    try:
        ledger = ledger_of(document)
    except LedgerError as exc:
        return LedgerRead("unknown", path, code="PARSE", why=f"not a ledger: {exc}")
    return LedgerRead("ok", path, ledger)


class PendingRead:
    """A read under way (or one reused): `collect(deadline)` takes what it has by the end of a probe run,
    `result(deadline)` waits for it, at most until `deadline` (monotonic)."""

    def __init__(self, source: LedgerSource, done: LedgerRead | None = None) -> None:
        self._source = source
        self._done = done

    def result(self, deadline: float | None = None) -> LedgerRead:
        return self._take(deadline, None)

    def collect(self, deadline: float, grace: float = COLLECT_GRACE_SECONDS) -> LedgerRead:
        """The answer, or unknown (PENDING) when the kubelet has not given it within `grace` seconds from now
        (from when the request reached the child, if its start-up ends later), at most until `deadline`."""
        return self._take(deadline, grace)

    def _take(self, deadline: float | None, grace: float | None) -> LedgerRead:
        if self._done is not None:
            return self._done
        finished = self._source.wait(deadline, grace)
        if finished is not None:
            self._done = finished
            return finished
        socket = self._source.socket
        if grace is None:
            why = "the ledger reader had not answered by the probe's deadline"
            return LedgerRead("unknown", socket, code="TIMEOUT", why=why)
        why = f"no answer from the kubelet {grace:g}s after the probe's own checks were done (kubelet slow or hung?)"
        return LedgerRead("unknown", socket, code="PENDING", why=why)


class LedgerSource:
    """The reads of one socket: one in flight at a time, the last one kept."""

    def __init__(self, socket: str) -> None:
        self.socket = socket
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)
        self._running: threading.Thread | None = None
        self._last: LedgerRead | None = None
        self._last_done = 0.0  # monotonic
        self._asked_at: float | None = None  # monotonic, when the running read's request reached a started child
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
                self._asked_at = None
                self._running = threading.Thread(
                    target=self._run, args=(timeout,), name="podresources-read", daemon=True
                )
                self._running.start()
        return PendingRead(self)

    def _run(self, timeout: float) -> None:
        try:
            outcome = read_once(self.socket, timeout, self._reader, self._asking, self._drop_last)
        except Exception as exc:  # noqa: BLE001 - a failed read must leave the ledger unknown, not the thread dead
            outcome = LedgerRead("unknown", self.socket, code="READER", why=f"{type(exc).__name__}: {exc}")
        with self._lock:
            self._last, self._last_done, self._running = outcome, time.monotonic(), None
            self._finished.notify_all()

    def _drop_last(self) -> None:
        """A new answer is in: the previous read goes before it is parsed, so the agent never holds two ledgers (for
        the milliseconds of the parse, `last()` is a read that is not ok, and /ready?pod= waits for this read)."""
        with self._lock:
            if self._last is not None and self._last.ok:
                why = "the previous read was dropped while the kubelet's new answer is parsed"
                self._last = LedgerRead("unknown", self.socket, code="REPLACING", why=why)

    @property
    def busy(self) -> bool:
        """Whether a read is in flight."""
        with self._lock:
            return self._running is not None

    def _asking(self) -> None:
        with self._lock:
            self._asked_at = time.monotonic()
            self._finished.notify_all()  # a collector's wait now runs on the kubelet's clock

    def wait(self, deadline: float | None, grace: float | None = None) -> LedgerRead | None:
        """The finished read, or None at `deadline`; with `grace`, also None once the kubelet has had `grace`
        seconds counted from now, or from when the request reached the child if that is later."""
        called = time.monotonic()
        with self._lock:
            while self._running is not None:
                limit = deadline
                if grace is not None and self._asked_at is not None:
                    kubelet = max(called, self._asked_at) + grace
                    limit = kubelet if limit is None else min(limit, kubelet)
                left = None if limit is None else limit - time.monotonic()
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
