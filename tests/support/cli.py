"""The agent's CLI run as an operator runs it on a node: a real `python -m agent.cli` process of this checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from support.system import REPO


def node_env() -> dict[str, str]:
    """This environment as on a node, not in a pod (no KUBERNETES_*), importing this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def check_json(config: dict[str, Any], directory: Path, *options: str, timeout: float = 120) -> dict[str, Any]:
    """`node-health check --json` (and `options`, e.g. `--only storage.mounts`) on `config`, written to
    directory/config.yaml: the JSON verdict."""
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [sys.executable, "-m", "agent.cli", "check", "--config", str(path), "--json", *options],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=node_env(),
    )
    assert result.stdout.strip(), result.stderr
    return dict(json.loads(result.stdout))
