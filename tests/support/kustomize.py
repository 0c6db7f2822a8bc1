"""`kubectl kustomize` for the tests: a directory rendered to its documents, and overlays of our own."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from support.system import require_tool


def kustomize(directory: Path) -> subprocess.CompletedProcess[str]:
    kubectl = require_tool("kubectl")
    return subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)


def rendered(directory: Path) -> list[dict[str, Any]]:
    result = kustomize(directory)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def overlay(directory: Path, resources: list[Path | str], components: tuple[Path, ...] = ()) -> Path:
    """A kustomization of our own in `directory`; kustomize takes only relative paths to other kustomizations."""
    directory.mkdir(parents=True, exist_ok=True)

    def relative(path: Path | str) -> str:
        return os.path.relpath(path, directory) if isinstance(path, Path) else path

    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [relative(r) for r in resources],
        "components": [relative(c) for c in components],
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory
