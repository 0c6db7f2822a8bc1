"""Runs the gpu probe (or another, such as gpu.links) once in a fresh Python process (pynvml keeps module-global
state, and the loader reads LD_LIBRARY_PATH at start), against the fake libnvidia-ml.so.1 and a fake host, and
returns what it reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from support.system import REPO

RUNNER = r"""
import importlib, json, sys
from agent.config import parse_config
from probes.runtime.host import Host
from agent.scheduler import execute

config = parse_config(json.loads(sys.argv[1]))
host = Host(proc=sys.argv[5], dev=sys.argv[2], root=sys.argv[3])
module, name = sys.argv[4].split(":")
cls = getattr(importlib.import_module(module), name)
probe = cls() if sys.argv[6] == "" else cls(lambda: float(sys.argv[6]))  # a clock, for the window probes
result, findings, samples = execute(probe, host, config, 20.0)
print(json.dumps({
    "result": result,
    "findings": [f.to_dict() for f in findings],
    "samples": [{"name": s.name, "value": s.value, "labels": dict(s.labels), "kind": s.kind} for s in samples],
    "pynvml_imported": "pynvml" in sys.modules,
    "devices": [[d.kind, d.index, d.name, d.bus_id] for d in host.devices.all()],
}))
"""

NO_SMI = ["/nonexistent/nvidia-smi"]
GIB_80 = 81559


class Run:
    def __init__(self, data: dict[str, Any], calls: list[str]) -> None:
        self.result: str = data["result"]
        self.findings: list[dict[str, Any]] = data["findings"]
        self.samples: list[dict[str, Any]] = data["samples"]
        self.pynvml_imported: bool = data["pynvml_imported"]
        self.devices: list[list[Any]] = data["devices"]
        self.calls = calls

    def finding(self, check: str, subject: str) -> dict[str, Any]:
        found = [f for f in self.findings if f["check"] == check and f["subject"] == subject]
        assert len(found) == 1, (check, subject, self.findings)
        return found[0]

    def sample(self, metric: str, /, **labels: str) -> float:
        found = [
            s for s in self.samples if s["name"] == metric and all(s["labels"].get(k) == v for k, v in labels.items())
        ]
        assert len(found) == 1, (metric, labels, found)
        return found[0]["value"]


def run_probe(
    tmp_path: Path,
    library_dir: Path | None,
    config_text: str,
    gpu_config: dict[str, Any] | None = None,
    dev_dir: Path | None = None,
    host_root: Path | None = None,
    top: dict[str, Any] | None = None,
    probe: str = "probes.gpu.gpu:GpuProbe",
    proc: Path | None = None,
    now: float | None = None,
) -> Run:
    scenario = tmp_path / "fake-nvml.conf"
    scenario.write_text(config_text)
    log = tmp_path / "nvml-calls.log"
    log.unlink(missing_ok=True)
    dev = dev_dir or tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_NVML_CONFIG")}
    env.update(PYTHONPATH=str(REPO), FAKE_NVML_CONFIG=str(scenario), FAKE_NVML_LOG=str(log))
    env["NODE_HEALTH_STRICT_REASONS"] = "1"  # an undeclared reason fails the run (result "error")
    if library_dir is not None:
        env["LD_LIBRARY_PATH"] = str(library_dir)
    config = {**(top or {}), "gpu": {"smi_command": NO_SMI, **(gpu_config or {})}}
    root = host_root or tmp_path / "empty-host-root"
    root.mkdir(exist_ok=True)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            RUNNER,
            json.dumps(config),
            str(dev),
            str(root),
            probe,
            str(proc or "/proc"),
            "" if now is None else repr(now),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().split() if log.exists() else []
    run = Run(json.loads(proc.stdout), calls)
    assert run.result in ("ok", "skip"), run.findings  # "error": the probe raised (an undeclared reason, a bug)
    return run
