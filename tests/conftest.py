"""Shared test helpers.

System tests need host capabilities (root, mount, FUSE, network namespaces, Debian tools). Locally a
missing capability skips the test; in CI (`NODE_HEALTH_SYSTEM_TESTS=required`) it fails loudly instead.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO.parent / "shared" / "fixtures"
if not FIXTURES.is_dir():  # CI clones main elsewhere with shared/ beside it
    FIXTURES = Path(os.environ.get("NODE_HEALTH_FIXTURES", str(FIXTURES)))

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
