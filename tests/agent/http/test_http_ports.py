"""The second port (http.metrics_port) for /metrics and /status, so a NetworkPolicy can open /ready to every pod and
/status to monitoring only: what each port serves on real sockets, with /metrics and /status kept on the main port
(the default, for scrape configs that name 9100) or not; one connection budget for both ports; a metrics port in
use leaves the pre-flight port serving; the config keys and the environment switch the network-policy component
sets, in-process and on a real `node-health run`.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from support.fake_node import free_port
from support.system import REPO

from agent.config import STATUS_ON_MAIN_PORT_ENV, ConfigError, HttpConfig, parse_config, status_on_main_port
from agent.http.routes import HttpServer
from agent.http.server import Limits
from agent.metrics import MetricsRenderer
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes.base import Finding, Status

PATHS = ("/ready", "/healthz", "/started", "/metrics", "/status")
ALL_ON_ONE_PORT = ["/ready", "/preflight.sh", "/healthz", "/started", "/metrics", "/status"]


@contextmanager
def serving(status_on_main: bool, metrics_port: int | None = 0, limits: Limits | None = None) -> Iterator[HttpServer]:
    state = HealthState("node-a", HealthSettings(fail_threshold=1, recovery_threshold=1))
    state.configure([ProbeSpec("storage", ("storage.space",), 60.0, 5.0)])
    state.record("storage", [Finding("storage.space", "/data", Status.OK, "OK", "40% used")])
    server = HttpServer(
        state,
        MetricsRenderer(state.current).render,
        lambda: (True, {"problems": []}),
        lambda: ("storage.space",),
        address="127.0.0.1",
        port=0,
        limits=limits,
        metrics_port=metrics_port,
        status_on_main_port=status_on_main,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def statuses(port: int) -> dict[str, int]:
    return {path: get(port, path)[0] for path in PATHS}


def test_separated_the_main_port_keeps_the_preflight_and_the_metrics_port_the_rest() -> None:
    with serving(status_on_main=False) as server:
        assert server.metrics_port not in (None, 0, server.port)
        assert statuses(server.port) == {
            "/ready": 200,
            "/healthz": 200,
            "/started": 200,
            "/metrics": 404,
            "/status": 404,
        }
        assert statuses(server.metrics_port) == {
            "/ready": 404,
            "/healthz": 200,
            "/started": 200,
            "/metrics": 200,
            "/status": 200,
        }
        assert (
            json.loads(get(server.port, "/status")[1])["error"]
            == "no such endpoint /status on this port (try /ready, /preflight.sh, /healthz, /started)"
        )
        document = json.loads(get(server.metrics_port, "/status")[1])
        assert document["findings"][0]["message"] == "40% used"
        assert document["http"]["ports"] == [
            {"port": server.port, "routes": ["/ready", "/preflight.sh", "/healthz", "/started"]},
            {"port": server.metrics_port, "routes": ["/metrics", "/status", "/healthz", "/started"]},
        ]
        assert b"nodehealth_ready 1.0" in get(server.metrics_port, "/metrics")[1]


def test_by_default_metrics_and_status_stay_on_the_main_port_too() -> None:
    with serving(status_on_main=True) as server:
        assert server.metrics_port is not None
        assert set(statuses(server.port).values()) == {200}
        assert statuses(server.metrics_port)["/status"] == 200
    with serving(status_on_main=True, metrics_port=None) as server:
        assert server.metrics_port is None
        assert json.loads(get(server.port, "/status")[1])["http"]["ports"] == [
            {"port": server.port, "routes": ALL_ON_ONE_PORT}
        ]


def test_both_ports_count_against_one_connection_budget() -> None:
    limits = Limits(max_connections=3, local_reserve=0, new_peer_reserve=0, max_per_peer=64)
    with serving(status_on_main=False, limits=limits) as server:
        held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(3)]
        try:
            time.sleep(0.2)  # admitted by the loop
            with socket.create_connection(("127.0.0.1", server.metrics_port), timeout=5) as extra:
                extra.settimeout(5)
                answer = extra.recv(4096)
            assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 5
        while get_or_none(server.metrics_port) != 200:
            assert time.monotonic() < deadline, "the slot comes back once the others leave"
            time.sleep(0.05)


def get_or_none(port: int) -> int | None:
    try:
        return get(port, "/healthz")[0]
    except OSError:
        return None


def test_a_metrics_port_in_use_leaves_the_preflight_port_serving() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with serving(status_on_main=True, metrics_port=port) as server:
            assert server.metrics_port is None
            assert get(server.port, "/ready")[0] == 200
            document = json.loads(get(server.port, "/status")[1])
            assert f"127.0.0.1:{port}" in document["http"]["metrics_port_error"]
            assert document["http"]["ports"] == [{"port": server.port, "routes": ALL_ON_ONE_PORT}]


def test_the_config_keys_and_the_environment_switch() -> None:
    assert parse_config({}).http == HttpConfig(metrics_port=9101, status_on_main_port=True)
    for bad, key in (
        ({"port": 9200, "metrics_port": 9200}, "http.metrics_port"),
        ({"status_on_main_port": False, "metrics_port": 0}, "http.status_on_main_port"),
        ({"metrics_port": 70000}, "metrics_port"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            parse_config({"http": bad})
    http = parse_config({"http": {"status_on_main_port": True}}).http
    assert status_on_main_port(http, {}) is True
    assert status_on_main_port(http, {STATUS_ON_MAIN_PORT_ENV: "false"}) is False
    assert status_on_main_port(http, {STATUS_ON_MAIN_PORT_ENV: " TRUE "}) is True
    with pytest.raises(ConfigError, match=STATUS_ON_MAIN_PORT_ENV):
        status_on_main_port(http, {STATUS_ON_MAIN_PORT_ENV: "no\x1b[31m"})
    without = parse_config({"http": {"metrics_port": 0}}).http
    with pytest.raises(ConfigError, match=r"needs http\.metrics_port"):
        status_on_main_port(without, {STATUS_ON_MAIN_PORT_ENV: "false"})


def run_agent(tmp_path: Path, env: dict[str, str], http_config: dict[str, object]) -> subprocess.Popen[bytes]:
    config = tmp_path / "config.yaml"
    settings = {"http": {"address": "127.0.0.1", **http_config}, "kubernetes": {"enabled": False}}
    settings["probes"] = {"host": {"interval_seconds": 5}}
    config.write_text(yaml.safe_dump(settings))
    return subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", "--no-kube", "--config", str(config)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.system
def test_a_real_agent_with_the_components_switch_serves_status_on_the_metrics_port_only(tmp_path: Path) -> None:
    main, metrics = free_port(), free_port()
    agent = run_agent(tmp_path, {STATUS_ON_MAIN_PORT_ENV: "false"}, {"port": main, "metrics_port": metrics})
    try:
        deadline = time.monotonic() + 30
        while get_or_none(metrics) != 200:
            assert agent.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        on_main = statuses(main)
        assert (on_main["/healthz"], on_main["/metrics"], on_main["/status"]) == (200, 404, 404)
        assert get(metrics, "/status")[0] == 200 and get(metrics, "/metrics")[0] == 200
        assert get(metrics, "/ready")[0] == 404
    finally:
        agent.terminate()
        agent.wait(10)
    bad = run_agent(tmp_path, {STATUS_ON_MAIN_PORT_ENV: "maybe"}, {"port": main, "metrics_port": metrics})
    _, err = bad.communicate(timeout=30)
    assert bad.returncode == 2 and STATUS_ON_MAIN_PORT_ENV.encode() in err
