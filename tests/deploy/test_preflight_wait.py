"""deploy/examples/preflight.sh as a runner hook: the same exit codes and output under sh, dash, busybox sh, bash
and bash -e; NODE_HEALTH_WAIT_SECONDS waits out an agent that is warming up (every reason WarmingUp, also when
there are more than the text answer lists) but never a real not-ready; an agent that refuses connections for
load is "agent overloaded", exit 4, never failed open; GitHub Actions annotations.

The agent here is the agent's own HTTP server and health state (agent/http/routes.py, agent/state.py) on 127.0.0.1, with
its probes configured but not run, so it stays in warm-up until the test records their first results; overload is
its real connection limit (Limits) with the last slot held by the test.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from support.netservers import refused_port
from support.preflight import SHELLS, Outcome, preflight, shell_argv
from support.system import require_tool

from agent.http.routes import TEXT_REASONS_MAX, HttpServer
from agent.http.server import Limits
from agent.metrics import MetricsRenderer
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes.base import Finding, Status

NODE = "node-a"
WAIT = "20"


@contextmanager
def agent(probes: int, limits: Limits | None = None) -> Iterator[tuple[HealthState, str]]:
    """An agent whose `probes` probes (one check each, `check0.x` ...) have not produced a result yet."""
    state = HealthState(NODE, HealthSettings(fail_threshold=1, recovery_threshold=1))
    state.configure([ProbeSpec(f"p{n}", (f"check{n}.x",), 60.0, 5.0) for n in range(probes)])
    checks = [f"check{n}.x" for n in range(probes)]
    server = HttpServer(
        state,
        MetricsRenderer(state.current).render,
        lambda: (True, {"problems": []}),
        lambda: checks,
        address="127.0.0.1",
        port=0,
        limits=limits,
    )
    server.start()
    try:
        yield state, f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


def record(state: HealthState, probe: int, status: Status = Status.OK) -> None:
    reason = "OK" if status == Status.OK else "DiskFull"
    state.record(f"p{probe}", [Finding(f"check{probe}.x", "/data", status, reason, f"{reason} here", "clean it")])


def started(env: dict[str, str], shell: str) -> tuple[subprocess.Popen[str], float]:
    return subprocess.Popen(
        shell_argv(shell),
        env={"PATH": os.environ["PATH"], **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ), time.monotonic()


def finished(process: subprocess.Popen[str], since: float) -> Outcome:
    stdout, stderr = process.communicate(timeout=60)
    return Outcome(process.returncode, stdout, stderr, time.monotonic() - since)


# --- warming up ------------------------------------------------------------------------------------------------


@pytest.mark.system
@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("probes", [2, TEXT_REASONS_MAX + 5], ids=["listed", "more-than-listed"])
def test_warming_up_is_waited_out(shell: str, probes: int) -> None:
    with agent(probes) as (state, url):
        process, since = started({"NODE_HEALTH_URL": url, "NODE_HEALTH_WAIT_SECONDS": WAIT}, shell)
        time.sleep(2.5)
        assert process.poll() is None, "exited while the agent was warming up"
        for n in range(probes):
            record(state, n)
        outcome = finished(process, since)
    assert outcome.code == 0, outcome
    assert outcome.lines[0] == (
        f"node-health pre-flight: {url}/ready answered 503: the agent is warming up (no result yet for some "
        f"checks); asking again for up to {WAIT} s"
    )
    assert outcome.lines[1:] == [f"node-health pre-flight: {url}/ready answered 200", f"ready on {NODE}"]
    assert outcome.stderr == ""
    assert 2.5 <= outcome.seconds < 18, outcome  # it did not wait the whole 20 s


@pytest.mark.system
@pytest.mark.parametrize("shell", SHELLS)
def test_a_long_reason_wrapped_onto_more_lines_is_still_waited_out(shell: str) -> None:
    """A reason over 200 characters comes wrapped, its next lines indented: the script judges the reason by its
    first line and does not mistake the others for reasons of their own."""
    with agent(2) as (state, url):
        long = " ".join(["the agent has not judged this check yet"] * 12)
        state.record("p0", [Finding("check0.x", "", Status.UNKNOWN, "WarmingUp", long, "wait for its first run")])
        process, since = started({"NODE_HEALTH_URL": url, "NODE_HEALTH_WAIT_SECONDS": WAIT}, shell)
        time.sleep(2.5)
        assert process.poll() is None, "exited while the agent was warming up"
        for n in range(2):
            record(state, n)
        outcome = finished(process, since)
    assert outcome.code == 0, outcome
    assert "warming up" in outcome.lines[0] and outcome.lines[-1] == f"ready on {NODE}"


@pytest.mark.system
@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("probes", [3, TEXT_REASONS_MAX + 5], ids=["listed", "more-than-listed"])
def test_a_real_problem_during_warm_up_is_not_waited_out(shell: str, probes: int) -> None:
    with agent(probes) as (state, url):
        record(state, probes - 1, Status.FAIL)  # the last check: beyond the text's list when there are many
        outcome = preflight({"NODE_HEALTH_URL": url, "NODE_HEALTH_WAIT_SECONDS": WAIT, "GITHUB_ACTIONS": "true"}, shell)
    assert outcome.code == 1, outcome
    assert outcome.seconds < 10, outcome  # not the 20 s of the wait
    assert outcome.lines[0] == f"node-health pre-flight: {url}/ready answered 503: this node is not ready for the job"
    assert outcome.lines[1] == f"not ready on {NODE}: {probes} reasons"
    assert outcome.lines[-1] == (
        "::error title=node-health pre-flight::this node is not ready for the job: "
        f"not ready on {NODE}: {probes} reasons (see Set up runner)"
    )


@pytest.mark.system
@pytest.mark.parametrize("shell", SHELLS)
def test_a_warm_up_longer_than_the_wait_is_not_ready(shell: str) -> None:
    with agent(2) as (_, url):
        outcome = preflight({"NODE_HEALTH_URL": url, "NODE_HEALTH_WAIT_SECONDS": "2"}, shell)
        immediate = preflight({"NODE_HEALTH_URL": url, "NODE_HEALTH_WAIT_SECONDS": "0"}, shell)
    assert outcome.code == 1, outcome
    assert 1 <= outcome.seconds < 10, outcome  # seconds as `date +%s` counts them: within one of 2
    assert re.fullmatch(
        rf"node-health pre-flight: {url}/ready answered 503: this node is not ready for the job "
        r"\(still warming up after \d+ s\)",
        outcome.lines[1],
    ), outcome.lines
    assert outcome.lines[2:] == [f"not ready on {NODE}: 2 reasons", *outcome.lines[3:5]]
    assert all(" WarmingUp: " in line for line in outcome.lines[3:5])
    # NODE_HEALTH_WAIT_SECONDS=0: not waited at all.
    assert immediate.code == 1 and immediate.seconds < 2, immediate
    assert immediate.lines[0].endswith("answered 503: this node is not ready for the job")


@pytest.mark.system
@pytest.mark.parametrize("value", ["soon", "-1", "1.5", "100000"])
def test_a_bad_wait_value_exits_2(value: str) -> None:
    outcome = preflight({"NODE_HEALTH_URL": f"http://127.0.0.1:{refused_port()}", "NODE_HEALTH_WAIT_SECONDS": value})
    assert outcome.code == 2, outcome
    assert "NODE_HEALTH_WAIT_SECONDS must be" in outcome.stderr and value in outcome.stderr


# --- overload ---------------------------------------------------------------------------------------------------


@contextmanager
def held_connection(url: str) -> Iterator[socket.socket]:
    """The agent's last connection slot, taken: a kept-alive connection that has had its answer."""
    port = int(url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        yield sock
    finally:
        sock.close()


ONE_SLOT = Limits(max_connections=1, local_reserve=0, new_peer_reserve=0)


@pytest.mark.system
@pytest.mark.parametrize("shell", SHELLS)
def test_an_overloaded_agent_is_exit_4_and_never_failed_open(shell: str) -> None:
    with agent(1, ONE_SLOT) as (state, url):
        record(state, 0)
        with held_connection(url):
            env = {"NODE_HEALTH_URL": url, "NODE_HEALTH_WAIT_SECONDS": "3", "NODE_HEALTH_FAIL_OPEN": "1"}
            outcome = preflight(env, shell)
    assert outcome.code == 4, outcome
    # Asked again for NODE_HEALTH_WAIT_SECONDS, but at least as long as for an absent agent (about 10 s).
    # Whole seconds, as `date +%s` counts them. The upper bound only tells a script that gives up from one that
    # never does: on a loaded machine each of its curl runs takes longer, and it says so (`within 12 s`).
    assert 8 <= outcome.seconds < 60, outcome
    first, second = outcome.stderr.splitlines()
    assert re.fullmatch(
        r"node-health pre-flight: agent overloaded: it refused every attempt for load within \d+ s, so this node's "
        r"health is unknown\. Last: .*",
        first,
    ), first
    last = first.split("Last: ", 1)[1]
    refused = f'{url}/ready answered 503: {{"error": "too many connections"}}'
    assert last in (refused, f"{url}/ready: the connection was reset (refused for load)"), last
    assert second.startswith("node-health pre-flight: too many connections to the node-health agent on this node")


@pytest.mark.system
@pytest.mark.parametrize("shell", SHELLS)
def test_an_overload_that_clears_within_the_wait_is_answered(shell: str) -> None:
    with agent(1, ONE_SLOT) as (state, url):
        record(state, 0)
        with held_connection(url):
            process, since = started({"NODE_HEALTH_URL": url, "NODE_HEALTH_WAIT_SECONDS": WAIT}, shell)
            time.sleep(2.5)
            assert process.poll() is None
        outcome = finished(process, since)
    assert outcome.code == 0, outcome
    assert outcome.lines[-2:] == [f"node-health pre-flight: {url}/ready answered 200", f"ready on {NODE}"]


# --- one script, five shells -------------------------------------------------------------------------------------


def normalized(outcome: Outcome) -> tuple[int, str, str]:
    def clean(text: str) -> str:
        return re.sub(r"within \d+ s|after \d+ s", "within N s", text)

    return outcome.code, clean(outcome.stdout), clean(outcome.stderr)


@pytest.mark.system
def test_every_shell_gives_the_same_exit_status_and_output() -> None:
    """Overload has its own test per shell above (its 503 or reset is the kernel's race, not the shell's)."""
    require_tool("curl")
    with agent(2) as (state, url):
        record(state, 0, Status.FAIL)
        scenarios = {
            "refused": {"NODE_HEALTH_URL": f"http://127.0.0.1:{refused_port()}"},
            "fail-open": {"NODE_HEALTH_URL": f"http://127.0.0.1:{refused_port()}", "NODE_HEALTH_FAIL_OPEN": "1"},
            "not-ready": {"NODE_HEALTH_URL": url, "ASCEND_VISIBLE_DEVICES": "0-3", "GITHUB_ACTIONS": "true"},
            "bad-question": {"NODE_HEALTH_URL": url, "NODE_HEALTH_MIN_HBM_FREE_MIB": "lots"},
            "bad-wait": {"NODE_HEALTH_URL": url, "NODE_HEALTH_WAIT_SECONDS": "x"},
        }
        results = {
            name: {shell: normalized(preflight(env, shell)) for shell in SHELLS} for name, env in scenarios.items()
        }
    codes = {name: {result[0] for result in by_shell.values()} for name, by_shell in results.items()}
    assert codes == {"refused": {3}, "fail-open": {0}, "not-ready": {1}, "bad-question": {2}, "bad-wait": {2}}
    for name, by_shell in results.items():
        assert len(set(by_shell.values())) == 1, (name, by_shell)
