"""/ready's parameters and its text answer, over real HTTP against the real server and health state.

The state is the agent's own HealthState, fed the findings a probe would return; the server is the agent's
HttpServer on 127.0.0.1. Nothing is mocked.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from agent.http.answers import CONTINUATION, TEXT_REASON_LINES
from agent.http.routes import TEXT_LINE_MAX, TEXT_REASONS_MAX, HttpServer
from agent.metrics import MetricsRenderer
from agent.ready import MAX_DEVICES, MAX_SELECTORS
from agent.reasons import HOST_MEM_BELOW_REQUEST, STALE, WARMING_UP
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes.base import (
    OBSERVED_DEVICE_IDS,
    OBSERVED_HBM_FREE_MIB,
    OBSERVED_HOST_MEM_AVAILABLE_MIB,
    OBSERVED_HUGEPAGES_FREE,
    Finding,
    Status,
)

GPU_0 = "GPU-5f4c2a8e-0d1b-4c6e-9a3f-000000000000"
GPU_1 = "GPU-5f4c2a8e-0d1b-4c6e-9a3f-111111111111"
MIG_0 = "MIG-9a3f4c2a-8e0d-4b1c-6e5f-000000000001"
CHECKS = ("gpu.health", "host.memory", "storage.space")


class Clock:
    """The monotonic clock HealthState judges staleness by, when it publishes and when a reader asks for the
    current snapshot; it starts at the real one and is advanced by the test."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


@dataclass
class Served:
    state: HealthState
    server: HttpServer
    clock: Clock

    @property
    def port(self) -> int:
        return self.server.port

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str, str]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            connection.request("GET", path, headers=headers or {})
            response = connection.getresponse()
            return response.status, response.getheader("Content-Type") or "", response.read().decode()
        finally:
            connection.close()

    def get_json(self, path: str) -> tuple[int, dict[str, Any]]:
        status, _, body = self.get(path)
        return status, json.loads(body)

    def reasons(self, path: str) -> list[tuple[str, str, str]]:
        status, body = self.get_json(path)
        assert status in (200, 503), body
        return [(r["check"], r["subject"], r["reason"]) for r in body["reasons"]]


def gpu(index: int, status: Status, ids: list[str], hbm_free: float = 40000.0) -> Finding:
    reason = "OK" if status == Status.OK else "GpuBroken"
    observed = {OBSERVED_DEVICE_IDS: ids, OBSERVED_HBM_FREE_MIB: hbm_free}
    return Finding("gpu.health", f"gpu{index}", status, reason, f"gpu {index}", "reseat it", observed, device=index)


def host_memory(available_mib: float | None, hugepages_free: int | None = None) -> list[Finding]:
    out = []
    if available_mib is not None:
        observed = {OBSERVED_HOST_MEM_AVAILABLE_MIB: available_mib}
        out.append(Finding("host.memory", "", Status.OK, "OK", f"{available_mib} MiB available", "", observed))
    if hugepages_free is not None:
        observed = {OBSERVED_HUGEPAGES_FREE: hugepages_free}
        out.append(Finding("host.memory", "hugepages", Status.OK, "OK", "hugepages", "", observed))
    return out


@pytest.fixture
def served() -> Iterator[Served]:
    clock = Clock()
    state = HealthState("node-a", HealthSettings(fail_threshold=1, recovery_threshold=1), monotonic=clock)
    state.configure(
        [
            ProbeSpec("gpu", ("gpu.health",), 10.0, 5.0),
            ProbeSpec("host", ("host.memory",), 10.0, 5.0),
            ProbeSpec("storage", ("storage.space",), 10.0, 5.0),
        ]
    )
    server = HttpServer(
        state,
        MetricsRenderer(state.current).render,
        lambda: (True, {"problems": []}),
        lambda: CHECKS,
        address="127.0.0.1",
        port=0,
        max_wait=30.0,
        max_long_polls=3,
    )
    server.start()
    try:
        yield Served(state, server, clock)
    finally:
        server.stop()


def feed_healthy_gpus(served: Served, gpu0: Status = Status.FAIL) -> None:
    served.state.record("gpu", [gpu(0, gpu0, [GPU_0, MIG_0]), gpu(1, Status.OK, [GPU_1])])
    served.state.record("host", host_memory(8000, 100))
    served.state.record("storage", [Finding("storage.space", "/data", Status.OK, "OK", "40% used")])


# --- devices= ---------------------------------------------------------------------------------------


def test_devices_as_indices_lists_and_duplicates(served: Served) -> None:
    feed_healthy_gpus(served)
    assert served.get("/ready")[0] == 503
    assert served.get("/ready?devices=1")[0] == 200
    assert served.get("/ready?devices=1,1,1,1")[0] == 200
    assert served.reasons("/ready?devices=0") == [("gpu.health", "gpu0", "GpuBroken")]
    assert served.reasons("/ready?devices=1,0,1") == [("gpu.health", "gpu0", "GpuBroken")]
    assert served.get("/ready?devices=all")[0] == 503  # every device, as without devices=


def test_devices_the_node_does_not_have_are_never_ready(served: Served) -> None:
    """devices=7 on a 2-GPU node: NoSuchDevice (503), never 200 because no result of device 7 blocks."""
    feed_healthy_gpus(served, gpu0=Status.OK)
    assert served.get("/ready?devices=0,1")[0] == 200
    status, body = served.get_json("/ready?devices=1,7")
    assert status == 503, body
    assert [(r["check"], r["reason"]) for r in body["reasons"]] == [("ready.devices", "NoSuchDevice")]
    assert "devices=7" in body["reasons"][0]["message"] and "its devices: 0, 1" in body["reasons"][0]["message"]
    # min_hbm_free_mib on devices that report free memory is judged as before; on none, never ready.
    assert served.get("/ready?devices=1&min_hbm_free_mib=30000")[0] == 200


def test_a_node_without_devices_is_never_ready_for_devices_or_hbm(served: Served) -> None:
    """A node with no accelerator: devices=0,1 and min_hbm_free_mib=30000 are NoSuchDevice, not 200."""
    served.state.record("gpu", [Finding("gpu.health", "", Status.SKIP, "NotApplicable", "no NVIDIA driver")])
    served.state.record("host", host_memory(8000, 100))
    served.state.record("storage", [Finding("storage.space", "/data", Status.OK, "OK", "40% used")])
    assert served.get("/ready")[0] == 200
    for query in ("devices=0,1", "min_hbm_free_mib=30000", "devices=0,1&min_hbm_free_mib=30000"):
        status, body = served.get_json(f"/ready?{query}")
        assert status == 503, (query, body)
        assert {r["reason"] for r in body["reasons"]} == {"NoSuchDevice"}, body
    status, body = served.get_json("/ready?min_hbm_free_mib=30000")
    assert "no considered device of this node reports free device memory" in body["reasons"][0]["message"]


def test_devices_as_gpu_uuids_and_mig_ids(served: Served) -> None:
    feed_healthy_gpus(served)
    assert served.get(f"/ready?devices={GPU_1}")[0] == 200
    assert served.get(f"/ready?devices={GPU_1.lower()}")[0] == 200
    assert served.reasons(f"/ready?devices={GPU_0}") == [("gpu.health", "gpu0", "GpuBroken")]
    # A MIG device of GPU 0 is judged by GPU 0's results.
    assert served.reasons(f"/ready?devices={MIG_0}") == [("gpu.health", "gpu0", "GpuBroken")]
    assert served.reasons(f"/ready?devices={GPU_1},{MIG_0}") == [("gpu.health", "gpu0", "GpuBroken")]
    # min_hbm_free_mib applies to the devices the ids resolve to.
    served.state.record("gpu", [gpu(0, Status.OK, [GPU_0]), gpu(1, Status.OK, [GPU_1], hbm_free=100.0)])
    assert served.get(f"/ready?devices={GPU_0}&min_hbm_free_mib=1000")[0] == 200
    assert served.reasons(f"/ready?devices={GPU_1}&min_hbm_free_mib=1000") == [
        ("gpu.health", "gpu1", "HbmBelowRequest")
    ]


def test_an_unknown_gpu_id_is_a_400_naming_it(served: Served) -> None:
    feed_healthy_gpus(served)
    stranger = "GPU-00000000-0000-0000-0000-00000000dead"
    status, body = served.get_json(f"/ready?devices={GPU_1},{stranger}")
    assert status == 400
    assert stranger in body["error"] and "not a device of this node" in body["error"]


def test_an_unknown_gpu_id_while_gpu_results_are_unknown_is_not_ready(served: Served) -> None:
    # Warming up: the gpu probe has not named its devices yet, so the id may be one of them.
    stranger = "GPU-00000000-0000-0000-0000-00000000dead"
    assert ("gpu.health", "", WARMING_UP.code) in served.reasons(f"/ready?devices={stranger}&checks=gpu")
    # A gpu probe that timed out: same, its results name no device any more.
    served.state.record("gpu", [Finding("gpu.health", "", Status.UNKNOWN, "ProbeTimeout", "nvidia-smi hung")])
    served.state.record("host", host_memory(8000))
    served.state.record("storage", [Finding("storage.space", "/data", Status.OK, "OK", "40% used")])
    assert served.get("/ready")[0] == 200  # unknown of a non-required check does not block the node...
    assert served.reasons(f"/ready?devices={stranger}") == [("gpu.health", "", "ProbeTimeout")]  # ...nor lie


@pytest.mark.parametrize(
    "value",
    [
        "%D9%A1",  # ARABIC-INDIC DIGIT ONE: a digit to str.isdigit and int(), not to us
        "%EF%BC%91",  # FULLWIDTH DIGIT ONE
        "9" * 5000,  # int() refuses > 4300 digits with ValueError: was a 500 with a traceback
        "65536",
        "-1",
        "1.5",
        "0x1",
        "1e3",
        "",
        "0,,1",
        "GPU-",
        "GPU-%C3%A9",
        "GPU-" + "a" * 200,
        "nvidia0",
    ],
)
def test_bad_device_values_are_400_never_500(served: Served, value: str) -> None:
    status, body = served.get_json(f"/ready?devices={value}")
    assert status == 400, body
    assert body["error"].startswith("devices:")
    echoed = re.match(r"devices: '([^']*)'", body["error"])
    assert echoed is not None and len(echoed.group(1)) <= 64  # the value is echoed, cut to 64 characters


def test_devices_are_deduplicated_and_capped(served: Served) -> None:
    feed_healthy_gpus(served)
    assert served.get("/ready?devices=" + ",".join(["1"] * (4 * MAX_DEVICES)))[0] == 200
    assert served.get("/ready?devices=" + ",".join(str(i) for i in range(MAX_DEVICES)))[0] == 503
    for query in (
        ",".join(str(i) for i in range(MAX_DEVICES + 1)),  # too many different devices
        ",".join(["1"] * (4 * MAX_DEVICES + 1)),  # too many in all, repeats included
    ):
        status, body = served.get_json(f"/ready?devices={query}")
        assert status == 400 and f"at most {MAX_DEVICES} different devices, {4 * MAX_DEVICES} in all" in body["error"]


# --- min_host_mem_mib= and min_hugepages= ------------------------------------------------------------


def test_min_host_mem_mib(served: Served) -> None:
    feed_healthy_gpus(served, gpu0=Status.OK)
    assert served.get("/ready?min_host_mem_mib=8000")[0] == 200
    assert served.get("/ready?min_host_mem_mib=0")[0] == 200
    status, body = served.get_json("/ready?min_host_mem_mib=8000.5")
    assert status == 503
    (reason,) = body["reasons"]
    assert (reason["check"], reason["status"], reason["reason"]) == ("host.memory", "fail", HOST_MEM_BELOW_REQUEST.code)
    assert "8000 MiB" in reason["message"] and "8000.5 MiB" in reason["message"]
    # Whatever checks= and devices= select: the job asked for it explicitly.
    assert served.reasons("/ready?checks=storage&devices=1&min_host_mem_mib=9000") == [
        ("host.memory", "", HOST_MEM_BELOW_REQUEST.code)
    ]


def test_min_hugepages(served: Served) -> None:
    feed_healthy_gpus(served, gpu0=Status.OK)
    assert served.get("/ready?min_hugepages=100")[0] == 200
    assert served.reasons("/ready?min_hugepages=101") == [("host.memory", "hugepages", HOST_MEM_BELOW_REQUEST.code)]
    assert served.get("/ready?min_hugepages=100&min_host_mem_mib=100")[0] == 200


def test_host_memory_not_known_fails_closed(served: Served) -> None:
    # 0 asks for nothing, known or not.
    assert HOST_MEM_BELOW_REQUEST.code not in str(served.get_json("/ready?min_host_mem_mib=0&min_hugepages=0")[1])
    # Warming up: nothing reported yet.
    status, body = served.get_json("/ready?checks=storage&min_host_mem_mib=1")
    assert status == 503
    assert [(r["reason"], r["status"]) for r in body["reasons"] if r["check"] == "host.memory"] == [
        (HOST_MEM_BELOW_REQUEST.code, "unknown")
    ]
    # The host reports no hugepages at all (none reserved): min_hugepages cannot be vouched for.
    served.state.record("gpu", [gpu(0, Status.OK, [GPU_0])])
    served.state.record("host", host_memory(8000, None))
    served.state.record("storage", [Finding("storage.space", "/data", Status.OK, "OK", "40% used")])
    assert served.get("/ready?min_host_mem_mib=1")[0] == 200
    status, body = served.get_json("/ready?min_hugepages=1")
    assert status == 503
    assert "not known" in body["reasons"][0]["message"]
    # A skipped host probe (no value) and a stale one (an old value) are not known either.
    served.state.record("host", [Finding("host.memory", "", Status.SKIP, "NotApplicable", "disabled")], result="skip")
    assert served.reasons("/ready?min_host_mem_mib=1") == [("host.memory", "", HOST_MEM_BELOW_REQUEST.code)]
    timeout = Finding("host.memory", "", Status.UNKNOWN, "ProbeTimeout", "overran 5s")
    served.state.record("host", [timeout], result="timeout")
    status, body = served.get_json("/ready?checks=storage&min_host_mem_mib=1")
    assert status == 503 and "host.memory is ProbeTimeout" in body["reasons"][0]["message"]
    served.state.record("host", host_memory(8000))
    served.clock.now += 1000.0
    served.state.record("gpu", [gpu(0, Status.OK, [GPU_0])])  # publishes: host.memory is stale by now
    status, body = served.get_json("/ready?checks=gpu&min_host_mem_mib=1")
    assert status == 503
    (reason,) = body["reasons"]
    assert (reason["reason"], reason["status"]) == (HOST_MEM_BELOW_REQUEST.code, "unknown")
    assert f"host.memory is {STALE.code}" in reason["message"]


def test_host_memory_not_configured_fails_closed(served: Served) -> None:
    served.state.configure([ProbeSpec("storage", ("storage.space",), 10.0, 5.0)])
    served.state.record("storage", [Finding("storage.space", "/data", Status.OK, "OK", "40% used")])
    assert served.get("/ready")[0] == 200
    status, body = served.get_json("/ready?min_host_mem_mib=1")
    assert status == 503
    assert "no host.memory result" in body["reasons"][0]["message"]


@pytest.mark.parametrize(
    "query",
    [
        "min_host_mem_mib=-1",
        "min_host_mem_mib=%D9%A1",
        "min_host_mem_mib=nan",
        "min_host_mem_mib=inf",
        "min_host_mem_mib=1e3",
        "min_host_mem_mib=" + "9" * 5000,
        "min_hugepages=x",
        "min_hugepages=1&min_hugepages=2",
        "wait=31",
        "format=xml",
        "a=1&" * 20 + "b=1",
    ],
)
def test_bad_numbers_and_parameters_are_400(served: Served, query: str) -> None:
    status, content_type, body = served.get(f"/ready?{query}")
    assert status == 400, body
    assert content_type == "application/json"
    assert json.loads(body)["error"]


# --- checks= ------------------------------------------------------------------------------------------


def test_selectors_are_deduplicated_and_capped(served: Served) -> None:
    feed_healthy_gpus(served)
    # Repeats count as one selector...
    assert served.reasons("/ready?checks=" + ",".join(["storage"] * (4 * MAX_SELECTORS))) == []
    assert served.reasons("/ready?checks=" + ",".join(["%20gpu", "storage+"] * (2 * MAX_SELECTORS))) == [
        ("gpu.health", "gpu0", "GpuBroken")
    ]
    # ...up to a bound: thousands of repeats (a request head holds 2000) are refused before any is looked at.
    for query in (
        ",".join(f"gpu.x{i}" for i in range(MAX_SELECTORS + 1)),
        ",".join(["storage"] * (4 * MAX_SELECTORS + 1)),
        ",".join(["storage"] * 2000),
    ):
        status, body = served.get_json(f"/ready?checks={query}")
        assert status == 400 and f"at most {MAX_SELECTORS} different names" in body["error"]


# --- text answers -------------------------------------------------------------------------------------


def test_text_answer_ready_and_not_ready(served: Served) -> None:
    feed_healthy_gpus(served)
    status, content_type, body = served.get("/ready?format=text")
    assert (status, content_type) == (503, "text/plain; charset=utf-8")
    lines = body.splitlines()
    assert lines[0] == "not ready on node-a: 1 reason"
    assert lines[1] == "fail gpu.health gpu0 GpuBroken: gpu 0 -- fix: reseat it"
    status, content_type, body = served.get("/ready?format=text&devices=1")
    assert (status, body) == (200, "ready on node-a\n")


def test_text_is_negotiated_by_accept_and_json_stays_the_default(served: Served) -> None:
    feed_healthy_gpus(served)
    cases = {
        None: "application/json",
        "*/*": "application/json",
        "text/plain": "text/plain; charset=utf-8",
        "text/plain, */*;q=0.8": "text/plain; charset=utf-8",
        "text/*": "text/plain; charset=utf-8",
        "application/json, text/plain": "application/json",
        "text/plain;q=0.5, application/json": "application/json",
        "text/html,application/xhtml+xml,*/*;q=0.8": "application/json",
    }
    for accept, expected in cases.items():
        for path in ("/ready", "/ready?devices=0"):
            status, content_type, _ = served.get(path, {"Accept": accept} if accept else {})
            assert (status, content_type) == (503, expected), (accept, path)
    # format= wins over Accept, both ways.
    assert served.get("/ready?format=json", {"Accept": "text/plain"})[1] == "application/json"
    assert served.get("/ready?format=text", {"Accept": "application/json"})[1].startswith("text/plain")


def test_text_400_when_text_was_asked(served: Served) -> None:
    status, content_type, body = served.get("/ready?format=text&devices=%1b[31mx")
    assert (status, content_type) == (400, "text/plain; charset=utf-8")
    assert body.startswith("bad request: devices:")
    assert "\x1b" not in body and body.count("\n") == 1
    status, content_type, body = served.get("/ready?bogus=1", {"Accept": "text/plain"})
    assert (status, content_type) == (400, "text/plain; charset=utf-8")
    assert body.startswith("bad request: unknown parameter 'bogus'")


def reasons_of(body: str) -> list[list[str]]:
    """The text answer's reasons, each its lines (a continuation line starts with two spaces)."""
    reasons: list[list[str]] = []
    for line in body.splitlines()[1:]:
        if line.startswith(CONTINUATION):
            reasons[-1].append(line)
        else:
            reasons.append([line])
    return reasons


def test_text_lines_are_bounded_and_many_reasons_are_counted(served: Served) -> None:
    long_message = "x" * 500 + "\nTraceback (most recent call last):\r\n\x1b[31m  more"
    long_hint = "do " + "y" * 400
    findings = [
        Finding("storage.space", f"/data/{i}" + "/deep" * 30, Status.FAIL, "DiskFull", long_message, long_hint)
        for i in range(TEXT_REASONS_MAX + 7)
    ]
    served.state.record("storage", findings)
    status, _, body = served.get("/ready?format=text&checks=storage")
    assert status == 503
    assert body.splitlines()[0] == f"not ready on node-a: {TEXT_REASONS_MAX + 7} reasons"
    reasons = reasons_of(body)
    assert len(reasons) == TEXT_REASONS_MAX + 1
    assert reasons[-1] == ["... and 7 more (the JSON answer and /status list them all)"]
    for lines in reasons[:-1]:
        assert 1 < len(lines) <= TEXT_REASON_LINES
        assert all(len(line) <= TEXT_LINE_MAX and not re.search(r"[\x00-\x1f\x7f]", line) for line in lines)
        joined = "".join(line.removeprefix(CONTINUATION) for line in lines)
        assert re.match(r"fail storage\.space /data/\d+/deep.*\.\.\. DiskFull: x+.*\.\.\. -- fix: do y+\.\.\.$", joined)
    # A short message leaves its room to the fix, and the other way round: each shown whole.
    served.state.record("storage", [Finding("storage.space", "/d", Status.FAIL, "DiskFull", "full", long_hint)])
    lines = reasons_of(served.get("/ready?format=text&checks=storage")[2])[0]
    assert lines[0].startswith("fail storage.space /d DiskFull: full -- fix: do yyy") and len(lines[0]) == TEXT_LINE_MAX
    assert "".join(line.removeprefix(CONTINUATION) for line in lines).endswith("do " + "y" * 400)
    served.state.record("storage", [Finding("storage.space", "/d", Status.FAIL, "DiskFull", long_message, "rm it")])
    lines = reasons_of(served.get("/ready?format=text&checks=storage")[2])[0]
    assert " ".join(line.strip() for line in lines).endswith("... -- fix: rm it")
    assert all(len(line) <= TEXT_LINE_MAX for line in lines)


def test_text_reasons_wrap_between_words_never_inside_one(served: Served) -> None:
    """A reason longer than a line goes on in indented lines, broken where the words break: every word whole."""
    words = [f"word{i:03d}" for i in range(60)]
    served.state.record(
        "storage", [Finding("storage.space", "/d", Status.FAIL, "DiskFull", " ".join(words), "free some space")]
    )
    lines = reasons_of(served.get("/ready?format=text&checks=storage")[2])[0]
    assert len(lines) == 3 and lines[0].startswith("fail storage.space /d DiskFull: word000 ")
    assert all(len(line) <= TEXT_LINE_MAX for line in lines)
    assert all(line.startswith(CONTINUATION) and not line.startswith(CONTINUATION + " ") for line in lines[1:])
    assert " ".join(line.strip() for line in lines) == "fail storage.space /d DiskFull: " + " ".join(words) + (
        " -- fix: free some space"
    )
    # Short reasons stay one line, as before.
    served.state.record("storage", [Finding("storage.space", "/d", Status.FAIL, "DiskFull", "98% used", "clean")])
    assert reasons_of(served.get("/ready?format=text&checks=storage")[2]) == [
        ["fail storage.space /d DiskFull: 98% used -- fix: clean"]
    ]


def test_text_long_poll_answers_in_text(served: Served) -> None:
    feed_healthy_gpus(served)
    status, content_type, body = served.get("/ready?format=text&wait=0.3")
    assert (status, content_type) == (503, "text/plain; charset=utf-8")
    assert body.startswith("not ready on node-a")


# --- long-polls ---------------------------------------------------------------------------------------


def wait_until(condition: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_long_polls_are_capped_and_released_when_clients_leave(served: Served) -> None:
    feed_healthy_gpus(served)
    waiting = []
    for _ in range(3):
        sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
        sock.sendall(b"GET /ready?wait=30 HTTP/1.1\r\nHost: x\r\n\r\n")
        waiting.append(sock)
    wait_until(lambda: served.server.long_polls == 3)
    status, _, body = served.get("/ready?wait=30&format=text")
    assert status == 429 and body.startswith("too many requests: 3 long-polls are waiting")
    assert served.get("/ready?wait=30")[0] == 429
    assert served.get("/ready")[0] == 503  # without wait= it answers at once
    for sock in waiting:
        sock.close()
    wait_until(lambda: served.server.long_polls == 0 and not served.server.core.connections)
    # The slots are free again, and a long-poll returns as soon as the node turns ready.
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
    sock.sendall(b"GET /ready?wait=30&format=text HTTP/1.1\r\nHost: x\r\n\r\n")
    wait_until(lambda: served.server.long_polls == 1)
    served.state.record("gpu", [gpu(0, Status.OK, [GPU_0]), gpu(1, Status.OK, [GPU_1])])
    answer = sock.recv(65536)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"ready on node-a\n")


# --- /status and /metrics are rendered per snapshot ----------------------------------------------------


def test_status_is_serialized_once_per_snapshot_and_shows_the_http_figures() -> None:
    state = HealthState("node-a", HealthSettings(fail_threshold=1, recovery_threshold=1))
    state.configure([ProbeSpec("storage", ("storage.space",), 60.0, 5.0)])
    state.record("storage", [Finding("storage.space", "/data", Status.OK, "OK", "40% used")])
    extra_calls: list[float] = []
    renderer = MetricsRenderer(state.current)

    def status_extra() -> dict[str, Any]:
        extra_calls.append(time.monotonic())
        return {"agent": {"calls": len(extra_calls)}}

    server = HttpServer(state, renderer.render, lambda: (True, {}), lambda: CHECKS, status_extra, "127.0.0.1", 0)
    renderer.collector.add_source(server.samples)
    server.start()
    try:
        running = Served(state, server, Clock())
        started = time.monotonic()
        for _ in range(100):
            status, body = running.get_json("/status")
            assert status == 200 and body["findings"][0]["message"] == "40% used"
            assert running.get("/metrics")[0] == 200
        elapsed = time.monotonic() - started
        # Once, then at most once a second for the agent's own part (and the process metrics).
        assert 1 <= len(extra_calls) <= 2 + elapsed
        assert 1 <= renderer.renders <= 2 + elapsed
        figures = body["http"]
        assert set(figures) == {
            "connections",
            "health_connections",
            "node_connections",
            "peers",
            "refused_total",
            "long_polls",
            "tasks",
            "unsent_bytes",
            "ports",
        }
        assert figures["ports"] == [
            {"port": server.port, "routes": ["/ready", "/preflight.sh", "/healthz", "/started", "/metrics", "/status"]}
        ]
        assert figures["connections"] >= 1 and figures["refused_total"] == 0
        metrics = running.get("/metrics")[2]
        assert re.search(r"^nodehealth_http_connections [1-9]", metrics, re.M)
        assert "nodehealth_http_connections_refused_total 0.0" in metrics
        # A new snapshot shows at once.
        calls = len(extra_calls)
        state.record("storage", [Finding("storage.space", "/data", Status.OK, "OK", "41% used")])
        assert running.get_json("/status")[1]["findings"][0]["message"] == "41% used"
        assert len(extra_calls) == calls + 1
    finally:
        server.stop()


def test_the_other_endpoints_take_no_parameters_and_every_one_answers_head(served: Served) -> None:
    feed_healthy_gpus(served)
    for path in ("/healthz", "/metrics", "/status"):
        status, content_type, body = served.get(f"{path}?x=1")
        assert (status, content_type) == (400, "application/json") and json.loads(body)["error"]
    for path, status in (("/ready", 503), ("/healthz", 200), ("/metrics", 200), ("/status", 200)):
        connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
        connection.request("HEAD", path)
        response = connection.getresponse()
        assert (response.status, response.read()) == (status, b"")
        assert int(response.getheader("Content-Length") or 0) > 0
        connection.close()


def test_cached_answers_turn_stale_when_nothing_is_published(served: Served) -> None:
    """/ready without parameters is served from a body cached per snapshot, /status and /metrics per snapshot
    too: past the results' limit, with the scheduler publishing nothing, each answers from the aged view."""
    feed_healthy_gpus(served, gpu0=Status.OK)
    for _ in range(2):  # the second answer comes from the cache
        assert served.get("/ready")[0] == 200
    assert served.get_json("/status")[1]["ready"] is True
    assert "nodehealth_ready 1.0" in served.get("/metrics")[2]
    version = served.state.snapshot.version
    served.clock.now += 3 * 10.0 + 5.0 + 1.0
    status, body = served.get_json("/ready")
    assert status == 503 and {r["reason"] for r in body["reasons"]} == {STALE.code}
    assert served.state.snapshot.version == version, "nothing was published meanwhile"
    document = served.get_json("/status")[1]
    assert document["ready"] is False and all(f.get("stale") for f in document["findings"])
    assert "nodehealth_ready 0.0" in served.get("/metrics")[2]
