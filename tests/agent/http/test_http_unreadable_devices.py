"""Never ready on a guess: a fake accelerator node (/dev/davinci0 mknod'd under a fake host root, no npu-smi
anywhere) is not ready, by `node-health check` (exit 1) and by the real daemon's /ready (503), because the chips'
health cannot be read; `npu.unreadable_blocks_ready: false` lets it be ready. Real processes, real HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.cli import node_env
from support.fake_npu_smi import make_dev
from support.processes import answers_200, free_port, serving

from probes import all_probes

pytestmark = pytest.mark.system


def accelerator_node(tmp_path: Path, blocks: bool | None) -> dict[str, Any]:
    """Only the npu probe, on a host root whose /dev has davinci0 and whose bin directories have no npu-smi."""
    root = tmp_path / "host"
    (root / "proc").mkdir(parents=True)
    dev = make_dev(root / "dev", {"davinci0": (240, 0)})
    npu: dict[str, Any] = {"smi_command": ["npu-smi-not-installed-here"]}
    if blocks is not None:
        npu["unreadable_blocks_ready"] = blocks
    return {
        "host": {"root": str(root), "dev": str(dev)},
        "npu": npu,
        "kubernetes": {"pod_resources_socket": ""},
        "probes": {name: {"enabled": name == "npu", "jitter_fraction": 0.0} for name in all_probes()},
    }


def env_without_npu_smi(tmp_path: Path) -> dict[str, str]:
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    return {**node_env(), "PATH": f"{empty}:{os.path.dirname(sys.executable)}"}


def run_check(tmp_path: Path, config: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-m", "agent.cli", "check", "--config", str(path), "--only", "npu", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env_without_npu_smi(tmp_path))
    return done.returncode, json.loads(done.stdout)


def test_check_is_not_ready_when_the_chips_cannot_be_read(tmp_path: Path) -> None:
    code, document = run_check(tmp_path, accelerator_node(tmp_path, None))
    assert code == 1, document
    reasons = {(r["check"], r["reason"]) for r in document["reasons"]}
    assert ("npu.health", "NpuToolMissing") in reasons and ("npu.smi", "NpuToolMissing") in reasons
    health = next(f for f in document["findings"] if f["check"] == "npu.health")
    assert health["required"] is True and "npu.unreadable_blocks_ready" in health["hint"]


def test_check_opted_out_is_ready(tmp_path: Path) -> None:
    code, document = run_check(tmp_path, accelerator_node(tmp_path, False))
    assert code == 0, document
    health = next(f for f in document["findings"] if f["check"] == "npu.health")
    assert (health["status"], health["reason"]) == ("unknown", "NpuToolMissing") and "required" not in health


def ready(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("blocks", [None, False])
def test_the_daemons_ready_answers_503_until_opted_out(tmp_path: Path, blocks: bool | None) -> None:
    config = accelerator_node(tmp_path, blocks)
    port = free_port()
    config["http"] = {"address": "127.0.0.1", "port": port, "metrics_port": 0}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-m", "agent.cli", "run", "--no-kube", "--config", str(path)]
    env = env_without_npu_smi(tmp_path)

    def has_a_result() -> bool:
        if not answers_200(f"http://127.0.0.1:{port}/healthz"):
            return False
        return not any(r["reason"] == "WarmingUp" for r in ready(port)[1]["reasons"])

    saved = os.environ.copy()
    os.environ.clear()
    os.environ.update(env)  # serving() starts the daemon with this process's environment
    try:
        with serving(argv, has_a_result, tmp_path / "agent.log", "the agent"):
            status, answer = ready(port)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if blocks is None:
        assert status == 503, answer
        assert {r["reason"] for r in answer["reasons"]} == {"NpuToolMissing"}
    else:
        assert (status, answer["reasons"]) == (200, []), answer
