"""End to end: `node-health check --json --only network,time` against real servers on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.netservers import DnsTestServer, HttpTestServer, SntpTestServer, ZoneResolver, servers
from support.system import REPO

CLI = "from agent.cli import main; raise SystemExit(main())"


def node_health(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.system
def test_check_json_not_ready_with_reasons(tmp_path: Path) -> None:
    with servers() as started:
        dns = DnsTestServer(ZoneResolver({"mirror.test": "127.0.0.1"}, nxdomain=("github.test",)))
        mirror = HttpTestServer({"/simple/": 503, "/": 200})
        skewed = SntpTestServer(skew=2.0)
        started.extend([dns, mirror, skewed])
        config = {
            "network": {
                "dns": {"names": ["mirror.test", "github.test"], "nameservers": [dns.address]},
                "egress": [
                    {
                        "name": "pypi-mirror",
                        "host": "mirror.test",
                        "port": mirror.port,
                        "tls": False,
                        "http_path": "/simple/",
                    },
                    {"name": "mirror-root", "host": "mirror.test", "port": mirror.port, "tls": False, "http_path": "/"},
                ],
                "ports": {"check_reserved": False},
            },
            "time": {"ntp_servers": [skewed.address], "chronyc_command": []},
            "kubernetes": {"enabled": False},
        }
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        result = node_health("check", "--json", "--config", str(path), "--only", "network.dns,network.egress,time")
    assert result.returncode == 1, result.stderr
    document = json.loads(result.stdout)
    assert document["ready"] is False
    found = {(f["check"], f["subject"]): f for f in document["findings"]}
    assert found[("network.dns", "mirror.test")]["status"] == "ok"
    assert found[("network.dns", "github.test")]["reason"] == "DnsFailed"
    assert "NXDOMAIN" in found[("network.dns", "github.test")]["message"]
    assert found[("network.egress", "pypi-mirror")]["reason"] == "EgressHttpStatus"
    assert found[("network.egress", "mirror-root")]["status"] == "ok"
    assert found[("time.sync", skewed.address)]["reason"] == "ClockSkew"
    assert found[("network.dns", "github.test")]["category"] == "network"
    assert found[("time.sync", skewed.address)]["category"] == "time"
    assert not any(f["check"] == "network.links" for f in document["findings"])
    reasons = {(r["check"], r["reason"]) for r in document["reasons"]}
    assert {("network.dns", "DnsFailed"), ("network.egress", "EgressHttpStatus"), ("time.sync", "ClockSkew")} <= reasons


def test_bad_network_config_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"network": {"dns": {"nameservers": ["dns.example"]}}}))
    result = node_health("check", "--config", str(path), "--only", "network.dns")
    assert result.returncode == 2
    assert "network.dns.nameservers" in result.stderr
