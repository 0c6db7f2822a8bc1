"""Fail closed: no probe error, timeout, failed scan or fd exhaustion may turn a failing node ready.

The state rules are tested on HealthState directly; the end-to-end cases run the real agent (scheduler,
state, HTTP) on a real full tmpfs, with the agent's fd numbers past 1023 and with a probe that starts
raising or hanging after it reported a fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from support.system import require_root

from agent.config import parse_config
from agent.daemon import Agent, raise_fd_limit
from agent.reasons import PROBE_ERROR, PROBE_TIMEOUT
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes.base import Check, Finding, Probe, ProbeContext, ProbeOutput, Reason, Status

BROKEN = Reason("Broken", Status.FAIL, "the test's device is broken", "replace it")
DEVICE = Check("host.device")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def make_state(fail: int = 2, recover: int = 2) -> HealthState:
    clock = Clock()
    state = HealthState("n", HealthSettings(fail, recover), clock=clock, monotonic=clock)
    state.configure([ProbeSpec("dev", ("host.device",), 10.0, 2.0)])
    return state


def fail(subject: str = "") -> Finding:
    return DEVICE.report(BROKEN, subject, f"{subject or 'device'} broken")


def ok(subject: str = "") -> Finding:
    return DEVICE.ok(subject, "fine")


def unknown(reason: str = PROBE_ERROR.code, subject: str = "") -> Finding:
    return Finding("host.device", subject, Status.UNKNOWN, reason, f"probe failed: {reason}")


def statuses(state: HealthState) -> dict[str, tuple[str, str, str]]:
    return {c.finding.subject: (c.finding.status.value, c.finding.reason, c.unverified) for c in state.snapshot.checks}


def test_probe_error_and_timeout_never_replace_an_established_fail() -> None:
    state = make_state(fail=1, recover=2)
    state.record("dev", [fail()])
    assert not state.snapshot.ready
    for reason, result in ((PROBE_ERROR.code, "error"), (PROBE_TIMEOUT.code, "timeout"), ("ScanFailed", "ok")):
        state.record("dev", [unknown(reason)], result=result)
        snap = state.snapshot
        assert not snap.ready, f"{reason} made a failing node ready"
        (state_of,) = snap.checks
        assert (state_of.finding.status, state_of.finding.reason) == (Status.FAIL, "Broken")
        assert state_of.unverified.startswith(reason), "the standing fail is marked as unverified"
        assert state_of.to_dict()["unverified"].startswith(reason)
    # Fresh evidence says ok: recovery still needs recovery_threshold consecutive passes.
    state.record("dev", [ok()])
    assert not state.snapshot.ready and statuses(state)[""][2] == ""
    state.record("dev", [ok()])
    assert state.snapshot.ready


def test_an_unknown_result_breaks_a_recovery_streak() -> None:
    state = make_state(fail=1, recover=2)
    state.record("dev", [fail()])
    state.record("dev", [ok()])
    state.record("dev", [unknown()], result="error")
    state.record("dev", [ok()])
    assert not state.snapshot.ready, "ok, unknown, ok is not two consecutive passes"
    state.record("dev", [ok()])
    assert state.snapshot.ready


def test_unknowns_between_failures_neither_count_nor_reset_the_fail_streak() -> None:
    """ok → fail, unknown, fail must enter fail (alternating timeouts cannot keep a failing check out)."""
    state = make_state(fail=2, recover=2)
    state.record("dev", [ok()])
    state.record("dev", [fail()])
    assert state.snapshot.ready
    state.record("dev", [unknown(PROBE_TIMEOUT.code)], result="timeout")
    state.record("dev", [fail()])
    assert not state.snapshot.ready
    assert statuses(state)[""][:2] == ("fail", "Broken")


def test_a_check_wide_unknown_keeps_the_failing_subjects() -> None:
    """A holder scan that fails reports one unknown for the check: the out-of-band holder of npu3 that was
    failing must stay, not disappear because its subject is absent from this run."""
    state = make_state(fail=1, recover=1)
    state.record("dev", [ok("npu0"), fail("npu3")])
    state.record("dev", [unknown("HolderScanFailed")])
    snap = state.snapshot
    assert not snap.ready
    kept = statuses(state)
    assert kept["npu3"][:2] == ("fail", "Broken") and kept["npu3"][2].startswith("HolderScanFailed")
    assert "npu0" not in kept, "a passing subject the run could not judge is not kept"
    # A complete run without npu3 (the holder is gone) is fresh evidence: the subject goes.
    state.record("dev", [ok("npu0")])
    assert state.snapshot.ready and set(statuses(state)) == {"npu0"}


# --- end to end ------------------------------------------------------------------------------------


class FlakyDevice(Probe):
    """Fails, then raises or hangs on demand: a probe whose tool breaks while the device is broken."""

    name = "test.flaky"
    checks = ("host.device",)
    reasons: ClassVar = (BROKEN,)
    default_interval = 0.3
    default_timeout = 0.5
    mode = "fail"
    release = threading.Event()

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        if FlakyDevice.mode == "raise":
            raise RuntimeError("tool crashed")
        if FlakyDevice.mode == "hang":
            FlakyDevice.release.wait(30)
        return [fail()] if FlakyDevice.mode != "ok" else [ok()]


def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_for(predicate: Any, seconds: float = 15.0) -> Any:
    end = time.monotonic() + seconds
    value = predicate()
    while not value and time.monotonic() < end:
        time.sleep(0.1)
        value = predicate()
    return value


@contextlib.contextmanager
def running(config: dict[str, Any], probes: dict[str, type[Probe]]) -> Iterator[Agent]:
    settings = {"http": {"address": "127.0.0.1", "port": 0}, "kubernetes": {"enabled": False}, **config}
    agent = Agent(None, parse_config(settings, probes), no_kube=True, probe_classes=probes)
    agent.start()
    try:
        yield agent
    finally:
        FlakyDevice.release.set()
        agent.shutdown()


@pytest.mark.system
def test_a_probe_that_starts_raising_or_hanging_keeps_the_node_not_ready() -> None:
    FlakyDevice.mode, FlakyDevice.release = "fail", threading.Event()
    config = {"health": {"fail_threshold": 1, "recovery_threshold": 1}}
    with running(config, {"test.flaky": FlakyDevice}) as agent:
        port = agent.http.port
        assert wait_for(lambda: [r["reason"] for r in get(port, "/ready")[1]["reasons"]] == ["Broken"])
        for mode, reason in (("raise", PROBE_ERROR.code), ("hang", PROBE_TIMEOUT.code)):
            FlakyDevice.mode = mode
            seen = wait_for(
                lambda r=reason: next(
                    (c for c in get(port, "/status")[1]["findings"] if c.get("unverified", "").startswith(r)), None
                )
            )
            assert seen and seen["status"] == "fail" and seen["reason"] == "Broken", seen
            for _ in range(5):
                status, body = get(port, "/ready")
                assert status == 503 and [r["reason"] for r in body["reasons"]] == ["Broken"], body
                time.sleep(0.1)
            FlakyDevice.release.set()
            FlakyDevice.release = threading.Event()
        FlakyDevice.mode = "ok"
        assert wait_for(lambda: get(port, "/ready")[0] == 200), "fresh ok results must recover the node"


@pytest.mark.system
def test_disk_full_stays_not_ready_with_agent_fds_past_1023(tmp_path: Path) -> None:
    """~1,100 connections from any pod used to push the agent's fd numbers past 1023: every probe that runs
    a child raised "filedescriptor out of range in select()" and a DiskFull node answered ready. Here the
    agent's own process holds 1,100 extra descriptors while storage.space judges a really full tmpfs."""
    require_root()
    raise_fd_limit()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft >= 2048, f"raise_fd_limit left RLIMIT_NOFILE at {soft}"
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)], check=True)
    held: list[int] = []
    try:
        with contextlib.suppress(OSError), open(full / "fill", "wb") as handle:
            handle.write(b"x" * (2 << 20))
        while len(held) < 1100:
            held.extend(os.pipe())
        assert max(held) > 1023
        from probes import all_probes

        probes = {"storage.space": all_probes()["storage.space"]}
        config = {
            "storage": {"space": [{"path": str(full)}]},
            "probes": {"storage.space": {"interval_seconds": 0.5, "timeout_seconds": 5}},
            "health": {"fail_threshold": 1},
        }
        with running(config, probes) as agent:
            port = agent.http.port
            reasons = wait_for(lambda: [r["reason"] for r in get(port, "/ready")[1]["reasons"]] == ["DiskFull"])
            assert reasons, get(port, "/status")[1]["findings"]
            for _ in range(6):
                status, body = get(port, "/ready")
                assert status == 503, body
                assert [r["reason"] for r in body["reasons"]] == ["DiskFull"], body
                time.sleep(0.5)
            findings = get(port, "/status")[1]["findings"]
            assert all(f["reason"] != PROBE_ERROR.code for f in findings), findings
    finally:
        for fd in held:
            os.close(fd)
        subprocess.run(["umount", "-l", str(full)], check=False)
