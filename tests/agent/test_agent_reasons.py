"""The findings the agent makes itself carry their declaration's status and fix, the text the reference
documents (docs/troubleshooting.md): WarmingUp, Stale, ProbeTimeout, ProbeError, ParseError,
HbmBelowRequest and HostMemoryBelowRequest, each made the way the agent makes it."""

from __future__ import annotations

import threading
from typing import ClassVar

from agent.config import parse_config
from agent.ready import ReadyQuery, judge
from agent.reasons import HBM_BELOW_REQUEST, HOST_MEM_BELOW_REQUEST, PROBE_ERROR, PROBE_TIMEOUT, STALE, WARMING_UP
from agent.scheduler import Scheduler, build_state, execute
from agent.state import HealthState, ProbeSpec
from probes import base
from probes.base import Check, Finding, Probe, ProbeContext, ProbeOutput, ProbeParseError, Reason, Status
from probes.runtime.host import Host

NPU = Check("npu.hbm")


def documented(finding: Finding, reason: Reason, status: Status | None = None) -> bool:
    return (finding.reason, finding.status, finding.hint) == (reason.code, status or reason.status, reason.hint)


def test_warming_up_and_stale_are_the_declared_ones() -> None:
    now = [1_000_000.0]
    state = HealthState("n", clock=lambda: now[0], monotonic=lambda: now[0])
    state.configure([ProbeSpec("npu", ("npu.hbm",), 10.0, 2.0)])
    (warming,) = state.current().verdict.reasons
    assert documented(warming, WARMING_UP)
    state.record("npu", [NPU.ok("npu0", "fine", device=0)])
    now[0] += 3 * 10.0 + 2.0 + 1.0  # past the limit: 3 intervals and the timeout
    (stale,) = state.current().verdict.reasons
    assert documented(stale, STALE)


def test_the_memory_requests_of_a_job_are_the_declared_ones() -> None:
    state = HealthState("n")
    state.configure([ProbeSpec("npu", ("npu.hbm",), 10.0, 2.0)])
    state.record("npu", [NPU.ok("npu0", "fine", {base.OBSERVED_HBM_FREE_MIB: 1000}, device=0)])
    query = ReadyQuery(min_hbm_free_mib=2000, min_host_mem_mib=1)
    hbm, host = judge(state.current(), query).reasons
    assert documented(hbm, HBM_BELOW_REQUEST)
    assert documented(host, HOST_MEM_BELOW_REQUEST, Status.UNKNOWN), "no host.memory result: unknown"


class Failing(Probe):
    name = "failing"
    checks = ("host.failing",)
    reasons = ()
    raised: ClassVar[Exception] = RuntimeError("boom")

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        raise self.raised


def test_a_probe_that_raises_or_cannot_parse_reports_the_declared_reason() -> None:
    config = parse_config({})
    result, (error,), _ = execute(Failing(), Host(), config, 1.0)
    assert result == "error" and documented(error, PROBE_ERROR)
    Failing.raised = ProbeParseError("a table never seen")
    result, (parse,), _ = execute(Failing(), Host(), config, 1.0)
    assert result == "error" and documented(parse, base.PARSE_ERROR)


class Hanging(Probe):
    name = "hanging"
    checks = ("host.hanging",)
    reasons = ()
    default_timeout = 0.2
    release = threading.Event()

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        self.release.wait(30)
        return []


def test_a_probe_past_its_deadline_reports_the_declared_timeout() -> None:
    config = parse_config({})
    state = build_state(config)
    scheduler = Scheduler({"hanging": Hanging()}, config, Host(), state, one_shot=True)
    try:
        scheduler.run_all_once()
        (timeout,) = state.current().checks  # unknown, so it blocks only a required check
        assert documented(timeout.finding, PROBE_TIMEOUT)
    finally:
        Hanging.release.set()
