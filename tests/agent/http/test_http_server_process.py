"""The HTTP server in a process of its own (agent/http/process.py, agent/http/serving.py).

The replica judges the agent's snapshots by the agent's freshness rule, /healthz fails when the agent stops
reporting, /metrics and /status are the agent's renderings (refused when too old), and the channel refuses what
no frame can be. Then as real processes: a ServerProcess beside a real HealthState answers /ready from each
published snapshot, asks the agent for pod= (whose ledger answers), is started again on its port when killed,
ends when stopped, and ends when the agent is SIGKILLed (`node-health run`). Under a CPU quota (root, a real
cgroup), the daemon's own process joins the work cgroup once started and the server's stays out of it, and a
CPU-bound site check then never throttles the server's cgroup.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.processes import free_port
from support.system import REPO, require_root

from agent.http.channel import MAX_REQUEST_BYTES, Channel, ChannelClosed
from agent.http.pod import PodLedger
from agent.http.process import ServerProcess
from agent.http.serving import (
    RENDERING_ASK_AGAIN_SECONDS,
    RENDERING_GIVE_UP_SECONDS,
    REPORT_SILENT_SECONDS,
    Rendering,
    Replica,
    Report,
    Setup,
)
from agent.metrics import MetricsRenderer
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes.base import Check
from probes.storage.common import DISK_FULL

sys.path.insert(0, str(REPO / "benchmarks"))
import scan_quota  # its CpuQuota makes and removes a cgroup

DISK = Check("storage.space")
SETTINGS = HealthSettings(fail_threshold=1, recovery_threshold=1)


def healthy_state(monotonic: object = time.monotonic) -> HealthState:
    state = HealthState("node-a", SETTINGS, monotonic=monotonic)  # type: ignore[arg-type]
    state.configure([ProbeSpec("storage", ("storage.space",), 10.0, 5.0)])
    state.record("storage", [DISK.ok("/data", "40% used")])
    return state


def setup_of(state: HealthState, metrics: bytes = b"# agent\n") -> Setup:
    return Setup(
        address="127.0.0.1",
        port=0,
        metrics_port=None,
        status_on_main_port=True,
        health_port=None,
        max_wait=10.0,
        proc="/proc",
        log_format="text",
        log_level="info",
        agent_pid=os.getpid(),
        snapshot=state.current(),
        report=Report(True, {"problems": []}, frozenset({"storage.space"})),
        metrics=metrics,
        status=b'{"from": "setup"}',
    )


# --- the replica, the channel ------------------------------------------------------------------------


def test_the_replica_judges_freshness_by_the_agents_rule_on_the_hosts_monotonic_clock() -> None:
    # Results observed 1000 s ago by the host's monotonic clock: their limit (3 x 10 s + 5 s) is long past.
    base = time.monotonic() - 1000
    replica = Replica(setup_of(healthy_state(lambda: base)), lambda: None, lambda: None)
    snapshot = replica.current()
    assert snapshot.aged and not snapshot.ready
    assert [state.stale for state in snapshot.checks] == [True]
    fresh = Replica(setup_of(healthy_state()), lambda: None, lambda: None)
    assert fresh.current().ready and not fresh.current().aged


def test_healthz_fails_when_the_agent_stops_reporting() -> None:
    replica = Replica(setup_of(healthy_state()), lambda: None, lambda: None)
    assert replica.healthz() == (True, {"problems": []})
    replica._reported = time.monotonic() - REPORT_SILENT_SECONDS - 1
    healthy, detail = replica.healthz()
    assert not healthy and "has not reported for" in detail["problems"][0]
    replica.reported(Report(False, {"problems": ["probe npu stuck for 300s"]}, frozenset()))
    assert replica.healthz() == (False, {"problems": ["probe npu stuck for 300s"]})


def test_a_rendering_is_served_while_young_asked_again_when_old_and_refused_when_too_old() -> None:
    asked: list[int] = []
    version = [1]
    rendering = Rendering("metrics", lambda: asked.append(1), lambda: version[0], (b"# first\n", 1))

    async def scrape(arrives: bytes | None = None) -> bytes | None:
        pending = asyncio.ensure_future(rendering.get())
        await asyncio.sleep(0.05)
        if arrives is not None:
            rendering.arrived(arrives, version[0])
        return await asyncio.wait_for(pending, 10)

    async def scrapes() -> None:  # one loop, as in the server
        assert await scrape() == b"# first\n" and asked == []  # young, of this snapshot: nobody asked
        version[0] = 2
        assert await scrape(b"# second\n") == b"# second\n" and asked == [1]  # older than the snapshot: asked
        # The agent does not answer: the last copy, after the wait; none once it is too old.
        version[0] = 3
        assert await scrape() == b"# second\n" and asked == [1, 1]
        rendering._copy = (b"# old\n", time.monotonic() - RENDERING_GIVE_UP_SECONDS - 1, 3)
        assert await scrape() is None and asked == [1, 1]  # the ask still pending is waited for, not repeated
        rendering._asked -= RENDERING_ASK_AGAIN_SECONDS  # until it is overdue
        assert await scrape(b"# third\n") == b"# third\n" and asked == [1, 1, 1]

    asyncio.run(scrapes())


def test_the_channel_refuses_frames_no_request_can_be() -> None:
    ours, theirs = socket.socketpair()
    agent_end, server_end = Channel(ours, max_frame=MAX_REQUEST_BYTES), Channel(theirs)
    server_end.send_json({"kind": "metrics"})
    assert agent_end.receive_json() == {"kind": "metrics"}
    with pytest.raises(ValueError, match="at most"):
        server_end.send_json({"kind": "pod", "name": "x" * MAX_REQUEST_BYTES})
    server_end.send_frame(b"[1, 2]")
    with pytest.raises(ChannelClosed, match="not a JSON object"):
        agent_end.receive_json()
    server_end.send_frame(b"\x80not json")
    with pytest.raises(ChannelClosed, match="not a JSON request"):
        agent_end.receive_json()
    theirs.sendall((MAX_REQUEST_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(ChannelClosed, match="a frame of"):
        agent_end.receive_json()
    server_end.close()
    with pytest.raises(ChannelClosed):
        agent_end.receive_json()
    agent_end.close()


def test_a_status_the_agent_does_not_render_again_is_its_last_copy_then_a_503_not_a_wait_forever() -> None:
    replica = Replica(setup_of(healthy_state()), lambda: None, lambda: None)

    async def ask() -> bytes | None:
        return await asyncio.wait_for(replica.status_document(), 10)

    first = json.loads(asyncio.run(ask()) or b"")
    assert first["from"] == "setup" and first["server_process"]["agent_pid"] == os.getpid()
    replica.status._copy = (b'{"from": "setup"}', time.monotonic() - RENDERING_GIVE_UP_SECONDS - 1, 1)
    assert asyncio.run(ask()) is None  # HttpServer answers 503 for None


# --- as processes ----------------------------------------------------------------------------------


def get(port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def until(what: str, check: object, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if check():  # type: ignore[operator]
                return
        time.sleep(0.1)
    raise AssertionError(f"not within {seconds:g}s: {what}")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[HealthState, ServerProcess]]:
    state = healthy_state()
    ledger = PodLedger(lambda: str(tmp_path / "no-kubelet.sock"), lambda: 1.0)
    server = ServerProcess(
        state,
        MetricsRenderer(state.current).render,
        lambda: (True, {"problems": []}),
        lambda: {"storage.space"},
        lambda: {"version": "test"},
        address="127.0.0.1",
        port=0,
        max_wait=10.0,
        metrics_port=None,
        status_on_main_port=True,
        health_port=None,
        proc="/proc",
        pod_ledger=ledger,
        logging_setup=("text", "info"),
    )
    server.start()
    try:
        yield state, server
    finally:
        server.stop()


def test_the_server_process_answers_from_each_snapshot_the_agent_publishes(
    served: tuple[HealthState, ServerProcess],
) -> None:
    state, server = served
    assert server.pid != os.getpid() and server.port
    assert get(server.port, "/ready")[0] == 200
    state.record("storage", [DISK.report(DISK_FULL, "/data", "99% used")])
    until("/ready not ready", lambda: get(server.port, "/ready")[0] == 503)
    assert b"DiskFull" in get(server.port, "/ready")[1]
    status, body = get(server.port, "/metrics")  # the agent's rendering of the snapshot the server holds
    assert status == 200 and b"nodehealth_ready 0.0" in body
    assert b"nodehealth_server_process_cpu_seconds_total" in body and b"nodehealth_http_connections" in body
    status, body = get(server.port, "/status")
    document = json.loads(body)
    assert status == 200 and document["version"] == "test" and not document["ready"]
    assert document["server_process"]["pid"] == server.pid and document["server_process"]["agent_pid"] == os.getpid()
    assert document["http"]["ports"][0]["port"] == server.port
    assert get(server.port, "/ready?checks=nope")[0] == 400  # the agent's known checks reach the server


def test_pod_queries_are_resolved_by_the_agents_ledger(served: tuple[HealthState, ServerProcess]) -> None:
    _, server = served
    status, body = get(server.port, "/ready?pod=default/job-1&format=text")
    assert status == 503
    # The agent's ledger (a socket that does not exist) answered, not the server's process (which has none).
    assert b"LedgerUnavailable" in body and b"no-kubelet.sock" in body, body


def test_a_killed_server_process_is_started_again_on_its_port(served: tuple[HealthState, ServerProcess]) -> None:
    _, server = served
    port, first = server.port, server.pid
    os.kill(first, signal.SIGKILL)
    until("a new server process", lambda: server.pid != first and get(port, "/ready")[0] == 200)
    assert server.restarts == 1 and server.port == port
    assert json.loads(get(port, "/status")[1])["http_server_restarts"] == 1


def test_stopping_ends_the_server_process(served: tuple[HealthState, ServerProcess]) -> None:
    _, server = served
    pid = server.pid
    server.stop()
    until("the server process gone", lambda: _ended(pid))


def test_the_server_process_ends_with_a_killed_agent(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(f"http:\n  address: 127.0.0.1\n  port: {port}\n")
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", "--no-kube", "--config", str(config)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        until("serving", lambda: get(port, "/healthz", 2.0)[0] in (200, 503), 60.0)
        children = _children(agent.pid)
        assert len(children) >= 1
        server = next(pid for pid in children if b"agent.http.serving" in Path(f"/proc/{pid}/cmdline").read_bytes())
        agent.kill()
        agent.wait(10)
        # Every thread, not only the leader: a killed process's leader is a zombie while its other threads
        # still exit, and the listening socket closes with the last of them.
        until("the server process gone", lambda: _ended(server), 30.0)
        until("the server's port closed", lambda: _refuses(port), 30.0)
    finally:
        agent.kill()
        agent.wait(10)


# --- under a CPU quota -------------------------------------------------------------------------------

BURN = "import time\nend = time.process_time() + 4\nwhile time.process_time() < end: pass\nprint('burnt')\n"
STRAY_SHARE = 10  # as tests/runtime/test_cpulimit.py: CFS hands quota out per CPU in slices


@pytest.mark.system
def test_under_a_quota_the_agent_joins_the_work_cgroup_and_the_server_keeps_its_headroom(tmp_path: Path) -> None:
    require_root()
    port = free_port()
    burner = tmp_path / "burn.py"
    burner.write_text(BURN)
    config = tmp_path / "config.yaml"
    site = {"name": "burn", "command": [sys.executable, str(burner)], "interval_seconds": 10, "timeout_seconds": 8}
    config.write_text(
        json.dumps({"http": {"address": "127.0.0.1", "port": port}, "site_checks": [site]}),
    )
    with scan_quota.CpuQuota(200) as quota:
        procs = quota.procs
        agent = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "--no-kube", "--config", str(config)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=lambda: procs.write_text(str(os.getpid())),
        )
        try:
            work = quota.path / "work"
            until("the agent's process in the work cgroup", lambda: agent.pid in _procs(work), 120.0)
            server = next(p for p in _children(agent.pid) if b"serving" in Path(f"/proc/{p}/cmdline").read_bytes())
            assert server in _procs(quota.path) and server not in _procs(work)
            container, work_group = _stat(quota.path), _stat(work)
            answered = 0
            end = time.monotonic() + 12  # at least one whole burn (4 s of CPU at the work cgroup's share)
            while time.monotonic() < end:
                answered += get(port, "/ready")[0] in (200, 503)
                time.sleep(0.1)
            container_after, work_after = _stat(quota.path), _stat(work)
        finally:
            agent.terminate()
            agent.wait(30)
    periods = container_after["nr_periods"] - container["nr_periods"]
    throttled = container_after["nr_throttled"] - container["nr_throttled"]
    assert work_after["nr_throttled"] - work_group["nr_throttled"] >= 5, (work_group, work_after)  # held to it
    assert throttled <= max(1, periods // STRAY_SHARE), (container, container_after)
    assert answered >= 50


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(child) for child in (task / "children").read_text().split()]
    return out


def _zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True


def _ended(pid: int) -> bool:
    """Every thread of the process is gone or a zombie (the leader alone says nothing of the others)."""
    try:
        tasks = [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return True
    return all(_zombie(task) for task in tasks)


def _refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return True
    return False


def _procs(group: Path) -> set[int]:
    with contextlib.suppress(OSError):
        return {int(pid) for pid in (group / "cgroup.procs").read_text().split()}
    return set()


def _stat(group: Path) -> dict[str, int]:
    fields = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    v2 = "throttled_usec" in fields
    return {
        "nr_periods": int(fields["nr_periods"]),
        "nr_throttled": int(fields["nr_throttled"]),
        "throttled": int(fields["throttled_usec" if v2 else "throttled_time"]),
    }
