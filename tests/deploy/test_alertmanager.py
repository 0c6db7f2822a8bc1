"""deploy/prometheus/alertmanager.yaml with the real Alertmanager (Debian's prometheus-alertmanager and amtool).

`amtool check-config` accepts it; `amtool config routes test` sends the fleet alert (critical) to the pager and the
per-node alerts to tickets. Then an Alertmanager on 127.0.0.1 is given, as Prometheus would send them, a fleet alert
for MountHung in cluster prod and per-node alerts: the per-node MountHung alerts of prod and NodeHealthNodeNotReady
in prod are suppressed (inhibited by the fleet alert), those of another reason or another cluster are not; the
groups are one per cluster and reason.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.processes import answers_200, free_port, serving
from support.system import REPO, require_tool

CONFIG = REPO / "deploy" / "prometheus" / "alertmanager.yaml"


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_tool("amtool"), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.system
def test_amtool_accepts_the_config_and_pages_only_for_the_fleet_alert() -> None:
    checked = amtool("check-config", str(CONFIG))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    cases = {
        ("NodeHealthFleetProblem", "critical"): "node-health-pager",
        ("NodeHealthMountHung", "warning"): "node-health-tickets",
        ("NodeHealthAgentDown", "warning"): "node-health-tickets",
        ("NodeHealthConfigReloadRejected", "info"): "node-health-tickets",
    }
    for (alertname, severity), receiver in cases.items():
        routed = amtool(
            "config", "routes", "test", f"--config.file={CONFIG}", f"alertname={alertname}", f"severity={severity}"
        )
        assert routed.stdout.strip() == receiver, (alertname, routed.stdout, routed.stderr)
    route = yaml.safe_load(CONFIG.read_text())["route"]
    assert route["group_by"] == ["cluster", "reason"]


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    binary = require_tool("prometheus-alertmanager")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        binary,
        f"--config.file={CONFIG}",
        f"--storage.path={tmp_path}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
    ]
    with serving(argv, lambda: answers_200(f"{url}/-/ready"), tmp_path / "alertmanager.log", "alertmanager"):
        yield url


def alert(alertname: str, severity: str, **labels: str) -> dict[str, Any]:
    now = datetime.now(timezone.utc)
    return {
        "labels": {"alertname": alertname, "severity": severity, **labels},
        "annotations": {"summary": alertname},
        "startsAt": (now - timedelta(minutes=15)).isoformat(),
        "endsAt": (now + timedelta(hours=1)).isoformat(),
    }


def api(url: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/api/v2/{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read()
    return json.loads(text) if text else None


@pytest.mark.system
def test_a_fleet_alert_inhibits_the_per_node_alerts_of_its_reason(alertmanager: str) -> None:
    mount = {"check": "storage.mounts", "subject": "/mnt/share", "reason": "MountHung"}
    sent = [
        alert("NodeHealthFleetProblem", "critical", cluster="prod", reason="MountHung"),
        *(alert("NodeHealthMountHung", "warning", cluster="prod", node=f"gpu-{n}", **mount) for n in range(3)),
        alert("NodeHealthNodeNotReady", "warning", cluster="prod", node="gpu-0"),
        alert("NodeHealthMountHung", "warning", cluster="lab", node="lab-1", **mount),
        alert("NodeHealthDnsFailing", "warning", cluster="prod", node="gpu-7", reason="DnsFailed", subject="x"),
    ]
    api(alertmanager, "alerts", sent)
    deadline = time.monotonic() + 20
    while True:
        alerts = api(alertmanager, "alerts")
        states = {
            (a["labels"]["alertname"], a["labels"]["cluster"], a["labels"].get("node", "")): a["status"]["state"]
            for a in alerts
        }
        if len(states) == len(sent) and "suppressed" in states.values():
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.3)
    assert states == {
        ("NodeHealthFleetProblem", "prod", ""): "active",
        ("NodeHealthMountHung", "prod", "gpu-0"): "suppressed",
        ("NodeHealthMountHung", "prod", "gpu-1"): "suppressed",
        ("NodeHealthMountHung", "prod", "gpu-2"): "suppressed",
        ("NodeHealthNodeNotReady", "prod", "gpu-0"): "suppressed",
        ("NodeHealthMountHung", "lab", "lab-1"): "active",
        ("NodeHealthDnsFailing", "prod", "gpu-7"): "active",
    }
    groups = api(alertmanager, "alerts/groups")
    keys = {(g["labels"].get("cluster"), g["labels"].get("reason"), g["receiver"]["name"]) for g in groups}
    assert ("prod", "MountHung", "node-health-pager") in keys
    assert ("prod", "MountHung", "node-health-tickets") in keys  # the per-node ones: one group, muted
    assert ("lab", "MountHung", "node-health-tickets") in keys
