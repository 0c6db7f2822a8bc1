"""The pre-flight script served by the agent (GET /preflight.sh, agent/http/routes.py): the same bytes as
deploy/examples/preflight.sh, fetched over real HTTP from a real agent (its HTTP server and health state on
127.0.0.1) with curl and run by dash and busybox sh, as the init container of deploy/components/preflight-injection
does: ready is exit 0, a real problem exit 1."""

from __future__ import annotations

import http.client
import os
import subprocess
from pathlib import Path

import pytest
from support.preflight import SCRIPT
from support.system import REPO, require_tool

from agent.http.routes import PREFLIGHT_SCRIPT, SCRIPT_TYPE, HttpServer
from agent.metrics import MetricsRenderer
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes.base import Finding, Status

SHIPPED = REPO / "agent" / "http" / "preflight.sh"


def test_the_served_script_is_the_example_script() -> None:
    assert SHIPPED.read_bytes() == SCRIPT.read_bytes() == PREFLIGHT_SCRIPT, (
        "agent/http/preflight.sh must be deploy/examples/preflight.sh: cp deploy/examples/preflight.sh agent/http/"
    )


def served_agent() -> tuple[HealthState, HttpServer]:
    state = HealthState("node-a", HealthSettings(fail_threshold=1, recovery_threshold=1))
    state.configure([ProbeSpec("p0", ("storage.space",), 60.0, 5.0)])
    server = HttpServer(
        state,
        MetricsRenderer(state.current).render,
        lambda: (True, {"problems": []}),
        lambda: ["storage.space"],
        address="127.0.0.1",
        port=0,
    )
    server.start()
    return state, server


def get(port: int, path: str, method: str = "GET") -> tuple[int, str, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read()
    finally:
        connection.close()


@pytest.mark.system  # a server on 127.0.0.1
@pytest.mark.parametrize("shell", ["dash", "busybox"])
def test_fetched_from_the_agent_and_run(shell: str, tmp_path: Path) -> None:
    state, server = served_agent()
    try:
        assert get(server.port, "/preflight.sh") == (200, SCRIPT_TYPE, SCRIPT.read_bytes())
        assert get(server.port, "/preflight.sh", "HEAD")[:2] == (200, SCRIPT_TYPE)
        assert get(server.port, "/preflight.sh?x=1")[0] == 400
        url = f"http://127.0.0.1:{server.port}"
        fetched = tmp_path / "preflight.sh"
        curl = require_tool("curl")
        subprocess.run([curl, "-fsS", "-o", str(fetched), f"{url}/preflight.sh"], check=True, timeout=30)
        argv = [require_tool("busybox"), "sh"] if shell == "busybox" else [require_tool(shell)]

        def run() -> subprocess.CompletedProcess[str]:
            env = {"PATH": os.environ["PATH"], "NODE_HEALTH_URL": url}
            return subprocess.run([*argv, str(fetched)], env=env, capture_output=True, text=True, timeout=60)

        state.record("p0", [Finding("storage.space", "/data", Status.OK, "OK", "12% used", "")])
        ready = run()
        assert ready.returncode == 0 and ready.stdout.splitlines()[-1] == "ready on node-a", ready
        state.record("p0", [Finding("storage.space", "/data", Status.FAIL, "DiskFull", "98% used", "clean it")])
        not_ready = run()
        assert not_ready.returncode == 1, not_ready
        assert "fail storage.space /data DiskFull: 98% used -- fix: clean it" in not_ready.stdout.splitlines()
    finally:
        server.stop()
