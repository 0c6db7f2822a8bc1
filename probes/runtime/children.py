"""Filesystem calls in a forked child with a deadline, at most one child in flight per key.

Why children: a thread blocked in stat(2) on a hung NFS mount sleeps in D state and cannot be cancelled;
each retry from a thread leaks one more thread. A forked child can be SIGKILLed (NFS sleeps are
TASK_KILLABLE), and one that still lingers is remembered, so no second child is started for that key.
The /proc/*/fd scanners (`probes.runtime.fdscan`) are such children too and share the helpers here.
"""

from __future__ import annotations

import contextlib
import errno as errno_module
import math
import os
import pickle
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from probes.runtime.cpulimit import enter_work


@dataclass(frozen=True)
class ChildResult:
    """Outcome of a filesystem call run in a child process."""

    state: str  # "ok", "error", "timeout", "busy" (previous child for this key still stuck)
    value: Any = None
    errno: int | None = None
    error: str = ""
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    @property
    def hung(self) -> bool:
        return self.state in ("timeout", "busy")

    @property
    def errno_name(self) -> str:
        return errno_module.errorcode.get(self.errno or 0, str(self.errno))


class ChildCalls:
    """Runs a module-level function in a forked child with a deadline; one child in flight per key.

    The function runs in the child only: it may use `os` and pure Python, must not log, take locks or
    import (another thread may have held those locks at fork time). It returns a picklable value or
    raises OSError; the errno comes back to the parent.
    """

    def __init__(self, max_lingering: int = 64) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}  # key → pid of a child not yet reaped
        self._max_lingering = max_lingering

    def in_flight(self) -> dict[str, int]:
        self.reap()
        with self._lock:
            return dict(self._in_flight)

    def _forget(self, key: str, pid: int) -> None:
        with self._lock:
            if self._in_flight.get(key) == pid:
                del self._in_flight[key]

    def reap(self) -> None:
        with self._lock:
            for key, pid in list(self._in_flight.items()):
                if try_reap(pid):
                    del self._in_flight[key]

    def call(
        self, key: str, fn: Callable[..., Any], *args: Any, timeout: float, deadline: float | None = None
    ) -> ChildResult:
        """`timeout` counts from the child's fork; `deadline` (monotonic), when given, caps it: a caller whose
        own deadline is fixed loses no time waiting for other keys' forks."""
        self.reap()
        with self._lock:
            if key in self._in_flight:
                return ChildResult("busy", error=f"previous check still stuck (pid {self._in_flight[key]})")
            if len(self._in_flight) >= self._max_lingering:
                return ChildResult("busy", error=f"{len(self._in_flight)} stuck children; not starting more")
            read_fd, write_fd = os.pipe()
            started = time.monotonic()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the child
                _child_main(read_fd, write_fd, fn, args)
            self._in_flight[key] = pid
        os.close(write_fd)
        try:
            payload = _read_until(read_fd, started + timeout if deadline is None else min(started + timeout, deadline))
        finally:
            os.close(read_fd)
        duration = time.monotonic() - started
        if payload is None:
            _kill(pid)
            # Reaped outside the lock: waiting here must never delay other keys' calls.
            if try_reap(pid, wait_seconds=0.05):
                self._forget(key, pid)
            return ChildResult("timeout", error=f"no answer within {timeout:g}s", duration=duration)
        if try_reap(pid, wait_seconds=1.0):
            self._forget(key, pid)
        try:
            kind, value, err_no, message = pickle.loads(payload)
        except Exception as exc:  # noqa: BLE001 - a child killed mid-write, or garbage
            return ChildResult("error", error=f"bad answer from child: {exc}", duration=duration)
        if kind == "ok":
            return ChildResult("ok", value=value, duration=duration)
        return ChildResult("error", errno=err_no, error=message, duration=duration)


def _child_main(read_fd: int, write_fd: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    status = 0
    try:
        enter_work()  # the children's cgroup, never the agent's quota (probes.runtime.cpulimit)
        os.close(read_fd)
        drop_inherited_fds(write_fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            outcome: tuple[str, Any, int | None, str] = ("ok", fn(*args), None, "")
        except OSError as exc:
            outcome = (
                "error",
                None,
                exc.errno,
                f"{exc.strerror or exc} ({errno_module.errorcode.get(exc.errno or 0, exc.errno)})",
            )
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, never raised in the child
            outcome = ("error", None, None, f"{type(exc).__name__}: {exc}")
        data = pickle.dumps(outcome)
        view = memoryview(data)
        while view:
            written = os.write(write_fd, view)
            view = view[written:]
    except BaseException:  # noqa: BLE001 - the child exits whatever happens
        status = 1
    finally:
        os._exit(status)


def drop_inherited_fds(keep: int) -> None:
    """Make a forked child hold none of the agent's descriptors but `keep` (stdin, stdout and stderr become
    /dev/null). A child stuck on a hung mount may live for hours: it must not hold the agent's listening socket,
    its stdout (a `node-health check | jq` would never end) or any other descriptor."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        if fd != keep:
            os.dup2(null, fd)
    top = max(keep, null) + 1
    os.closerange(3, keep)
    os.closerange(keep + 1, max(top, os.sysconf("SC_OPEN_MAX")))


def _read_until(fd: int, deadline: float) -> bytes | None:
    """Read the child's answer to EOF, or None at the deadline. poll(2), not select(2): the agent may hold
    more than FD_SETSIZE (1024) descriptors, and select() cannot wait on one numbered above that."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        if not poller.poll(math.ceil(remaining * 1000)):
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def try_reap(pid: int, wait_seconds: float = 0.0) -> bool:
    """Reap `pid` if it has exited (waiting up to `wait_seconds`); True when it is gone."""
    end = time.monotonic() + wait_seconds
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)


def statvfs_in_child(path: str) -> dict[str, int]:
    """Runs in a child (see ChildCalls): statvfs of one path as plain numbers."""
    st = os.statvfs(path)
    return {
        "frsize": st.f_frsize,
        "blocks": st.f_blocks,
        "bfree": st.f_bfree,
        "bavail": st.f_bavail,
        "files": st.f_files,
        "ffree": st.f_ffree,
        "favail": st.f_favail,
    }
