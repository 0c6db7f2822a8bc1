"""HealthState: hysteresis, warm-up, freshness, required checks, device filters."""

from __future__ import annotations

from agent.ready import ReadyQuery, judge, matches_any
from agent.reasons import HBM_BELOW_REQUEST, STALE, WARMING_UP
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes.base import OBSERVED_HBM_FREE_MIB, Finding, Status


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def wall(self) -> float:
        return self.now

    def mono(self) -> float:
        return self.now


def make_state(clock: Clock, fail: int = 2, recover: int = 2, required: tuple[str, ...] = ()) -> HealthState:
    state = HealthState("node-a", HealthSettings(fail, recover, 3.0, required), clock=clock.wall, monotonic=clock.mono)
    state.configure([ProbeSpec("disk", ("storage.space",), 10.0, 2.0), ProbeSpec("mem", ("host.memory",), 10.0, 2.0)])
    return state


def f(check: str, status: Status, reason: str = "OK", subject: str = "", **kw) -> Finding:
    return Finding(check, subject, status, reason, f"{check} {reason}", "do something" if reason != "OK" else "", **kw)


def test_unknown_until_first_result_then_ready() -> None:
    clock = Clock()
    state = make_state(clock)
    snap = state.snapshot
    assert not snap.ready
    assert {r.reason for r in snap.verdict.reasons} == {WARMING_UP.code}
    state.record("disk", [f("storage.space", Status.OK, subject="/")])
    assert not state.snapshot.ready  # host.memory has not run yet
    state.record("mem", [f("host.memory", Status.OK)])
    assert state.snapshot.ready
    assert state.snapshot.version > snap.version


def test_first_failure_is_reported_at_once_then_hysteresis_both_ways() -> None:
    clock = Clock()
    state = make_state(clock, fail=2, recover=3)
    state.record("mem", [f("host.memory", Status.OK)])
    state.record("disk", [f("storage.space", Status.OK, subject="/")])
    assert state.snapshot.ready
    state.record("disk", [f("storage.space", Status.FAIL, "DiskFull", subject="/")])
    snap = state.snapshot
    assert snap.ready, "one failure must not enter fail with fail_threshold=2"
    assert snap.checks[1].pending == "fail 1/2" or any(c.pending == "fail 1/2" for c in snap.checks)
    state.record("disk", [f("storage.space", Status.FAIL, "DiskFull", subject="/")])
    snap = state.snapshot
    assert not snap.ready
    assert [r.reason for r in snap.verdict.reasons] == ["DiskFull"]
    assert snap.verdict.reasons[0].hint
    for _ in range(2):
        state.record("disk", [f("storage.space", Status.OK, subject="/")])
        assert not state.snapshot.ready, "recovery needs 3 passes"
    state.record("disk", [f("storage.space", Status.OK, subject="/")])
    assert state.snapshot.ready
    assert state.snapshot.problem_counts == {"DiskFull": 1}


def test_a_failing_first_result_is_not_hidden_by_hysteresis() -> None:
    clock = Clock()
    state = make_state(clock, fail=5)
    state.record("mem", [f("host.memory", Status.FAIL, "HostMemoryLow")])
    assert [r.reason for r in state.snapshot.verdict.reasons if r.check == "host.memory"] == ["HostMemoryLow"]


def test_interrupted_failure_streak_starts_over() -> None:
    clock = Clock()
    state = make_state(clock, fail=2)
    state.record("mem", [f("host.memory", Status.OK)])
    state.record("mem", [f("host.memory", Status.FAIL, "HostMemoryLow")])
    state.record("mem", [f("host.memory", Status.OK)])
    state.record("mem", [f("host.memory", Status.FAIL, "HostMemoryLow")])
    mem = next(c for c in state.snapshot.checks if c.finding.check == "host.memory")
    assert mem.finding.status == Status.OK


def test_results_go_stale_after_three_intervals_even_without_a_refresh() -> None:
    clock = Clock()
    state = make_state(clock)
    state.record("mem", [f("host.memory", Status.OK)])
    state.record("disk", [f("storage.space", Status.OK, subject="/")])
    snap = state.snapshot
    assert state.current() is snap and snap.ready
    clock.now += 3 * 10.0 + 2.0 + 0.5
    aged = state.current()  # the scheduler published nothing: readers still see staleness
    assert state.snapshot is snap, "nothing was published"
    assert not aged.ready and aged.aged and aged.version == snap.version
    assert {r.reason for r in aged.verdict.reasons} == {STALE.code}
    assert state.refresh()
    assert not state.snapshot.ready


def test_unknown_blocks_only_required_checks() -> None:
    clock = Clock()
    state = make_state(clock, required=("storage",))
    state.record("mem", [f("host.memory", Status.UNKNOWN, "ProbeError")])
    state.record("disk", [f("storage.space", Status.OK, subject="/")])
    assert state.snapshot.ready
    state.record("disk", [f("storage.space", Status.UNKNOWN, "ProbeTimeout", subject="")], result="timeout")
    snap = state.snapshot
    assert not snap.ready
    # The timeout replaced the per-subject result: "/" is now unknown too, not left at its old ok.
    assert {(c.finding.subject, c.finding.status) for c in snap.checks if c.finding.check == "storage.space"} == {
        ("/", Status.UNKNOWN)
    }


def test_vanished_subjects_and_removed_probes_leave_nothing_behind() -> None:
    clock = Clock()
    state = make_state(clock)
    state.record("disk", [f("storage.space", Status.OK, subject="/"), f("storage.space", Status.OK, subject="/d")])
    state.record("disk", [f("storage.space", Status.OK, subject="/")])
    assert [c.finding.subject for c in state.snapshot.checks if c.finding.check == "storage.space"] == ["/"]
    state.configure([ProbeSpec("mem", ("host.memory",), 10.0, 2.0)])
    assert all(c.finding.check == "host.memory" for c in state.snapshot.checks)


def test_checks_devices_and_min_hbm_filters() -> None:
    clock = Clock()
    state = HealthState("n", HealthSettings(1, 1), clock=clock.wall, monotonic=clock.mono)
    state.configure([ProbeSpec("npu", ("npu.hbm", "npu.health"), 10.0, 2.0), ProbeSpec("mem", ("host.memory",), 10, 2)])
    state.record("mem", [f("host.memory", Status.OK)])
    state.record(
        "npu",
        [
            f("npu.health", Status.FAIL, "NpuHealthAlarm", subject="npu1", device=1),
            f("npu.health", Status.OK, subject="npu0", device=0),
            f("npu.hbm", Status.OK, subject="npu0", device=0, observed={OBSERVED_HBM_FREE_MIB: 1000}),
            f("npu.hbm", Status.OK, subject="npu1", device=1, observed={OBSERVED_HBM_FREE_MIB: 60000}),
        ],
    )
    snap = state.snapshot
    assert not snap.ready
    assert judge(snap, ReadyQuery(device_indices=frozenset({0}))).ready
    assert not judge(snap, ReadyQuery(device_indices=frozenset({1}))).ready
    assert judge(snap, ReadyQuery(checks=("host",))).ready
    assert not judge(snap, ReadyQuery(checks=("npu",))).ready
    verdict = judge(snap, ReadyQuery(device_indices=frozenset({0}), min_hbm_free_mib=2000))
    assert not verdict.ready
    assert [r.reason for r in verdict.reasons] == [HBM_BELOW_REQUEST.code]
    assert verdict.reasons[0].hint == HBM_BELOW_REQUEST.hint, "the fix given is the documented one"
    assert judge(snap, ReadyQuery(device_indices=frozenset({0}), min_hbm_free_mib=500)).ready


def test_selector_matching() -> None:
    assert matches_any("storage.locks", ["storage"])
    assert matches_any("storage.locks", ["storage.locks"])
    assert not matches_any("storage.locksmith", ["storage.locks"])
    assert matches_any("pcie.aer", ["host"])  # pcie falls in the host category
    assert not matches_any("npu.hbm", ["network", "time"])
