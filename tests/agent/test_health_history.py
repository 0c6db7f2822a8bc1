"""The health history: each change of a check's effective status and of the node's readiness is one transition in
the snapshot (a ring /status shows) and one log line (JSON under `logging.format: json`), rate-limited per check.
The unit tests drive HealthState with a clock of their own; the system test runs a real agent process whose
storage.space path the test removes and creates again, and reads its log and /status over HTTP."""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.processes import stop
from support.system import REPO

from agent.logs import HEALTH_LOGGER, HealthLog, JsonFormatter, TextFormatter
from agent.state import HISTORY_MAX, HealthSettings, HealthState, ProbeSpec
from probes import all_probes
from probes.base import Finding, Status

CLI = [sys.executable, "-m", "agent.cli"]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def wall(self) -> float:
        return self.now

    def mono(self) -> float:
        return self.now


def finding(status: Status, reason: str = "OK", subject: str = "/data") -> Finding:
    return Finding("storage.space", subject, status, reason, f"{subject}: {reason}", "")


def make_state(clock: Clock) -> HealthState:
    state = HealthState("node-a", HealthSettings(1, 1, 3.0, ()), clock=clock.wall, monotonic=clock.mono)
    state.configure([ProbeSpec("disk", ("storage.space",), 100.0, 2.0)])  # nothing goes stale here
    return state


class Captured:
    """A HealthLog writing through a real logger into a buffer, in the text or the JSON format."""

    def __init__(self, fmt: str, clock: Clock, lines: int = 5, window: float = 60.0) -> None:
        self.buffer = io.StringIO()
        handler = logging.StreamHandler(self.buffer)
        handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
        self.logger = logging.getLogger(f"{HEALTH_LOGGER}.test{id(self)}")
        self.logger.propagate = False
        self.logger.addHandler(handler)
        self.logger.setLevel(logging.INFO)
        self.sink = HealthLog(self.logger, lines, window, clock.mono)

    def lines(self) -> list[str]:
        return self.buffer.getvalue().splitlines()


def test_a_change_and_readiness_are_transitions_in_the_snapshot_and_the_log() -> None:
    clock = Clock()
    state = make_state(clock)
    log = Captured("json", clock)
    state.add_sink(log.sink)
    state.record("disk", [finding(Status.OK)])  # a first ok result: no check transition, readiness is one
    clock.now += 10
    state.record("disk", [finding(Status.FAIL, "PathMissing")])
    clock.now += 10
    state.record("disk", [finding(Status.OK)])

    changes = [(t.kind, t.before, t.after, t.reason) for t in state.current().transitions]
    assert changes == [
        ("readiness", "not ready", "ready", ""),
        ("check", "ok", "fail", "PathMissing"),
        ("readiness", "ready", "not ready", "PathMissing"),
        ("check", "fail", "ok", "OK"),
        ("readiness", "not ready", "ready", ""),
    ]
    status = state.current().to_document(history=True)["transitions"]
    assert status[1] == {
        "at": "1970-01-12T13:46:50.000Z",
        "kind": "check",
        "check": "storage.space",
        "subject": "/data",
        "from": "ok",
        "to": "fail",
        "reason": "PathMissing",
        "message": "/data: PathMissing",
    }
    assert status[2]["message"] == "storage.space /data PathMissing: /data: PathMissing"
    records = [json.loads(line) for line in log.lines()]
    assert [(r["event"], r["level"], r["from"], r["to"]) for r in records] == [
        ("readiness_transition", "info", "not ready", "ready"),
        ("check_transition", "warning", "ok", "fail"),
        ("readiness_transition", "warning", "ready", "not ready"),
        ("check_transition", "info", "fail", "ok"),
        ("readiness_transition", "info", "not ready", "ready"),
    ]
    assert records[1]["msg"] == "health: check storage.space /data: ok -> fail (PathMissing: /data: PathMissing)"
    assert records[2]["msg"] == "health: node ready -> not ready (storage.space /data PathMissing: /data: PathMissing)"
    assert "check_transition" not in json.dumps(state.current().to_document())  # only /status carries the history


def test_a_subject_that_goes_away_while_failing_is_a_transition_to_gone() -> None:
    clock = Clock()
    state = make_state(clock)
    state.record("disk", [finding(Status.FAIL, "PathMissing", "/a"), finding(Status.OK, subject="/b")])
    state.record("disk", [finding(Status.OK, subject="/b")])
    last = state.current().transitions[-2]
    assert (last.subject, last.before, last.after) == ("/a", "fail", "gone")


def test_the_ring_keeps_the_last_transitions() -> None:
    clock = Clock()
    state = make_state(clock)
    for n in range(HISTORY_MAX * 2):
        clock.now += 1
        state.record("disk", [finding(Status.FAIL if n % 2 == 0 else Status.OK, "PathMissing" if n % 2 == 0 else "OK")])
    transitions = state.current().transitions
    assert len(transitions) == HISTORY_MAX
    assert transitions[-1].at == clock.now and transitions == tuple(sorted(transitions, key=lambda t: t.at))


def test_a_flapping_check_is_rate_limited_then_summarised_with_where_it_ended() -> None:
    clock = Clock()
    state = make_state(clock)
    log = Captured("text", clock, lines=3, window=60.0)
    state.add_sink(log.sink)
    for n in range(20):  # 20 check transitions and 19 readiness ones (it starts not ready) in 20 s
        clock.now += 1
        state.record("disk", [finding(Status.FAIL if n % 2 == 0 else Status.OK, "PathMissing" if n % 2 == 0 else "OK")])
    lines = log.lines()
    assert len(lines) == 6, lines  # 3 of the check's, 3 of readiness
    clock.now += 61
    state.refresh()  # the scheduler's tick: the windows are over
    summaries = log.lines()[6:]
    assert len(summaries) == 2, summaries
    assert any(
        re.search(r"check storage.space /data: suppressed 17 transitions in 60s; now ok \(OK: ", s) for s in summaries
    )
    assert any(s.endswith("readiness: suppressed 16 transitions in 60s; now ready") for s in summaries)
    clock.now += 1
    state.record("disk", [finding(Status.FAIL, "PathMissing")])  # a new window: logged again
    assert "ok -> fail" in log.lines()[-2]


def test_tenant_text_in_a_transition_is_escaped_in_both_formats() -> None:
    clock = Clock()
    state = make_state(clock)
    text, js = Captured("text", clock), Captured("json", clock)
    state.add_sink(text.sink)
    state.add_sink(js.sink)
    state.record("disk", [finding(Status.FAIL, "PathMissing", "/data/\x1b[2J\nfake line")])
    for line in [*text.lines(), *js.lines()]:
        assert "\x1b" not in line
    assert len(text.lines()) == 1 and len(js.lines()) == 1  # a first result, a fail: unknown -> fail
    assert "unknown -> fail" in text.lines()[0]
    assert json.loads(js.lines()[0])["subject"] == "/data/\\x1b[2J\\x0afake line"


# --- a real agent, driven from ok to fail and back --------------------------------------------------------------


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path, Path]]:
    data = tmp_path / "data"
    data.mkdir()
    only = "storage.space"
    config = {
        "http": {"address": "127.0.0.1", "port": 0, "metrics_port": 0},
        "logging": {"format": "json"},
        "health": {"fail_threshold": 1, "recovery_threshold": 1},
        "storage": {"space": [{"path": str(data)}]},
        "probes": {
            name: ({"interval_seconds": 0.3, "jitter_fraction": 0} if name == only else {"enabled": False})
            for name in all_probes()
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "agent.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [*CLI, "run", "--no-kube", "--config", str(path)],
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        yield process, log, data
    finally:
        stop(process)


def records(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def wait_for(log: Path, process: subprocess.Popen[str], count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 60
    while True:
        found = [r for r in records(log) if r["logger"] == HEALTH_LOGGER]
        if len(found) >= count:
            return found
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


@pytest.mark.system
def test_a_real_agent_logs_when_and_why_a_check_failed_and_recovered(
    agent: tuple[subprocess.Popen[str], Path, Path],
) -> None:
    process, log, data = agent
    assert [r["to"] for r in wait_for(log, process, 1)] == ["ready"]
    shutil.rmtree(data)
    went_bad = wait_for(log, process, 3)[1:3]
    data.mkdir()
    came_back = wait_for(log, process, 5)[3:5]

    check, readiness = went_bad
    assert (check["event"], check["level"], check["check"], check["subject"]) == (
        "check_transition",
        "warning",
        "storage.space",
        str(data),
    )
    assert (check["from"], check["to"], check["reason"]) == ("ok", "fail", "PathMissing")
    assert check["msg"].startswith(f"health: check storage.space {data}: ok -> fail (PathMissing: ")
    assert (readiness["event"], readiness["from"], readiness["to"]) == ("readiness_transition", "ready", "not ready")
    assert f"storage.space {data} PathMissing" in readiness["message"]
    assert [(r["from"], r["to"]) for r in came_back] == [("fail", "ok"), ("not ready", "ready")]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", r["ts"]) for r in [*went_bad, *came_back])

    port = int(re.findall(r"serving on 127\.0\.0\.1:(\d+) .*status", log.read_text())[0])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as response:
        status = json.loads(response.read())
    history = [(t["kind"], t["check"], t["from"], t["to"], t["reason"]) for t in status["transitions"]]
    assert history == [
        ("readiness", "", "not ready", "ready", ""),
        ("check", "storage.space", "ok", "fail", "PathMissing"),
        ("readiness", "", "ready", "not ready", "PathMissing"),
        ("check", "storage.space", "fail", "ok", "OK"),
        ("readiness", "", "not ready", "ready", ""),
    ]
    assert status["transitions"][1]["at"] < status["transitions"][3]["at"]


def test_a_readiness_line_names_three_reasons_and_counts_the_rest() -> None:
    clock = Clock()
    state = make_state(clock)
    state.record("disk", [finding(Status.OK, subject=f"/d{n}") for n in range(5)])
    state.record("disk", [finding(Status.FAIL, "PathMissing", f"/d{n}") for n in range(5)])
    readiness = state.current().transitions[-1]
    assert (readiness.before, readiness.after) == ("ready", "not ready")
    assert readiness.message.count("PathMissing:") == 3 and readiness.message.endswith("; and 2 more")


def test_the_default_rate_is_five_lines_per_check_a_minute() -> None:
    clock = Clock()
    state = make_state(clock)
    log = Captured("text", clock)
    log.sink = HealthLog(log.logger, monotonic=clock.mono)  # the defaults
    state.add_sink(log.sink)
    for n in range(12):
        clock.now += 4
        state.record("disk", [finding(Status.FAIL if n % 2 == 0 else Status.OK, "PathMissing" if n % 2 == 0 else "OK")])
    assert sum("health: check" in line for line in log.lines()) == 5
    clock.now += 20  # 64 s after the first line
    state.refresh()
    assert any("check storage.space /data: suppressed 7 transitions in 60s; now ok" in s for s in log.lines()[-2:])
