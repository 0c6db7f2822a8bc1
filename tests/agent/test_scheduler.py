"""The health settings reach the state one way, through the Scheduler: the config's thresholds for the daemon,
1/1 for a one-shot run (`node-health check`), and a reloaded config's from the reload on."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest

from agent.cli import run_check
from agent.config import Config, parse_config
from agent.scheduler import Scheduler, build_state
from agent.state import HealthSettings, HealthState
from probes.base import Check, Probe, ProbeContext, ProbeOutput, Reason, Status
from probes.runtime.host import Host

BROKEN = Reason("Broken", Status.FAIL, "the test's device is broken", "replace it")
DEVICE = Check("host.device")


class Flipping(Probe):
    """Reports what the test queued for its next run: fail or ok."""

    name = "device"
    checks = ("host.device",)
    reasons = (BROKEN,)
    queued: ClassVar[list[Status]] = []

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        if self.queued.pop(0) == Status.FAIL:
            return [DEVICE.report(BROKEN, "", "broken")]
        return [DEVICE.ok("", "fine")]


def config(**health: Any) -> Config:
    return parse_config({"health": health})


def scheduled(settings: Config, one_shot: bool) -> tuple[Scheduler, HealthState]:
    state = build_state(settings)
    return Scheduler({"device": Flipping()}, settings, Host(), state, one_shot=one_shot), state


def runs(scheduler: Scheduler, state: HealthState, *statuses: Status) -> list[tuple[str, str]]:
    """(effective status, pending) of host.device after each run."""
    seen = []
    for status in statuses:
        Flipping.queued.append(status)
        scheduler.run_all_once()
        (check,) = state.current().checks
        seen.append((check.finding.status.value, check.pending))
    return seen


def test_a_one_shot_run_is_judged_on_its_own_result_whatever_the_config_thresholds() -> None:
    scheduler, state = scheduled(config(fail_threshold=3, recovery_threshold=3), one_shot=True)
    assert state.settings == HealthSettings(fail_threshold=1, recovery_threshold=1)
    # Each run enters and leaves fail at once: no "fail 1/3" carried into the verdict of a one-shot check.
    assert runs(scheduler, state, Status.OK, Status.FAIL, Status.OK) == [("ok", ""), ("fail", ""), ("ok", "")]


def test_the_daemon_judges_by_the_config_and_a_reload_changes_it() -> None:
    scheduler, state = scheduled(config(fail_threshold=2, recovery_threshold=2, required_checks=["host"]), False)
    assert state.settings == HealthSettings(2, 2, 3.0, ("host",))
    assert state.current().required == ("host",)
    assert runs(scheduler, state, Status.OK, Status.FAIL, Status.FAIL) == [("ok", ""), ("ok", "fail 1/2"), ("fail", "")]
    scheduler.reconfigure(config(fail_threshold=1, recovery_threshold=3))
    assert state.settings == HealthSettings(1, 3)
    assert runs(scheduler, state, Status.OK, Status.OK, Status.OK) == [
        ("fail", "ok 1/3"),
        ("fail", "ok 2/3"),
        ("ok", ""),
    ]


def test_node_health_check_reports_the_config_required_checks_and_a_failing_probe() -> None:
    Flipping.queued.append(Status.FAIL)
    snapshot = run_check(config(fail_threshold=5, required_checks=["host.device"]), {"device": Flipping}, None)
    assert snapshot.required == ("host.device",)
    assert [(r.check, r.reason) for r in snapshot.verdict.reasons] == [("host.device", "Broken")]


class Slow(Probe):
    """Takes a moment, so that the one-shot waits on it while the quick probe's worker records its result."""

    name = "slow"
    checks = ("host.slow",)
    reasons = ()

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        time.sleep(0.3)
        return [Check("host.slow").ok("", "done")]


def test_a_one_shot_waits_for_every_result_to_be_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker lets go of its slot before it records its result; a one-shot that waited on the slot returned
    with a finished probe still WarmingUp (pcie under a loaded CPU). Recording is made slow here: every result is
    in the state when run_all_once returns, whatever the timing."""
    settings = config()
    state = build_state(settings)
    record = state.record

    def slow_record(name: str, *args: Any, **kwargs: Any) -> None:
        if name == "device":  # done at once, and slow to record: the one-shot must wait for it still
            time.sleep(1.0)
        record(name, *args, **kwargs)

    monkeypatch.setattr(state, "record", slow_record)
    Flipping.queued[:] = [Status.OK]
    scheduler = Scheduler({"slow": Slow(), "device": Flipping()}, settings, Host(), state, one_shot=True)
    scheduler.run_all_once()
    found = {s.finding.check: s.finding.reason for s in state.current().checks}
    assert found == {"host.slow": "OK", "host.device": "OK"}, found
