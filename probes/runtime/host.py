"""Host access: where the host's /proc, /sys, /dev and root are, host commands with a hard deadline, and
filesystem calls in a child process with a deadline (at most one in flight per key).

Why children: a thread blocked in stat(2) on a hung NFS mount sleeps in D state and cannot be cancelled;
each retry from a thread leaks one more thread. A forked child can be SIGKILLed (NFS sleeps are
TASK_KILLABLE), and one that still lingers is remembered, so no second child is started for that key.
"""

# Size: temporary: being brought under 500 lines (the host paths move to their own module); do not grow it.

from __future__ import annotations

import contextlib
import errno as errno_module
import logging
import math
import os
import pickle
import select
import selectors
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probes.runtime.inventory import DeviceInventory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int | None  # None: killed at the deadline or never started
    stdout: str
    stderr: str
    duration: float
    timed_out: bool = False
    not_found: bool = False
    permission_denied: bool = False
    # stdout or stderr passed the byte cap: the process group was killed and the output is incomplete.
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.truncated

    @property
    def output(self) -> str:
        return self.stdout + ("\n" + self.stderr if self.stderr else "")


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
        os.close(read_fd)
        _drop_inherited_fds(write_fd)
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


def _drop_inherited_fds(keep: int) -> None:
    """A child stuck on a hung mount may live for hours: it must not hold the agent's listening socket,
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


# After the tool exits, what it wrote is drained for this long; a grandchild that keeps the pipes open past
# it does not hold the result back (and its output, if any, is not the tool's).
DRAIN_GRACE_SECONDS = 0.2
# Without pidfd_open (kernels before 5.3) the tool's exit is noticed by polling at this period.
_EXIT_POLL_SECONDS = 0.05
_READ_CHUNK = 65536

# Commands killed at their deadline whose process could not be reaped yet (stuck in D state): reaped by a
# later run_command, never by a thread per run.
_lingering: list[subprocess.Popen[bytes]] = []
_lingering_lock = threading.Lock()


def lingering_commands() -> int:
    """Commands killed at their deadline that have not exited yet."""
    _reap_lingering()
    with _lingering_lock:
        return len(_lingering)


def _reap_lingering() -> None:
    with _lingering_lock:
        _lingering[:] = [proc for proc in _lingering if proc.poll() is None]


class _Capture:
    """One pipe of the tool, read without blocking and kept up to a byte cap."""

    def __init__(self, fd: int, limit: int) -> None:
        self.fd = fd
        self.limit = limit
        self.data = bytearray()
        self.eof = False
        self.overflow = False
        os.set_blocking(fd, False)

    def read_available(self) -> None:
        """Read what the pipe holds now, up to the cap; past it, stop and mark the overflow."""
        while not self.eof and not self.overflow:
            try:
                chunk = os.read(self.fd, _READ_CHUNK)
            except BlockingIOError:
                return
            if not chunk:
                self.eof = True
                return
            room = self.limit - len(self.data)
            if len(chunk) > room:
                self.data += chunk[:room]
                self.overflow = True
                return
            self.data += chunk

    @property
    def done(self) -> bool:
        return self.eof or self.overflow

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def _exit_fd(pid: int) -> int | None:
    """A descriptor that becomes readable when `pid` exits (pidfd), or None where the kernel has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class _Pump:
    """Reads a running tool's stdout and stderr into capped buffers until it exits, overflows or overruns."""

    def __init__(self, proc: subprocess.Popen[bytes], limit: int) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.captures = {
            proc.stdout.fileno(): _Capture(proc.stdout.fileno(), limit),
            proc.stderr.fileno(): _Capture(proc.stderr.fileno(), limit),
        }
        self.selector = selectors.DefaultSelector()
        for fd in self.captures:
            self.selector.register(fd, selectors.EVENT_READ)
        self.exit_fd = _exit_fd(proc.pid)
        if self.exit_fd is not None:
            self.selector.register(self.exit_fd, selectors.EVENT_READ)

    def close(self) -> None:
        self.selector.close()
        if self.exit_fd is not None:
            os.close(self.exit_fd)

    @property
    def overflow(self) -> bool:
        return any(capture.overflow for capture in self.captures.values())

    def _select(self, timeout: float) -> None:
        for key, _ in self.selector.select(max(timeout, 0.0)):
            capture = self.captures.get(key.fd)
            if capture is None:
                continue  # the exit descriptor: the caller polls the process
            capture.read_available()
            if capture.done:
                self.selector.unregister(key.fd)

    def until_exit(self, deadline: float) -> str:
        """Pump until the tool exits ("exited"), a pipe passes its cap ("truncated") or the deadline ("timeout")."""
        while True:
            if self.overflow:
                return "truncated"
            if self.proc.poll() is not None:
                return "exited"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            self._select(remaining if self.exit_fd is not None else min(remaining, _EXIT_POLL_SECONDS))

    def drain(self, seconds: float) -> None:
        """Take what is buffered in the pipes, waiting at most `seconds` for their ends to close."""
        end = time.monotonic() + seconds
        if self.exit_fd is not None:
            self.selector.unregister(self.exit_fd)  # readable for good once the tool exited
            os.close(self.exit_fd)
            self.exit_fd = None
        while not all(capture.done for capture in self.captures.values()):
            self._select(0.0)
            remaining = end - time.monotonic()
            if remaining <= 0 or all(capture.done for capture in self.captures.values()):
                return
            self._select(remaining)


def run_command(
    argv: Sequence[str],
    timeout: float,
    env: dict[str, str] | None = None,
    max_output_bytes: int = 4 << 20,
) -> CommandResult:
    """Run argv (every element kept: `nsenter -t 1 -m -- npu-smi info` stays whole) with a hard deadline.

    stdout and stderr are read as they come, each kept up to `max_output_bytes`: past that the whole process
    group is SIGKILLed and the result is `truncated` (never buffered whole first). The tool's exit is its
    completion: what it wrote is drained for DRAIN_GRACE_SECONDS, then the pipes are closed, so a grandchild
    that keeps them open neither fails nor delays the command. On overrun the process group is SIGKILLed.
    """
    _reap_lingering()
    started = time.monotonic()
    argv_t = tuple(argv)
    proc = _start(argv_t, env, started)
    if isinstance(proc, CommandResult):
        return proc
    try:
        pump = _Pump(proc, max_output_bytes)
    except OSError:  # no descriptor left for the selector: do not leave the tool running
        _abandon(proc)
        raise
    try:
        state = pump.until_exit(started + timeout)
        if state != "exited":
            _killpg(proc.pid)
        pump.drain(DRAIN_GRACE_SECONDS)
        if state == "exited" and pump.overflow:
            _killpg(proc.pid)  # the tool is gone; what floods the pipes now is a grandchild of its group
            state = "truncated"
    except BaseException:
        _abandon(proc)
        raise
    finally:
        pump.close()
        _close_pipes(proc)
    returncode = _wait_killed(proc) if state != "exited" else proc.returncode
    stdout, stderr = (capture.text() for capture in pump.captures.values())
    timed_out = state == "timeout"
    exited = state == "exited"
    return CommandResult(
        argv_t,
        None if timed_out else returncode,
        stdout,
        stderr,
        time.monotonic() - started,
        timed_out=timed_out,
        permission_denied=(exited and returncode == 126),
        not_found=(exited and returncode == 127),
        truncated=state == "truncated",
    )


def _start(
    argv: tuple[str, ...], env: dict[str, str] | None, started: float
) -> subprocess.Popen[bytes] | CommandResult:
    """The running tool in its own process group, or the result of a tool that could not start."""
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=env,
        )
    except (FileNotFoundError, NotADirectoryError) as exc:
        return CommandResult(argv, None, "", str(exc), time.monotonic() - started, not_found=True)
    except PermissionError as exc:
        return CommandResult(argv, None, "", str(exc), time.monotonic() - started, permission_denied=True)
    except OSError as exc:  # ENOEXEC and the like: the tool cannot run at all
        return CommandResult(argv, None, "", f"cannot run {argv[0]}: {exc}", time.monotonic() - started)


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _abandon(proc: subprocess.Popen[bytes]) -> None:
    _killpg(proc.pid)
    _close_pipes(proc)
    _wait_killed(proc)


def _wait_killed(proc: subprocess.Popen[bytes], seconds: float = 1.0) -> int | None:
    """Reap a process we SIGKILLed; one stuck in D state is left to a later run_command (no thread)."""
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        with _lingering_lock:
            _lingering.append(proc)
        return None


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class Host:
    """Where the host's filesystems are, seen from the agent (in the DaemonSet: root=/host, hostPID)."""

    def __init__(
        self,
        proc: str | Path = "/proc",
        sys: str | Path = "/sys",
        dev: str | Path = "/dev",
        root: str | Path = "/",
        children: ChildCalls | None = None,
        devices: DeviceInventory | None = None,
    ) -> None:
        self.proc = Path(proc)
        self.sys = Path(sys)
        self.dev = Path(dev)
        self.root = Path(root)
        self.children = children or ChildCalls()
        # Bus-Id → accelerator, published by the npu and gpu probes and read by pcie; kept across reloads.
        self.devices = devices if devices is not None else DeviceInventory()

    @classmethod
    def from_config(
        cls, paths: Any, children: ChildCalls | None = None, devices: DeviceInventory | None = None
    ) -> Host:
        return cls(paths.proc, paths.sys, paths.dev, paths.root, children=children, devices=devices)

    def proc_path(self, *parts: str | int) -> Path:
        return self.proc.joinpath(*(str(p) for p in parts))

    def sys_path(self, *parts: str) -> Path:
        return self.sys.joinpath(*parts)

    def dev_path(self, *parts: str) -> Path:
        return self.dev.joinpath(*parts)

    def root_path(self, path: str | Path) -> Path:
        """A host path (e.g. /mnt/share) as seen from the agent (e.g. /host/mnt/share)."""
        return self.root.joinpath(str(path).lstrip("/"))

    def which(self, name: str) -> str | None:
        return shutil.which(name)

    def run(self, argv: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> CommandResult:
        return run_command(argv, timeout, env=env)

    def child_call(
        self, key: str, fn: Callable[..., Any], *args: Any, timeout: float, deadline: float | None = None
    ) -> ChildResult:
        return self.children.call(key, fn, *args, timeout=timeout, deadline=deadline)


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
