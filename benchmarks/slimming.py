"""What the image's slimming (scripts/slim_venv.py) saves, against the same venv unslimmed in the same run.

    python benchmarks/slimming.py [--seconds 25] [--output benchmarks/results/slimming.json]

Two venvs with this checkout's runtime dependencies as binary wheels and the package itself, as the Dockerfile's
build stage makes them; one is then slimmed. For each: its size on disk (du), and the peak RSS (VmHWM) of
`node-health run` with Kubernetes on, reconciling its Node on the Kubernetes API double (tests/support/
kube_double.py), storage.space the only probe, after `--seconds`. The slimming removes files the agent never
imports, so the RSS should not move; the size is the image's venv. Needs the package index (pip).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO)]

from support.kube_double import ApiDouble  # noqa: E402

from probes import all_probes  # noqa: E402


def make_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pip = [str(path / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "--only-binary=:all:", *dependencies], check=True)
    subprocess.run([*pip, "--no-deps", str(REPO)], check=True)
    return path / "bin" / "python"


def megabytes(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6


def peak_rss_mib(python: Path, config: Path, seconds: float) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_") and k != "PYTHONPATH"}
    env.update(NODE_NAME="slim-node", POD_NAMESPACE="node-health")
    agent = subprocess.Popen(
        [str(python), "-m", "agent.cli", "run", "--config", str(config)],
        env=env,
        cwd="/",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(seconds)
        status = Path(f"/proc/{agent.pid}/status").read_text()
    finally:
        agent.terminate()
        agent.wait(timeout=15)
    (line,) = [line for line in status.splitlines() if line.startswith("VmHWM:")]
    return int(line.split()[1]) / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "slimming.json")
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as work, ApiDouble() as api:
        root = Path(work)
        api.add_node("slim-node")
        config = {
            "http": {"address": "127.0.0.1", "port": 0},
            "kubernetes": {"kubeconfig": str(api.write_kubeconfig(root / "kubeconfig")), "max_unhealthy": "1"},
            "probes": {name: {"enabled": name == "storage.space"} for name in all_probes()},
            "storage": {"space": [{"path": "/"}]},
        }
        (root / "config.yaml").write_text(yaml.safe_dump(config))
        full = make_venv(root / "full")
        shutil.copytree(root / "full", root / "slim", symlinks=True)
        slim = root / "slim" / "bin" / "python"
        subprocess.run([str(slim), str(REPO / "scripts" / "slim_venv.py")], check=True, cwd="/")
        for name, python in (("unslimmed", full), ("slimmed", slim)):
            results[name] = {
                "venv_mb": round(megabytes(python.parents[1]), 1),
                "peak_rss_mib": round(peak_rss_mib(python, root / "config.yaml", args.seconds), 1),
            }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
