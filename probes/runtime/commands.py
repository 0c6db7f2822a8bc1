"""Host commands with a hard deadline: output read as it comes under a byte cap, the whole process group killed
at the deadline, and the tool's exit taken as its completion even when a grandchild keeps its pipes open."""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from probes.runtime.cpulimit import tool_spawn


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
    program = _resolve(argv[0], env)
    if isinstance(program, OSError):
        return _not_started(argv, program, started)
    spawned, preexec = tool_spawn((program, *argv[1:]))  # into the work cgroup before it runs (cpulimit)
    try:
        return subprocess.Popen(
            spawned,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=env,
            preexec_fn=preexec,
        )
    except OSError as exc:
        return _not_started(argv, exc, started)


def _resolve(name: str, env: dict[str, str] | None) -> str | OSError:
    """The program `name` names, as execvp would find it on the tool's PATH; the error exec would give where
    there is none. Found here, not by the shell that may start it, so a missing tool reads the same either way."""
    if os.sep in name:
        candidates = [name]
    else:
        path = (env if env is not None else os.environ).get("PATH", os.defpath)
        candidates = [os.path.join(folder or ".", name) for folder in path.split(os.pathsep)]
    denied = None
    for candidate in candidates:
        if os.path.isfile(candidate):
            if os.access(candidate, os.X_OK):
                return candidate
            denied = candidate
    if denied is not None:
        return PermissionError(errno.EACCES, os.strerror(errno.EACCES), denied)
    return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)


def _not_started(argv: tuple[str, ...], exc: OSError, started: float) -> CommandResult:
    elapsed = time.monotonic() - started
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        return CommandResult(argv, None, "", str(exc), elapsed, not_found=True)
    if isinstance(exc, PermissionError):
        return CommandResult(argv, None, "", str(exc), elapsed, permission_denied=True)
    return CommandResult(argv, None, "", f"cannot run {argv[0]}: {exc}", elapsed)  # ENOEXEC and the like


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
