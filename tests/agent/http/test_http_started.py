"""/started, the DaemonSet's readiness: 200 only once every configured probe has finished a first run since the
agent started, or timed out in it. The real Scheduler runs real probes in its worker threads, the real server
answers over HTTP: one probe blocks its first run until the test lets it go, one hangs past its timeout (a hung
NFS mount must not stall a rollout), and a probe a config reload adds is pending until its first run.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from agent.config import parse_config
from agent.http.routes import HttpServer
from agent.scheduler import Scheduler, build_state
from agent.state import HealthState
from probes.base import Check, Probe, ProbeContext, ProbeOutput
from probes.runtime.host import Host


class Quick(Probe):
    name = "quick"
    checks = ("host.quick",)

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        return [Check("host.quick").ok("", "fine")]


class Blocked(Probe):
    """Its runs wait until the test sets `go` (a first run that takes long: a slow tool)."""

    name = "blocked"
    checks = ("host.blocked",)
    go: ClassVar[threading.Event] = threading.Event()

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        self.go.wait(60)
        return [Check("host.blocked").ok("", "done")]


class Hung(Probe):
    """Never comes back within its timeout (a stat on a hung NFS mount)."""

    name = "hung"
    checks = ("storage.hung",)
    release: ClassVar[threading.Event] = threading.Event()

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        self.release.wait(60)
        return []


PROBES: dict[str, Probe] = {"quick": Quick(), "blocked": Blocked(), "hung": Hung()}


def settings(enabled: tuple[str, ...]) -> Any:
    schedules = {name: {"enabled": name in enabled, "timeout_seconds": 1.0, "jitter_fraction": 0.0} for name in PROBES}
    return parse_config({"probes": schedules}, PROBES)


def started(port: int) -> tuple[int, dict[str, Any]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/started")
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.fixture
def agent() -> Iterator[tuple[Scheduler, HealthState, int]]:
    Blocked.go.clear()
    Hung.release.clear()
    config = settings(("quick", "blocked"))
    state = build_state(config)
    scheduler = Scheduler(dict(PROBES), config, Host(), state)
    server = HttpServer(state, lambda: b"", lambda: (True, {}), lambda: (), address="127.0.0.1", port=0)
    server.start()
    scheduler.start()
    try:
        yield scheduler, state, server.port
    finally:
        Blocked.go.set()
        Hung.release.set()
        scheduler.stop()
        server.stop()


def wait_for(port: int, status: int, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        code, body = started(port)
        if code == status:
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.05)


def test_not_started_while_a_probe_warms_up_then_started(agent: tuple[Scheduler, HealthState, int]) -> None:
    _, state, port = agent
    # The quick probe has run; the blocked one's first run is still in flight.
    deadline = time.monotonic() + 10
    while not any(p.name == "quick" and p.last_run for p in state.current().probes):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, body = started(port)
    assert status == 503 and body == {"started": False, "node": state.node, "probes": 2, "pending": ["blocked"]}
    Blocked.go.set()
    assert wait_for(port, 200) == {"started": True, "node": state.node, "probes": 2, "pending": []}


def test_a_probe_whose_first_run_timed_out_counts_as_done(agent: tuple[Scheduler, HealthState, int]) -> None:
    scheduler, state, port = agent
    Blocked.go.set()
    wait_for(port, 200)
    # A reload enables the hung probe: pending until its first run ends, here by its 1 s timeout.
    scheduler.reconfigure(settings(("quick", "blocked", "hung")))
    assert started(port)[1]["pending"] == ["hung"]
    body = wait_for(port, 200, timeout=15)
    assert body["pending"] == [] and body["probes"] == 3
    (hung,) = [p for p in state.current().probes if p.name == "hung"]
    assert hung.result == "timeout" and hung.running_since is not None, "it still runs: counted done all the same"
    # /started says nothing of health: the hung probe's check is unknown, and the agent started all the same.
    (check,) = [c.finding for c in state.current().checks if c.finding.check == "storage.hung"]
    assert (check.status.value, check.reason) == ("unknown", "ProbeTimeout")


def test_started_takes_no_parameters(agent: tuple[Scheduler, HealthState, int]) -> None:
    _, _, port = agent
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/started?ready")
    response = connection.getresponse()
    assert response.status == 400 and json.loads(response.read()) == {"error": "/started takes no parameters"}
    connection.close()
