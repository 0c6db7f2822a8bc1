"""Host access: hard deadlines that kill whole process groups; children with at most one in flight per key."""

from __future__ import annotations

import errno
import os
import sys
import time

from probes.runtime.host import ChildCalls, run_command, statvfs_in_child


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
