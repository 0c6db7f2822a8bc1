"""Shared test helpers.

System tests need host capabilities (root, mount, FUSE, network namespaces, Debian tools). Locally a
missing capability skips the test; in CI (`NODE_HEALTH_SYSTEM_TESTS=required`) it fails loudly instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def _find_fixtures() -> Path:
    """shared/fixtures beside the checkout (as CI lays it out), $NODE_HEALTH_FIXTURES, or beside the
    checkout this one was cloned from (a local scratch clone elsewhere)."""
    candidates = []
    if os.environ.get("NODE_HEALTH_FIXTURES"):
        candidates.append(Path(os.environ["NODE_HEALTH_FIXTURES"]))
    candidates.append(REPO.parent / "shared" / "fixtures")
    try:
        origin = subprocess.run(
            ["git", "-C", str(REPO), "config", "--get", "remote.origin.url"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        origin = ""
    if origin.startswith("/"):
        candidates.append(Path(origin).parent / "shared" / "fixtures")
    return next((path for path in candidates if path.is_dir()), candidates[0])


FIXTURES = _find_fixtures()

SYSTEM_TESTS_REQUIRED = os.environ.get("NODE_HEALTH_SYSTEM_TESTS", "") == "required"


def require(condition: bool, what: str) -> None:
    """Skip (locally) or fail (CI) when a capability the test needs is missing."""
    if condition:
        return
    if SYSTEM_TESTS_REQUIRED:
        pytest.fail(f"required system capability missing: {what}", pytrace=False)
    pytest.skip(f"missing system capability: {what}")


def require_root() -> None:
    require(os.geteuid() == 0, "root")


def require_tool(name: str) -> str:
    path = shutil.which(name)
    require(path is not None, f"{name} on PATH")
    return path or ""


def require_fixtures() -> Path:
    require(FIXTURES.is_dir(), f"fixtures directory {FIXTURES}")
    return FIXTURES


@pytest.fixture
def python_exe() -> str:
    return sys.executable


@pytest.fixture
def double() -> Iterator[Any]:
    """The Kubernetes API double (tests/kube_double.py) serving on 127.0.0.1, stopped afterwards."""
    from kube_double import running_double

    with running_double() as api:
        yield api
