"""Lock walks bounded in entries and time (a scan problem, never MountHung), and lock paths with control
characters escaped wherever they are shown."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
from support.fusefs import fuse_mount
from support.system import fuse_capable, require_root

from agent.config import parse_config
from probes.base import Finding, ProbeContext, Status
from probes.runtime.children import ChildCalls
from probes.runtime.host import Host
from probes.storage.locks import LocksProbe

HOUR = 3600.0


def run_locks(globs: list[str], timeout: float = 20.0, **storage: object) -> dict[str, Finding]:
    settings = {"lock_globs": globs, "container_lock_globs": [], "stale_lock_age_seconds": HOUR, **storage}
    output = LocksProbe().run(ProbeContext(Host(children=ChildCalls()), parse_config({"storage": settings}), timeout))
    return {f.subject: f for f in output if isinstance(f, Finding)}


def aged_lock(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    then = time.time() - 2 * HOUR
    os.utime(path, (then, then))
    return path


def test_a_huge_lock_root_is_an_incomplete_scan_not_a_hung_mount(tmp_path: Path) -> None:
    root = tmp_path / "torch_extensions"
    for index in range(3000):
        (root / f"py311_cpu{index:04d}").mkdir(parents=True)
    glob = f"{root}/*/*/lock"
    finding = run_locks([glob], lock_walk_max_entries=500)[glob]
    assert (finding.status, finding.reason) == (Status.UNKNOWN, "LockScanIncomplete"), finding
    assert "stopped after 500 directory entries" in finding.message
    assert finding.message.endswith("at py311_cpu0500")  # how far it got: entries are walked in sorted order
    assert finding.observed["incomplete"]["why"] == "stopped after 500 directory entries"
    assert run_locks([glob])[glob].status == Status.OK  # within the default budget it walks them all


@pytest.mark.system
def test_a_stale_lock_found_before_the_walk_ran_out_still_fails(tmp_path: Path) -> None:
    require_root()
    root = tmp_path / "torch_extensions"
    lock = aged_lock(root / "a_first" / "ext" / "lock")
    for index in range(600):
        (root / f"b{index:04d}").mkdir()
    glob = f"{root}/*/*/lock"
    finding = run_locks([glob], lock_walk_max_entries=100)[glob]
    assert (finding.status, finding.reason) == (Status.FAIL, "StaleFileBaton"), finding
    assert str(lock) in finding.message and "stopped after 100 directory entries" in finding.message


@pytest.mark.system
def test_a_slow_lock_root_runs_out_of_time_without_looking_hung(tmp_path: Path) -> None:
    """Every lookup and listing of this FUSE filesystem takes 40 ms: walking all of it takes seconds, so the
    walk stops itself at its share of locks_timeout_seconds, while no single call ever hangs."""
    fuse_capable()
    with fuse_mount(tmp_path, "--delay-ms", "40") as mount:
        for index in range(30):
            (mount.path / f"py311_{index:02d}").mkdir()
        glob = f"{mount.path}/*/*/lock"
        started = time.monotonic()
        finding = run_locks([glob], locks_timeout_seconds=1.0)[glob]
        elapsed = time.monotonic() - started
    assert (finding.status, finding.reason) == (Status.UNKNOWN, "LockScanIncomplete"), finding
    assert "stopped after 0.7s" in finding.message and "at py311_" in finding.message
    assert elapsed < 5.0


@pytest.mark.system
def test_control_characters_in_lock_paths_are_escaped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    require_root()
    root = tmp_path / "torch_extensions"
    forged = "ext\n2030-01-01 INFO all locks fine\x1b[2J"
    lock = aged_lock(root / "py311_cpu" / forged / "lock")
    glob = f"{root}/*/*/lock"
    finding = run_locks([glob])[glob]
    assert finding.reason == "StaleFileBaton"
    assert "\n" not in finding.message and "\x1b" not in finding.message
    assert "ext\\x0a2030-01-01 INFO all locks fine\\x1b[2J/lock" in finding.message
    assert finding.observed["stale_local"][0]["path"] == str(lock)  # the data keeps the real name
    with caplog.at_level(logging.WARNING, logger="probes.storage"):
        removed = run_locks([glob], remove_stale_locks=True)[glob]
    assert removed.reason == "StaleLockRemoved" and not lock.exists()
    assert removed.event is not None and "\n" not in removed.event.message
    (record,) = [r for r in caplog.records if "removed stale lock" in r.getMessage()]
    assert "\n" not in record.getMessage() and "\\x0a2030-01-01" in record.getMessage()
