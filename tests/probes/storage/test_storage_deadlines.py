"""Deadlines that fit: many real hung FUSE mounts, each item's deadline clamped to what the probe run has
left, all items checked side by side, so N hung items give N specific findings inside the probe's
deadline, every run, and a probe deadline shorter than an item's gives that item's finding, not an opaque
ProbeTimeout."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fusefs import FuseMount, fuse_mount
from support.system import fuse_capable, wait_reaped

from agent.config import parse_config
from agent.scheduler import execute
from probes.base import Finding, Probe, Status
from probes.runtime.children import ChildCalls
from probes.runtime.host import Host
from probes.storage.locks import LocksProbe
from probes.storage.model_cache import ModelCacheProbe
from probes.storage.mounts import MountsProbe
from probes.storage.write import WriteProbe

HUNG = 20


# The children each test left stuck on the hung mounts: reaped once the daemons are gone.
STUCK: list[ChildCalls] = []


def stuck_host() -> Host:
    children = ChildCalls()
    STUCK.append(children)
    return Host(children=children)


@pytest.fixture(scope="module")
def hung_mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[FuseMount]]:
    """Twenty FUSE filesystems that never answer a stat or lookup (each its own daemon)."""
    fuse_capable()
    base = tmp_path_factory.mktemp("hung")
    with contextlib.ExitStack() as stack:
        mounts = []
        for index in range(HUNG):
            parent = base / f"m{index:02d}"
            parent.mkdir()
            mounts.append(stack.enter_context(fuse_mount(parent, "--hang-getattr")))
        yield mounts
    # Killing the daemons aborted their connections: every stuck child ends and is reaped.
    assert all(wait_reaped(children) == {} for children in STUCK)


def run(probe: Probe, host: Host, storage: dict[str, object], timeout: float) -> tuple[str, list[Finding], float]:
    """One run as the scheduler runs it (execute: ctx deadline = timeout); its result and how long it took."""
    config = parse_config({"storage": storage})
    started = time.monotonic()
    result, findings, _ = execute(probe, host, config, timeout)
    return result, findings, time.monotonic() - started


def assert_all_hung(findings: list[Finding], subjects: list[str]) -> None:
    by_subject = {finding.subject: finding for finding in findings}
    assert sorted(by_subject) == sorted(subjects), by_subject
    for subject in subjects:
        finding = by_subject[subject]
        assert (finding.status, finding.reason) == (Status.FAIL, "MountHung"), finding


@pytest.mark.system
def test_twenty_hung_mounts_give_twenty_mount_hung_within_the_deadline_every_run(
    hung_mounts: list[FuseMount],
) -> None:
    host = stuck_host()
    probe = MountsProbe()
    paths = [str(mount.path) for mount in hung_mounts]
    storage = {"mounts": [{"path": path, "fstype": "fuse"} for path in paths], "mount_timeout_seconds": 5}
    for cycle in range(3):
        result, findings, elapsed = run(probe, host, storage, timeout=10.0)
        assert result == "ok"
        assert_all_hung(findings, paths)
        assert elapsed < 10.0, f"cycle {cycle}: {elapsed:.1f}s, past the probe's 10 s deadline"
        if cycle:
            assert all("still stuck" in finding.message for finding in findings)


@pytest.mark.system
def test_a_probe_deadline_shorter_than_the_mount_timeout_still_names_each_hung_mount(
    hung_mounts: list[FuseMount],
) -> None:
    host = stuck_host()
    paths = [str(mount.path) for mount in hung_mounts]
    storage = {"mounts": [{"path": path, "fstype": "fuse"} for path in paths], "mount_timeout_seconds": 5}
    result, findings, elapsed = run(MountsProbe(), host, storage, timeout=2.0)
    assert result == "ok" and elapsed < 2.0, elapsed
    assert_all_hung(findings, paths)
    # Each child got what the run had left (less a reserve for building the findings), not the 5 s configured.
    for finding in findings:
        waited = float(re.search(r"no answer within ([0-9.]+)s", finding.message).group(1))
        assert 1.0 < waited < 2.0, finding.message


@pytest.mark.system
def test_write_probes_on_twenty_hung_mounts(hung_mounts: list[FuseMount]) -> None:
    host = stuck_host()
    paths = [str(mount.path) for mount in hung_mounts]
    storage = {"write_probes": [{"path": path} for path in paths], "write_timeout_seconds": 10}
    result, findings, elapsed = run(WriteProbe(), host, storage, timeout=3.0)
    assert result == "ok" and elapsed < 3.0, elapsed
    assert_all_hung(findings, paths)


@pytest.mark.system
def test_model_caches_on_twenty_hung_mounts(hung_mounts: list[FuseMount]) -> None:
    host = stuck_host()
    specs = [{"cache_dir": str(mount.path), "repo_id": "org/model"} for mount in hung_mounts]
    storage = {"model_caches": specs, "model_cache_timeout_seconds": 10}
    result, findings, elapsed = run(ModelCacheProbe(), host, storage, timeout=3.0)
    assert result == "ok" and elapsed < 3.0, elapsed
    assert_all_hung(findings, [f"{spec['cache_dir']}:org/model@main" for spec in specs])


@pytest.mark.system
def test_lock_roots_on_twenty_hung_mounts(hung_mounts: list[FuseMount]) -> None:
    host = stuck_host()
    globs = [f"{mount.path}/*/lock" for mount in hung_mounts]
    storage = {"lock_globs": globs, "container_lock_globs": [], "locks_timeout_seconds": 5}
    result, findings, elapsed = run(LocksProbe(), host, storage, timeout=3.0)
    assert result == "ok" and elapsed < 3.0, elapsed
    assert_all_hung(findings, globs)


@pytest.mark.system
def test_items_left_no_time_are_named_not_guessed(tmp_path: Path) -> None:
    """A run whose deadline is spent before an item could start says so for that item (unknown), never
    MountHung for a filesystem nobody asked."""
    fuse_capable()
    with fuse_mount(tmp_path) as mount:
        storage = {"mounts": [{"path": str(mount.path), "fstype": "fuse"}]}
        result, findings, _ = run(MountsProbe(), Host(children=ChildCalls()), storage, timeout=0.1)
    (finding,) = findings
    assert result == "ok" and (finding.status, finding.reason) == (Status.UNKNOWN, "DeadlineExhausted"), finding
    assert str(mount.path) in finding.message
