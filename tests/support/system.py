"""What a test needs of the machine: the repository, its fixtures, and capabilities.

System tests need host capabilities (root, mount, FUSE, network namespaces, Debian tools). Locally a
missing capability skips the test; in CI (`NODE_HEALTH_SYSTEM_TESTS=required`) it fails loudly instead.
Fixtures live in the repository (tests/fixtures): a missing one fails, it never skips.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from probes.runtime.host import ChildCalls

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"

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
    """The in-repo fixtures directory; its absence is a broken checkout, never a skip."""
    assert FIXTURES.is_dir(), f"fixtures directory {FIXTURES} is missing from the repository"
    return FIXTURES


def fixture_path(*parts: str) -> Path:
    path = require_fixtures().joinpath(*parts)
    assert path.is_file(), f"fixture {path} is missing from the repository"
    return path


def fuse_capable() -> None:
    require_root()
    require(Path("/dev/fuse").exists(), "/dev/fuse")
    require_tool("fusermount3")
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: libfuse not installed
        require(False, f"mfusepy with libfuse: {exc}")


def wait_reaped(children: ChildCalls, seconds: float = 10.0) -> dict[str, int]:
    end = time.monotonic() + seconds
    while children.in_flight() and time.monotonic() < end:
        time.sleep(0.05)
    return children.in_flight()
