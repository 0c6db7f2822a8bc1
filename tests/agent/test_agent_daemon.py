"""The daemon end to end over real HTTP on 127.0.0.1, with probes that hang, raise and return garbage.

The misbehaving probes are real probe classes run by the real scheduler in real threads (and a real child
process that never answers); nothing of the agent is mocked.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.config import parse_config
from agent.daemon import Agent
from probes.base import Finding, Probe, ProbeContext, ProbeOutput, Reason, Sample, Status

CONTROL: dict[str, Any] = {"good_fails": False}
RELEASE = threading.Event()

pytestmark = pytest.mark.system


def sleep_forever_in_child(seconds: float) -> None:
    time.sleep(seconds)


GOOD_BROKEN = Reason("GoodBroken", Status.FAIL, "the test's good probe is told to fail", "mend good")
MOUNT_HUNG = Reason("MountHung", Status.FAIL, "the test's child never answers", "remount", also=(Status.OK,))


class GoodProbe(Probe):
    name = "good"
    checks = ("host.good",)
    reasons = (GOOD_BROKEN,)
    default_interval = 0.2
    default_timeout = 1.0

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        if CONTROL["good_fails"]:
            return [Finding("host.good", "", Status.FAIL, "GoodBroken", "good is broken", "mend good")]
        return [
            Finding("host.good", "", Status.OK, "OK", "fine"),
            Sample("nodehealth_test_good_value", "A test gauge.", 42.0, {"kind": "x"}),
        ]


class HangProbe(Probe):
    name = "hang"
    checks = ("host.hang",)
    default_interval = 0.3
    default_timeout = 0.5

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        RELEASE.wait()
        return []


class RaiseProbe(Probe):
    name = "raise"
    checks = ("host.raise",)
    default_interval = 0.3
    default_timeout = 1.0

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        raise RuntimeError("boom")


class GarbageProbe(Probe):
    name = "garbage"
    checks = ("host.garbage",)
    default_interval = 0.3
    default_timeout = 1.0

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        return ["not a finding", 42]  # type: ignore[list-item]


class ChildHangProbe(Probe):
    name = "childhang"
    checks = ("storage.childhang",)
    reasons = (MOUNT_HUNG,)
    default_interval = 0.3
    default_timeout = 2.0

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        result = ctx.host.child_call("childhang", sleep_forever_in_child, 3600, timeout=0.3)
        status = Status.OK if result.ok else Status.FAIL
        return [Finding("storage.childhang", "/mnt/x", status, "MountHung", result.state, "remount")]


PROBES: dict[str, type[Probe]] = {
    cls.name: cls for cls in (GoodProbe, HangProbe, RaiseProbe, GarbageProbe, ChildHangProbe)
}


def get(port: int, path: str, method: str = "GET", timeout: float = 5.0) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def get_json(port: int, path: str, timeout: float = 5.0) -> tuple[int, dict[str, Any]]:
    status, body = get(port, path, timeout=timeout)
    return status, json.loads(body)


def metrics(port: int) -> dict[str, list[Any]]:
    status, body = get(port, "/metrics")
    assert status == 200
    return {family.name: family.samples for family in text_string_to_metric_families(body.decode())}


def child_pids() -> list[int]:
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.append(int(entry))
    return out


@pytest.fixture
def agent() -> Iterator[Agent]:
    CONTROL["good_fails"] = False
    RELEASE.clear()
    config = parse_config(
        {
            "http": {"address": "127.0.0.1", "port": 0},
            "health": {"fail_threshold": 1, "recovery_threshold": 1},
            "probes": {name: {"jitter_fraction": 0.0} for name in PROBES},
        },
        PROBES,
    )
    agent = Agent(None, config, no_kube=True, probe_classes=PROBES)
    agent.start()
    try:
        yield agent
    finally:
        RELEASE.set()
        agent.shutdown()


def test_misbehaving_probes_never_stop_the_others_nor_http(agent: Agent) -> None:
    port = agent.http.port
    status, body = get_json(port, "/ready")
    assert status == 503
    assert "WarmingUp" in {r["reason"] for r in body["reasons"]}

    threads_seen = []
    children_seen = []
    for _ in range(20):  # about 4 s, many cycles of every probe
        time.sleep(0.2)
        assert get(port, "/healthz")[0] == 200
        assert get(port, "/ready")[0] in (200, 503)
        threads_seen.append(sum(1 for t in threading.enumerate() if t.name == "probe-hang"))
        children_seen.append(len(child_pids()))
    assert max(threads_seen) == 1, "a hung probe must never be started again while it still runs"
    assert max(children_seen) <= 1, "at most one child per key"

    status, body = get_json(port, "/ready")
    assert status == 503
    # Only the real failure blocks: unknown results of non-required checks (timeout, error) do not.
    assert [(r["check"], r["reason"]) for r in body["reasons"]] == [("storage.childhang", "MountHung")]
    assert get(port, "/ready?checks=host")[0] == 200
    doc = get_json(port, "/status")[1]
    by_check = {f["check"]: f for f in doc["findings"]}
    assert by_check["host.good"]["status"] == "ok"
    assert by_check["host.hang"]["reason"] == "ProbeTimeout"
    assert by_check["host.raise"]["reason"] == "ProbeError"
    assert "boom" in by_check["host.raise"]["message"]
    assert by_check["host.garbage"]["reason"] == "ProbeError"
    assert by_check["storage.childhang"]["status"] == "fail"

    families = metrics(port)
    runs = {(s.labels["probe"], s.labels["result"]): s.value for s in families["nodehealth_probe_runs"]}
    assert runs[("good", "ok")] >= 8, runs
    assert runs[("hang", "timeout")] >= 2
    assert runs[("hang", "ok")] == 0
    assert runs[("raise", "error")] >= 5
    assert runs[("garbage", "error")] >= 5


def test_ready_reports_reason_and_hint_and_long_poll_returns_on_recovery(agent: Agent) -> None:
    port = agent.http.port
    deadline = time.monotonic() + 10
    while get(port, "/ready?checks=host")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    CONTROL["good_fails"] = True
    deadline = time.monotonic() + 10
    status, body = get_json(port, "/ready?checks=host")
    while status != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
        status, body = get_json(port, "/ready?checks=host")
    assert status == 503
    (reason,) = body["reasons"]
    assert (reason["check"], reason["reason"], reason["hint"]) == ("host.good", "GoodBroken", "mend good")
    assert get(port, "/ready?checks=host.raise,host.hang")[0] == 200  # unknown, not required: fine

    def recover() -> None:
        time.sleep(0.8)
        CONTROL["good_fails"] = False

    threading.Thread(target=recover).start()
    started = time.monotonic()
    status, body = get_json(port, "/ready?wait=30&checks=host", timeout=40)
    elapsed = time.monotonic() - started
    assert status == 200, body
    assert elapsed < 20, "wait= must return as soon as the node is ready, not at the end of the wait"
    status, body = get_json(port, "/ready?wait=0.5&checks=host.good")
    assert status == 200


@pytest.mark.parametrize(
    "query",
    [
        "bogus=1",
        "checks=nosuchcheck",
        "checks=host.good,",
        "devices=a",
        "devices=-1",
        "devices=1.5",
        "min_hbm_free_mib=-5",
        "min_hbm_free_mib=nan",
        "min_hbm_free_mib=x",
        "wait=abc",
        "wait=100000",
        "wait=1&wait=2",
    ],
)
def test_bad_queries_get_400_with_the_reason(agent: Agent, query: str) -> None:
    status, body = get_json(agent.http.port, f"/ready?{query}")
    assert status == 400
    assert body["error"]


def test_unknown_paths_and_methods(agent: Agent) -> None:
    port = agent.http.port
    assert get(port, "/nope")[0] == 404
    assert get(port, "/ready", method="POST")[0] == 405
    assert get(port, "/metrics?x=1")[0] == 400


def test_core_metrics_present_with_their_labels(agent: Agent) -> None:
    port = agent.http.port
    CONTROL["good_fails"] = True
    deadline = time.monotonic() + 10
    while "GoodBroken" not in get(port, "/ready")[1].decode():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    families = metrics(port)
    expected = {
        "nodehealth_ready": set(),
        "nodehealth_check_status": {"check", "subject"},
        "nodehealth_problem": {"check", "subject", "reason"},
        "nodehealth_probe_duration_seconds": {"probe"},
        "nodehealth_probe_last_success_timestamp_seconds": {"probe"},
        "nodehealth_probe_runs": {"probe", "result"},
        "problem_gauge": {"type", "reason"},
        "problem_counter": {"reason"},
    }
    for name, labels in expected.items():
        assert name in families, name
        assert families[name], f"{name} has no samples"
        for sample in families[name]:
            assert set(sample.labels) == labels, (name, sample.labels)
    assert families["nodehealth_ready"][0].value == 0
    problems = {(s.labels["check"], s.labels["reason"]) for s in families["nodehealth_problem"]}
    assert ("host.good", "GoodBroken") in problems
    assert {"type": "HostHealthy", "reason": "GoodBroken"} in [s.labels for s in families["problem_gauge"]]
    assert any(s.labels == {"reason": "GoodBroken"} and s.value >= 1 for s in families["problem_counter"])
    statuses = {(s.labels["check"]): s.value for s in families["nodehealth_check_status"]}
    assert statuses["host.good"] == 2
    assert statuses["host.hang"] in (3.0,) or statuses["host.hang"] == 3  # unknown (warming up or timeout)
    # The problem series disappears when the problem clears.
    CONTROL["good_fails"] = False
    deadline = time.monotonic() + 10
    while any(s.labels["check"] == "host.good" for s in metrics(port).get("nodehealth_problem", [])):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert metrics(port)["nodehealth_test_good_value"][0].labels == {"kind": "x"}  # probe samples exported


def test_a_wedged_scheduler_makes_results_stale_and_healthz_fail(agent: Agent) -> None:
    port = agent.http.port
    deadline = time.monotonic() + 10
    while get(port, "/ready?checks=host")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    agent.scheduler.stop()
    time.sleep(3 * 0.3 + 2.0 + 0.5)  # past 3 intervals + timeout of every probe
    status, body = get_json(port, "/ready?checks=host")
    assert status == 503
    assert "Stale" in {r["reason"] for r in body["reasons"]}
    status, body = get_json(port, "/healthz")
    assert status == 503
    assert body["problems"]
