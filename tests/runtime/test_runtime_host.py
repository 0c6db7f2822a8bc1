"""Host access: hard deadlines that kill whole process groups; output read incrementally under a byte cap; a
tool's exit is its completion even when a grandchild keeps its pipes; children with at most one in flight per
key, also when the agent holds more than 1024 descriptors."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.system import REPO, require_root, require_tool

from probes.runtime.children import ChildCalls, statvfs_in_child
from probes.runtime.commands import lingering_commands, run_command


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_run_command_kills_the_whole_process_group(tmp_path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, time; p = subprocess.Popen(['sleep', '300']); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(300)"
    )
    result = run_command([sys.executable, "-c", script], timeout=1.0)
    assert result.timed_out and result.returncode is None
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild), "the grandchild survived the deadline"


def test_run_command_outcomes() -> None:
    assert run_command(["true"], 5).ok
    failed = run_command(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], 5
    )
    assert (failed.returncode, failed.stdout.strip(), failed.stderr.strip()) == (3, "out", "err")
    assert run_command(["/nonexistent/tool"], 5).not_found


def sleep_in_child(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


def raise_estale(path: str) -> None:
    raise OSError(errno.ESTALE, "Stale file handle", path)


def test_child_calls_values_errors_and_deadlines(tmp_path) -> None:
    calls = ChildCalls()
    result = calls.call("statvfs", statvfs_in_child, str(tmp_path), timeout=5)
    assert result.ok and result.value["blocks"] > 0
    failed = calls.call("stale", raise_estale, "/mnt/x", timeout=5)
    assert failed.state == "error" and failed.errno == errno.ESTALE and failed.errno_name == "ESTALE"
    missing = calls.call("missing", statvfs_in_child, str(tmp_path / "nope"), timeout=5)
    assert missing.errno == errno.ENOENT
    started = time.monotonic()
    hung = calls.call("hang", sleep_in_child, 60, timeout=0.3)
    assert hung.state == "timeout" and hung.hung
    assert time.monotonic() - started < 2.0
    assert calls.in_flight() == {}, "a killable child is killed and reaped"


def test_an_unreapable_child_blocks_new_children_for_its_key_only(tmp_path) -> None:
    calls = ChildCalls()
    # A child that ignores nothing but is stopped (SIGSTOP) still dies on SIGKILL; to model a child stuck in
    # D state we register a live process of our own as the in-flight child of the key.
    blocker = os.fork()
    if blocker == 0:
        time.sleep(30)
        os._exit(0)
    try:
        calls._in_flight["mount:/a"] = blocker
        busy = calls.call("mount:/a", statvfs_in_child, str(tmp_path), timeout=1)
        assert busy.state == "busy" and busy.hung
        assert calls.call("mount:/b", statvfs_in_child, str(tmp_path), timeout=5).ok
    finally:
        os.kill(blocker, 9)
        os.waitpid(blocker, 0)
    assert calls.call("mount:/a", statvfs_in_child, str(tmp_path), timeout=5).ok


def report_own_fds() -> list[int]:
    return sorted(int(fd) for fd in os.listdir("/proc/self/fd"))


def test_children_hold_none_of_the_agents_descriptors(tmp_path) -> None:
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held = open(tmp_path / "held", "w")  # noqa: SIM115 - held open across the child call on purpose
    try:
        result = ChildCalls().call("fds", report_own_fds, timeout=5)
        assert result.ok
        # 0-2 (pointed at /dev/null), the answer pipe, and the one listdir itself opened.
        assert listener.fileno() not in result.value
        assert held.fileno() not in result.value
        assert len(result.value) <= 5, result.value
    finally:
        listener.close()
        held.close()


# --- run_command: bounded output, exit is completion --------------------------------------------------------

# A tool that writes `total` bytes to one stream in 1 MiB chunks, then leaves a marker: the marker only
# exists if nobody stopped it.
FLOOD_TOOL = textwrap.dedent(
    """
    import os, sys
    stream, total, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    fd = 1 if stream == "stdout" else 2
    chunk = b"x" * (1 << 20)
    written = 0
    while written < total:
        written += os.write(fd, chunk)
    open(marker, "w").write("finished")
    """
)

# Runs run_command in a fresh interpreter and reports how much its peak RSS (VmHWM) grew while doing so.
MEASURE_RSS = textwrap.dedent(
    """
    import json, sys
    from probes.runtime.commands import run_command

    def peak_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise SystemExit("no VmHWM in /proc/self/status")

    argv = json.loads(sys.argv[1])
    before = peak_kib()
    result = run_command(argv, timeout=120)
    after = peak_kib()
    print(json.dumps({
        "growth_kib": after - before, "truncated": result.truncated, "ok": result.ok,
        "returncode": result.returncode, "timed_out": result.timed_out,
        "stdout_bytes": len(result.stdout.encode()), "stderr_bytes": len(result.stderr.encode()),
    }))
    """
)


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_flooding_tool_is_cut_at_the_cap_and_memory_stays_bounded(tmp_path: Path, stream: str) -> None:
    tool = tmp_path / "flood.py"
    tool.write_text(FLOOD_TOOL)
    marker = tmp_path / "finished"
    argv = [sys.executable, str(tool), stream, str(600 << 20), str(marker)]
    measured = subprocess.run(
        [sys.executable, "-c", MEASURE_RSS, json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert measured.returncode == 0, measured.stderr
    report = json.loads(measured.stdout)
    assert report["truncated"] and not report["ok"] and not report["timed_out"]
    assert report["returncode"] == -signal.SIGKILL  # the process group was killed at the cap
    assert report[f"{stream}_bytes"] == 4 << 20
    assert not marker.exists(), "the flooding tool ran to its end"
    # 600 MiB went into the pipe; the reader may hold the 4 MiB cap (bytes and text), not the flood.
    assert report["growth_kib"] < 48 * 1024, report


def test_output_below_the_cap_is_complete(tmp_path: Path) -> None:
    script = "import os; os.write(1, b'o' * (3 << 20)); os.write(2, b'e' * (1 << 20)); os.write(1, b'end')"
    result = run_command([sys.executable, "-c", script], timeout=60)
    assert result.ok and not result.truncated
    assert len(result.stdout) == (3 << 20) + 3 and result.stdout.endswith("end")
    assert len(result.stderr) == 1 << 20
    small = run_command([sys.executable, "-c", "print('x' * 100)"], timeout=60, max_output_bytes=10)
    assert small.truncated and small.stdout == "x" * 10 and not small.ok


# A tool that prints its whole answer and exits 0, leaving a daemonized grandchild (its own session, so no
# kill of the tool's process group reaches it) that keeps the tool's stdout and stderr open.
GRANDCHILD_TOOL = textwrap.dedent(
    """
    import os, sys, time
    pids = sys.argv[1]
    child = os.fork()
    if child == 0:
        os.setsid()
        time.sleep(120)
        os._exit(0)
    with open(pids, "a") as fh:
        fh.write(f"{os.getpid()} {child}\\n")
    print("NPU  Name  Health")
    print("0    910B  OK", flush=True)
    sys.exit(0)
    """
)


def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _left_unreaped(pid: int) -> bool:
    """True while `pid` is still a child of ours that nobody reaped (a zombie, once it exited)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return True


@contextlib.contextmanager
def _grandchildren_killed_afterwards(pids_file: Path) -> Iterator[None]:
    """Kill the daemonized grandchildren the tool runs left (the tools themselves are reaped already)."""
    try:
        yield
    finally:
        if pids_file.exists():
            for line in pids_file.read_text().splitlines():
                with contextlib.suppress(ProcessLookupError, ValueError, IndexError):
                    os.kill(int(line.split()[1]), signal.SIGKILL)


def test_a_grandchild_holding_the_pipes_does_not_fail_or_leak(tmp_path: Path) -> None:
    tool = tmp_path / "tool.py"
    tool.write_text(GRANDCHILD_TOOL)
    pids_file = tmp_path / "pids"
    with _grandchildren_killed_afterwards(pids_file):
        run_command(["true"], timeout=10)  # warm up whatever the first run allocates
        fds, threads = _open_fds(), threading.active_count()
        for _ in range(3):
            result = run_command([sys.executable, str(tool), str(pids_file)], timeout=30)
            assert result.ok, result
            assert (result.returncode, result.timed_out, result.truncated) == (0, False, False)
            assert result.stdout == "NPU  Name  Health\n0    910B  OK\n"
        runs = [line.split() for line in pids_file.read_text().splitlines()]
        for tool_pid, grandchild in runs:
            assert not _left_unreaped(int(tool_pid)), f"tool {tool_pid} left a zombie"
            assert Path(f"/proc/{grandchild}").exists(), "the grandchild was expected to outlive the tool"
        assert threading.active_count() == threads
        assert _open_fds() == fds
        assert lingering_commands() == 0


def test_a_tool_that_closes_its_pipes_still_meets_the_deadline(tmp_path: Path) -> None:
    script = "import os, time; os.close(1); os.close(2); time.sleep(60)"
    result = run_command([sys.executable, "-c", script], timeout=0.5)
    assert result.timed_out and result.returncode is None and not result.ok


def test_every_argv_element_is_kept() -> None:
    argv = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))", "-t", "1", "-m", "--", "x y"]
    result = run_command(argv, timeout=30)
    assert result.ok and result.argv == tuple(argv)
    assert json.loads(result.stdout) == ["-t", "1", "-m", "--", "x y"]


@pytest.mark.system
def test_an_nsenter_wrapper_is_run_whole() -> None:
    """The DaemonSet's `[nsenter, -t, 1, -m, --, npu-smi]` form: here into this process's own namespaces."""
    require_root()
    nsenter = require_tool("nsenter")
    script = "import json, sys; print(json.dumps(sys.argv[1:]))"
    argv = [nsenter, "-t", str(os.getpid()), "-m", "--", sys.executable, "-c", script, "info", "-t", "board"]
    result = run_command(argv, timeout=30)
    assert result.ok, result
    assert result.argv == tuple(argv)
    assert json.loads(result.stdout) == ["info", "-t", "board"]
    missing = run_command([nsenter, "-t", str(os.getpid()), "-m", "--", "/nonexistent/npu-smi"], timeout=30)
    assert missing.not_found and not missing.ok


@contextlib.contextmanager
def _many_open_fds(count: int) -> Iterator[list[int]]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count + 256
    if soft < wanted:
        assert hard == resource.RLIM_INFINITY or hard >= wanted, f"RLIMIT_NOFILE hard limit {hard} is below {wanted}"
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    fds: list[int] = []
    try:
        for _ in range(count):
            fds.append(os.open(os.devnull, os.O_RDONLY))
        yield fds
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_children_and_commands_work_with_more_than_1024_fds_open(tmp_path: Path) -> None:
    with _many_open_fds(1100) as fds:
        assert max(fds) > 1024
        calls = ChildCalls()
        result = calls.call("many-fds", statvfs_in_child, str(tmp_path), timeout=10)
        assert result.ok, result.error
        hung = calls.call("many-fds-hang", sleep_in_child, 60, timeout=0.3)
        assert hung.state == "timeout"
        command = run_command([sys.executable, "-c", "print('answer')"], timeout=30)
        assert command.ok and command.stdout == "answer\n"
        assert wait_gone(calls)


def wait_gone(calls: ChildCalls, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while calls.in_flight() and time.monotonic() < end:
        time.sleep(0.05)
    return not calls.in_flight()
