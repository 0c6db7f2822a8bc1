"""The daemon with a real hung FUSE mount: /ready, /healthz and /metrics keep answering, the mount is
reported MountHung, and no children pile up over many probe cycles."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from support.fusefs import fuse_mount
from support.system import require, require_root, require_tool

from agent.config import parse_config
from agent.daemon import Agent
from probes import all_probes

pytestmark = pytest.mark.system


def fetch(port: int, path: str) -> tuple[int, bytes, float]:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as response:
            return response.status, response.read(), time.monotonic() - started
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), time.monotonic() - started


def test_http_keeps_answering_while_a_mount_hangs(tmp_path: Path) -> None:
    require_root()
    require_tool("fusermount3")
    require(Path("/dev/fuse").exists(), "/dev/fuse")
    with fuse_mount(tmp_path, "--hang-getattr") as mount:
        classes = all_probes()
        config = parse_config(
            {
                "http": {"address": "127.0.0.1", "port": 0},
                "storage": {
                    "mounts": [{"path": str(mount.path), "fstype": "fuse*"}],
                    "space": [{"path": "/"}],
                    "mount_timeout_seconds": 0.5,
                    "space_timeout_seconds": 0.5,
                },
                "probes": {
                    "storage.mounts": {"interval_seconds": 0.5, "timeout_seconds": 2, "jitter_fraction": 0},
                    "storage.space": {"interval_seconds": 0.5, "timeout_seconds": 2, "jitter_fraction": 0},
                },
            },
            classes,
        )
        agent = Agent(None, config, no_kube=True, probe_classes=classes)
        agent.start()
        me = psutil.Process()
        try:
            port = agent.http.port
            children_seen = []
            reasons: set[tuple[str, str]] = set()
            for _ in range(30):  # about 6 s: a dozen cycles of each storage probe
                time.sleep(0.2)
                status, body, _ = fetch(port, "/ready")
                assert status in (200, 503)
                reasons |= {(r["check"], r["reason"]) for r in json.loads(body)["reasons"]}
                assert fetch(port, "/healthz")[0] == 200
                assert fetch(port, "/metrics")[0] == 200
                children_seen.append(sum(1 for c in me.children() if c.pid != mount.daemon_pid))
            assert ("storage.mounts", "MountHung") in reasons
            in_flight = agent.host.children.in_flight()
            assert all(str(mount.path) in key for key in in_flight), in_flight
            # one stuck child for the mount at most (plus a short-lived statvfs child), whatever the cycles
            assert max(children_seen) <= 2, children_seen
            doc = json.loads(fetch(port, "/status")[1])
            root = next(f for f in doc["findings"] if f["check"] == "storage.space" and f["subject"] == "/")
            assert root["status"] == "ok", "a hung mount must not delay checks of other paths"
        finally:
            agent.shutdown()
