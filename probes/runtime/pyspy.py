"""py-spy stack dumps of a stuck Python process, classified (used by `node-health diagnose` and storage.locks).

py-spy (`py-spy dump --json --locals --pid PID`) gives each thread's Python frames, innermost first, with
the reprs of their locals. Python frames alone cannot tell a thread blocked in recv() from one blocked in
a lock, because C calls are not frames; the kernel's wait channel (/proc/PID/task/TID/wchan) and the
thread state (D = uninterruptible I/O) fill that in without ptrace.

Classes, most specific first:
  filebaton_wait   a thread loops in torch's FileBaton.wait(): another process holds (or a dead one left)
                   the extension build lock; the lock path comes from the frames' locals when they show it
  lock_wait        a thread polls a lock file (filelock, huggingface/modelscope weak locks, a sleep loop
                   on a *.lock / lock path)
  idle_event_loop  every thread idle, the event loop thread in selector.select() under _run_once: nothing
                   is ready to run; an engine core the loop waits on may be hung (suspended coroutines are
                   on no thread stack, so py-spy cannot show what it awaits)
  running          a thread is on CPU
  blocked_io       every thread idle and one is in the kernel on I/O (read/recv/poll/futex/NFS...)
  idle             every thread idle, nothing more specific
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from probes.runtime.commands import run_command
from probes.runtime.procstat import state_of

REASON_FILEBATON = "ProcessWaitingOnFileBaton"

FILEBATON_WAIT = "filebaton_wait"
LOCK_WAIT = "lock_wait"
IDLE_EVENT_LOOP = "idle_event_loop"
RUNNING = "running"
BLOCKED_IO = "blocked_io"
IDLE = "idle"
NO_THREADS = "no_threads"

# Locals that name a lock file, checked in the waiting frame and its callers (innermost first).
_LOCK_PATH_LOCALS = ("lock_file_path", "lock_file", "lock_path", "_lock_file", "lockfile", "path", "file_path")
# torch.utils.cpp_extension._jit_compile(name, sources, ..., build_directory, ...) takes
# FileBaton(os.path.join(build_directory, 'lock')).
_BUILD_DIRECTORY_LOCAL = "build_directory"

# Kernel wait channels (wchan) that mean "waiting for I/O or for another thread", by what they wait on.
_WCHAN_KINDS: tuple[tuple[str, str], ...] = (
    ("nanosleep", "sleep"),
    ("epoll", "poll"),
    ("select", "poll"),
    ("poll", "poll"),
    ("futex", "futex (a lock or condition variable)"),
    ("rpc_", "NFS/RPC"),
    ("nfs", "NFS"),
    ("fuse", "FUSE"),
    ("unix_stream", "socket read"),
    ("sk_wait", "socket read"),
    ("wait_woken", "socket or tty read"),
    ("inet_csk_accept", "socket accept"),
    ("tcp", "TCP"),
    ("pipe", "pipe"),
    ("read", "read"),
    ("write", "write"),
    ("io_schedule", "disk I/O"),
    ("folio_wait", "disk I/O"),
    ("wait_on_page", "disk I/O"),
    ("do_wait", "a child process"),
    ("wait_for_completion", "a kernel completion"),
)


@dataclass(frozen=True)
class Frame:
    name: str
    filename: str
    short_filename: str
    line: int
    locals: Mapping[str, str] = field(default_factory=dict)  # name → repr as py-spy prints it

    def str_local(self, name: str) -> str | None:
        """The value of a str local (py-spy prints those JSON-quoted); None for other types or when absent."""
        text = self.locals.get(name)
        return None if text is None else _str_value(text)

    def str_locals(self) -> list[str]:
        return [value for value in map(_str_value, self.locals.values()) if value is not None]

    def where(self) -> str:
        return f"{self.name} ({self.short_filename or self.filename}:{self.line})"


@dataclass(frozen=True)
class ThreadStack:
    thread_id: int
    name: str
    os_thread_id: int | None
    active: bool
    owns_gil: bool
    frames: tuple[Frame, ...]  # innermost first
    kernel_state: str = ""  # R, S, D... from /proc/PID/task/TID/stat
    wchan: str = ""  # kernel function the thread sleeps in

    @property
    def label(self) -> str:
        return f"{self.name or 'thread'} ({self.os_thread_id or hex(self.thread_id)})"


@dataclass
class Diagnosis:
    pid: int
    kind: str  # one of the classes above, or "error"
    detail: str
    lock_path: str | None = None
    threads: list[ThreadStack] = field(default_factory=list)
    error: str = ""
    command: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def reason(self) -> str | None:
        return REASON_FILEBATON if self.kind in (FILEBATON_WAIT, LOCK_WAIT) else None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pid": self.pid,
            "kind": self.kind,
            "detail": self.detail,
            "reason": self.reason,
            "lock_path": self.lock_path,
            "threads": [asdict(thread) for thread in self.threads],
        }
        if self.error:
            out["error"] = self.error
        return out


# --- parsing py-spy's JSON ------------------------------------------------------------------------------


def _str_value(repr_text: str) -> str | None:
    """py-spy prints str locals JSON-quoted ("\"/tmp/x/lock\""); anything else is an opaque repr → None."""
    if len(repr_text) < 2 or repr_text[0] != '"' or repr_text[-1] != '"':
        return None
    try:
        value = json.loads(repr_text)
    except ValueError:
        return repr_text[1:-1]
    return value if isinstance(value, str) else None


def parse_py_spy_json(data: str | bytes | list[Any]) -> list[ThreadStack]:
    """`py-spy dump --json` output → threads. Raises ValueError when it is not that format."""
    doc = json.loads(data) if isinstance(data, (str, bytes)) else data
    if not isinstance(doc, list):
        raise ValueError("py-spy JSON: expected an array of threads")
    threads: list[ThreadStack] = []
    for item in doc:
        if not isinstance(item, dict) or not isinstance(item.get("frames"), list):
            raise ValueError("py-spy JSON: a thread without frames")
        frames = []
        for raw in item["frames"]:
            if not isinstance(raw, dict) or "name" not in raw:
                raise ValueError("py-spy JSON: a frame without a name")
            local_reprs: dict[str, str] = {}
            for local in raw.get("locals") or ():
                if isinstance(local, dict) and isinstance(local.get("name"), str):
                    local_reprs[local["name"]] = str(local.get("repr", ""))
            frames.append(
                Frame(
                    name=str(raw["name"]),
                    filename=str(raw.get("filename") or ""),
                    short_filename=str(raw.get("short_filename") or raw.get("filename") or ""),
                    line=int(raw.get("line") or 0),
                    locals=local_reprs,
                )
            )
        os_tid = item.get("os_thread_id")
        threads.append(
            ThreadStack(
                thread_id=int(item.get("thread_id") or 0),
                name=str(item.get("thread_name") or ""),
                os_thread_id=int(os_tid) if isinstance(os_tid, int) else None,
                active=bool(item.get("active")),
                owns_gil=bool(item.get("owns_gil")),
                frames=tuple(frames),
            )
        )
    return threads


# --- classification -----------------------------------------------------------------------------------


def _is_filebaton_wait(frame: Frame) -> bool:
    if frame.name == "FileBaton.wait":
        return True
    return frame.name == "wait" and frame.filename.replace("\\", "/").endswith("torch/utils/file_baton.py")


def _looks_like_lock_path(value: str) -> bool:
    base = value.rstrip("/").rsplit("/", 1)[-1].lower()
    return "/" in value and (base == "lock" or base.endswith(".lock") or base.endswith("_lock"))


def _lock_path_from(frames: Sequence[Frame], start: int) -> str | None:
    """The lock path shown by the waiting frame's locals or its callers' (innermost first)."""
    for frame in frames[start:]:
        for name in _LOCK_PATH_LOCALS:
            value = frame.str_local(name)
            if value and _looks_like_lock_path(value):
                return value
        build_directory = frame.str_local(_BUILD_DIRECTORY_LOCAL)
        if build_directory:
            return os.path.join(build_directory, "lock")
    for frame in frames[start:]:
        for value in frame.str_locals():
            if _looks_like_lock_path(value):
                return value
    return None


_LOCK_MODULES = ("filelock/", "huggingface_hub/utils/_fixes.py", "modelscope/", "portalocker/")


def _lock_wait_frame(frames: Sequence[Frame]) -> int | None:
    """Index of a frame polling a lock file: inside a file-lock library's acquire, or a loop whose locals
    hold a lock path while the thread sleeps."""
    for index, frame in enumerate(frames):
        path = frame.filename.replace("\\", "/")
        short_name = frame.name.rsplit(".", 1)[-1]
        if short_name in ("acquire", "_acquire", "weak_file_lock", "__enter__") and any(
            marker in path for marker in _LOCK_MODULES
        ):
            return index
    if frames:
        innermost = frames[0]
        if any(_looks_like_lock_path(value) for value in innermost.str_locals()):
            return 0
    return None


def _is_event_loop_select(thread: ThreadStack) -> bool:
    if not thread.frames:
        return False
    innermost = thread.frames[0]
    in_select = innermost.name.rsplit(".", 1)[-1] in ("select", "poll", "control") and (
        innermost.filename.endswith("selectors.py") or "asyncio" in innermost.filename
    )
    under_run_once = any(
        frame.name.endswith("_run_once") and "asyncio" in frame.filename.replace("\\", "/") for frame in thread.frames
    )
    return in_select and under_run_once


def _wchan_kind(wchan: str) -> str | None:
    if not wchan or wchan == "0":
        return None
    for marker, kind in _WCHAN_KINDS:
        if marker in wchan:
            return kind
    return None


def _coerce_threads(threads: Iterable[ThreadStack | Mapping[str, Any]]) -> list[ThreadStack]:
    items = list(threads)
    if items and not isinstance(items[0], ThreadStack):
        return parse_py_spy_json([dict(item) for item in items])  # type: ignore[arg-type]
    return items  # type: ignore[return-value]


def classify_stack(threads: Iterable[ThreadStack | Mapping[str, Any]]) -> tuple[str, str]:
    """Classify a dump (threads as parsed, or py-spy's JSON thread objects) → (kind, detail)."""
    kind, detail, _ = _classify(_coerce_threads(threads))
    return kind, detail


def _classify(threads: list[ThreadStack]) -> tuple[str, str, str | None]:
    if not threads:
        return NO_THREADS, "py-spy found no Python threads", None
    for thread in threads:
        for index, frame in enumerate(thread.frames):
            if _is_filebaton_wait(frame):
                lock = _lock_path_from(thread.frames, index)
                callers = " ← ".join(f.name for f in thread.frames[index : index + 3])
                where = f"on {lock}" if lock else "(lock path not visible in the frames)"
                return (
                    FILEBATON_WAIT,
                    f"{thread.label} waits in FileBaton.wait {where}: {callers}. Another process holds the torch "
                    "extension build lock, or a dead build left it behind",
                    lock,
                )
    for thread in threads:
        wait_index = _lock_wait_frame(thread.frames)
        if wait_index is not None:
            lock = _lock_path_from(thread.frames, wait_index)
            where = f"on {lock}" if lock else "(lock path not visible in the frames)"
            return (
                LOCK_WAIT,
                f"{thread.label} waits for a lock file {where} in {thread.frames[wait_index].where()}",
                lock,
            )
    if all(not t.active for t in threads):
        loop_threads = [t for t in threads if _is_event_loop_select(t)]
        if loop_threads:
            names = ", ".join(t.label for t in loop_threads)
            return (
                IDLE_EVENT_LOOP,
                f"asyncio event loop idle in select() ({names}) and no thread running: nothing is ready to run, "
                "so the loop waits on I/O or on another process — an engine core may be hung",
                None,
            )
    active = [t for t in threads if t.active]
    if active:
        where = active[0].frames[0].where() if active[0].frames else "native code"
        return RUNNING, f"{len(active)} of {len(threads)} thread(s) running; {active[0].label} in {where}", None
    for thread in threads:
        if thread.kernel_state == "D":
            where = thread.frames[0].where() if thread.frames else "native code"
            return (
                BLOCKED_IO,
                f"{thread.label} in uninterruptible I/O (D state, kernel {thread.wchan or '?'}) from {where}",
                None,
            )
    for thread in threads:
        wait = _wchan_kind(thread.wchan)
        if wait and wait != "sleep":
            where = thread.frames[0].where() if thread.frames else "native code"
            return BLOCKED_IO, f"{thread.label} blocked on {wait} (kernel {thread.wchan}) from {where}", None
    first = threads[0]
    where = first.frames[0].where() if first.frames else "native code"
    return IDLE, f"all {len(threads)} thread(s) idle; {first.label} in {where}", None


# --- running py-spy -----------------------------------------------------------------------------------


def _kernel_wait(proc: Path, pid: int, tid: int | None) -> tuple[str, str]:
    """(state letter, wchan) of one thread; empty strings when unreadable."""
    if tid is None:
        return "", ""
    task = proc / str(pid) / "task" / str(tid)
    state = wchan = ""
    with contextlib.suppress(OSError):
        state = state_of((task / "stat").read_text(errors="replace"))
    with contextlib.suppress(OSError):
        wchan = (task / "wchan").read_text().strip()
    return state, "" if wchan == "0" else wchan


def _py_spy_error(stderr: str, stdout: str) -> str:
    for line in (stderr or stdout).splitlines():
        if line.startswith("Error:"):
            return line[len("Error:") :].strip()
    text = (stderr or stdout).strip()
    return text.splitlines()[0] if text else "no output"


PY_SPY_NOT_FOUND = "py-spy not found"


def py_spy_argv(py_spy: str | Sequence[str], pid: int) -> list[str]:
    """The dump command: `py_spy` is the binary or an argv prefix, every element kept
    (`[nsenter, -t, 1, -m, --, py-spy]` runs the host's py-spy)."""
    prefix = [py_spy] if isinstance(py_spy, str) else list(py_spy)
    return [*(prefix or ["py-spy"]), "dump", "--json", "--locals", "--pid", str(pid)]


def diagnose(pid: int, timeout: float, py_spy: str | Sequence[str] = "py-spy", proc: str | Path = "/proc") -> Diagnosis:
    """Dump `pid` with py-spy (bounded by `timeout`) and classify it. Errors come back in Diagnosis.error;
    a py-spy that cannot be found (nor run by its wrapper: exit 127) says PY_SPY_NOT_FOUND there."""
    argv = py_spy_argv(py_spy, pid)
    shown = " ".join(argv[: len(argv) - 5])
    proc_path = Path(proc)
    if not (proc_path / str(pid)).exists():
        return Diagnosis(pid, "error", f"no process {pid}", error=f"no process {pid}", command=argv)
    result = run_command(argv, timeout)
    if result.not_found:
        message = f"{PY_SPY_NOT_FOUND}: {shown} ({_py_spy_error(result.stderr, result.stdout)})"
        return Diagnosis(pid, "error", message, error=message, command=argv)
    if result.timed_out:
        message = f"py-spy did not answer within {timeout:g}s"
        return Diagnosis(pid, "error", message, error=message, command=argv)
    if result.returncode != 0:
        message = f"py-spy failed (exit {result.returncode}): {_py_spy_error(result.stderr, result.stdout)}"
        return Diagnosis(pid, "error", message, error=message, command=argv)
    try:
        threads = parse_py_spy_json(result.stdout)
    except ValueError as exc:
        message = f"unreadable py-spy output: {exc}"
        return Diagnosis(pid, "error", message, error=message, command=argv)
    with_kernel = []
    for thread in threads:
        state, wchan = _kernel_wait(proc_path, pid, thread.os_thread_id)
        with_kernel.append(
            ThreadStack(
                thread.thread_id,
                thread.name,
                thread.os_thread_id,
                thread.active,
                thread.owns_gil,
                thread.frames,
                kernel_state=state,
                wchan=wchan,
            )
        )
    kind, detail, lock = _classify(with_kernel)
    return Diagnosis(pid, kind, detail, lock_path=lock, threads=with_kernel, command=argv)


def waiting_on_lock(
    pid: int, timeout: float, py_spy: str | Sequence[str] = "py-spy", proc: str | Path = "/proc"
) -> str | None:
    """For storage.locks: the lock path `pid` waits on; "" when it waits on a lock whose path the frames do
    not show; None when it is not waiting on a lock file (or could not be dumped)."""
    diagnosis = diagnose(pid, timeout, py_spy=py_spy, proc=proc)
    if diagnosis.kind in (FILEBATON_WAIT, LOCK_WAIT):
        return diagnosis.lock_path or ""
    return None
