"""node-health diagnose: real Python children in known states, dumped with the real py-spy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.pyprocs import BUSY, FILE_BATON, IDLE_LOOP, SOCKET_READ, SOFT_LOCK_POLL, child
from support.system import REPO, require_root, require_tool

from agent.diagnose import format_diagnosis, main_diagnose
from probes.runtime.pyspy import (
    BLOCKED_IO,
    FILEBATON_WAIT,
    IDLE_EVENT_LOOP,
    LOCK_WAIT,
    REASON_FILEBATON,
    RUNNING,
    Diagnosis,
    classify_stack,
    diagnose,
    parse_py_spy_json,
    waiting_on_lock,
)


def diagnose_until(pid: int, kind: str, tries: int = 20) -> Diagnosis:
    """The child prints "ready" just before it enters the state: retry briefly until py-spy sees it there."""
    result = diagnose(pid, 10)
    for _ in range(tries):
        if result.kind == kind:
            break
        time.sleep(0.1)
        result = diagnose(pid, 10)
    return result


@pytest.fixture
def py_spy() -> str:
    require_root()  # py-spy needs ptrace rights over the child (CAP_SYS_PTRACE)
    return require_tool("py-spy")


@pytest.mark.system
def test_filebaton_wait_names_the_lock_path(py_spy: str, tmp_path: Path) -> None:
    build_directory = tmp_path / "torch_extensions" / "py311_cpu" / "fused_adam"
    build_directory.mkdir(parents=True)
    (build_directory / "lock").touch()  # left behind by a killed build
    with child(FILE_BATON, "jit", str(build_directory)) as proc:
        result = diagnose_until(proc.pid, FILEBATON_WAIT)
        assert result.kind == FILEBATON_WAIT, format_diagnosis(result)
        assert result.lock_path == str(build_directory / "lock")
        assert result.reason == REASON_FILEBATON
        assert "FileBaton.wait" in result.detail and "_jit_compile" in result.detail
        text = format_diagnosis(result)
        assert f"rm {build_directory / 'lock'}" in text
        assert "FileBaton.wait" in text and "_jit_compile" in text and "build_directory" in text
        main_thread = result.threads[0]
        assert not main_thread.active
        assert main_thread.frames[0].name == "FileBaton.wait"
        assert waiting_on_lock(proc.pid, 10) == str(build_directory / "lock")


@pytest.mark.system
def test_filebaton_wait_without_visible_path(py_spy: str, tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    with child(FILE_BATON, "bare", str(lock)) as proc:
        result = diagnose_until(proc.pid, FILEBATON_WAIT)
        assert result.kind == FILEBATON_WAIT
        # bare_wait's local `lock` is a lock path: found among the callers' string locals
        assert result.lock_path == str(lock)


@pytest.mark.system
def test_soft_lock_poll_is_a_lock_wait(py_spy: str, tmp_path: Path) -> None:
    lock = tmp_path / "model.safetensors.lock"
    lock.touch()
    with child(SOFT_LOCK_POLL, str(lock)) as proc:
        result = diagnose_until(proc.pid, LOCK_WAIT)
        assert result.kind == LOCK_WAIT, format_diagnosis(result)
        assert result.lock_path == str(lock)
        assert waiting_on_lock(proc.pid, 10) == str(lock)


@pytest.mark.system
def test_idle_event_loop(py_spy: str) -> None:
    with child(IDLE_LOOP) as proc:
        result = diagnose_until(proc.pid, IDLE_EVENT_LOOP)
        assert result.kind == IDLE_EVENT_LOOP, format_diagnosis(result)
        assert "engine core may be hung" in result.detail
        assert result.reason is None and result.lock_path is None
        assert "BaseEventLoop._run_once" in format_diagnosis(result)
        assert waiting_on_lock(proc.pid, 10) is None


@pytest.mark.system
def test_blocked_in_socket_read(py_spy: str) -> None:
    with child(SOCKET_READ) as proc:
        result = diagnose_until(proc.pid, BLOCKED_IO)
        assert result.kind == BLOCKED_IO, format_diagnosis(result)
        assert "socket" in result.detail  # from the kernel wait channel: recv() is no Python frame
        assert result.threads[0].kernel_state == "S"


@pytest.mark.system
def test_running(py_spy: str) -> None:
    with child(BUSY) as proc:
        result = diagnose_until(proc.pid, RUNNING)
        assert result.kind == RUNNING, format_diagnosis(result)
        assert "spin" in result.detail


@pytest.mark.system
def test_main_diagnose_json_and_exit_codes(py_spy: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build_directory = tmp_path / "ext"
    build_directory.mkdir()
    (build_directory / "lock").touch()
    with child(FILE_BATON, "jit", str(build_directory)) as proc:
        diagnose_until(proc.pid, FILEBATON_WAIT)
        capsys.readouterr()
        assert main_diagnose(proc.pid, as_json=True) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["kind"] == FILEBATON_WAIT and doc["reason"] == REASON_FILEBATON
        assert doc["lock_path"] == str(build_directory / "lock")
        assert doc["threads"][0]["frames"][0]["name"] == "FileBaton.wait"
        assert main_diagnose(proc.pid, as_json=False) == 0
        assert "filebaton_wait" in capsys.readouterr().out


def _free_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid  # reaped: nothing has this pid until the kernel reuses it


def test_main_diagnose_missing_process_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_diagnose(_free_pid(), as_json=False) == 1
    assert "no process" in capsys.readouterr().err
    assert main_diagnose(0, as_json=False) == 2
    assert main_diagnose(-5, as_json=True) == 2


@pytest.mark.system
def test_not_a_python_process(py_spy: str) -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        result = diagnose(proc.pid, 10)
        assert result.kind == "error" and "py-spy failed" in result.error
        assert main_diagnose(proc.pid, as_json=False) == 1
    finally:
        proc.kill()
        proc.wait()


def test_py_spy_missing() -> None:
    result = diagnose(os.getpid(), 5, py_spy="/nonexistent/py-spy")
    assert result.kind == "error" and "not found" in result.error


# --- classification as a pure function, on py-spy's JSON shape ------------------------------------------


def _frame(name: str, filename: str, **locals_: str) -> dict[str, object]:
    return {
        "name": name,
        "filename": filename,
        "module": None,
        "short_filename": filename.rsplit("/", 1)[-1],
        "line": 10,
        "locals": [{"name": k, "addr": 1, "arg": True, "repr": v} for k, v in locals_.items()],
        "is_entry": False,
        "is_shim_entry": False,
    }


def _thread(frames: list[dict[str, object]], active: bool = False, name: str = "MainThread") -> dict[str, object]:
    return {
        "pid": 1,
        "thread_id": 1,
        "thread_name": name,
        "os_thread_id": 1,
        "active": active,
        "owns_gil": False,
        "frames": frames,
        "process_info": None,
    }


def test_classify_unqualified_torch_frame_names() -> None:
    # Python < 3.11 targets: frame names are not qualified; the file tells FileBaton.wait apart.
    site = "/usr/lib/python3.10/site-packages/torch"
    threads = [
        _thread(
            [
                _frame("wait", f"{site}/utils/file_baton.py", self="<FileBaton at 0x7f>"),
                _frame("_jit_compile", f"{site}/utils/cpp_extension.py", build_directory='"/root/.cache/x/ext"'),
                _frame("load", f"{site}/utils/cpp_extension.py"),
            ]
        )
    ]
    kind, detail = classify_stack(threads)
    assert kind == FILEBATON_WAIT and "/root/.cache/x/ext/lock" in detail
    # An unrelated `wait` (threading.Event.wait) is not a baton.
    kind, _ = classify_stack([_thread([_frame("wait", "/usr/lib/python3.10/threading.py")])])
    assert kind != FILEBATON_WAIT


def test_classify_filelock_acquire() -> None:
    threads = [
        _thread(
            [
                _frame(
                    "BaseFileLock.acquire",
                    "/venv/lib/python3.11/site-packages/filelock/_api.py",
                    lock_filename='"/root/.cache/huggingface/hub/.locks/models--x/abc.lock"',
                ),
                _frame("snapshot_download", "/venv/lib/python3.11/site-packages/huggingface_hub/_snapshot_download.py"),
            ]
        )
    ]
    kind, detail = classify_stack(threads)
    assert kind == LOCK_WAIT
    assert "/root/.cache/huggingface/hub/.locks/models--x/abc.lock" in detail


def test_classify_loop_with_a_running_thread_is_running() -> None:
    loop = [
        _frame("EpollSelector.select", "/usr/lib/python3.11/selectors.py"),
        _frame("BaseEventLoop._run_once", "/usr/lib/python3.11/asyncio/base_events.py"),
    ]
    assert classify_stack([_thread(loop)])[0] == IDLE_EVENT_LOOP
    worker = _thread([_frame("forward", "/app/model.py")], active=True, name="worker")
    assert classify_stack([_thread(loop), worker])[0] == RUNNING


def test_parse_rejects_other_json() -> None:
    with pytest.raises(ValueError):
        parse_py_spy_json('{"not": "a dump"}')
    with pytest.raises(ValueError):
        parse_py_spy_json("[{}]")
    with pytest.raises(ValueError):
        parse_py_spy_json("not json")


@pytest.mark.system
def test_cli_diagnose_end_to_end(py_spy: str, tmp_path: Path) -> None:
    build_directory = tmp_path / "ext"
    build_directory.mkdir()
    (build_directory / "lock").touch()
    repo = REPO
    with child(FILE_BATON, "jit", str(build_directory)) as proc:
        diagnose_until(proc.pid, FILEBATON_WAIT)
        done = subprocess.run(
            [sys.executable, "-m", "agent.cli", "diagnose", str(proc.pid), "--json"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert doc["kind"] == FILEBATON_WAIT and doc["lock_path"] == str(build_directory / "lock")
    bad = subprocess.run(
        [sys.executable, "-m", "agent.cli", "diagnose", "nope"], cwd=repo, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2
