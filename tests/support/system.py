"""What a test needs of the machine: the repository, its fixtures, and capabilities.

System tests need host capabilities (root, mount, FUSE, network namespaces, Debian tools). Locally a
missing capability skips the test; in CI (`NODE_HEALTH_SYSTEM_TESTS=required`) it fails loudly instead.
Fixtures live in the repository (tests/fixtures): a missing one fails, it never skips.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from probes.runtime.children import ChildCalls

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"

SYSTEM_TESTS_REQUIRED = os.environ.get("NODE_HEALTH_SYSTEM_TESTS", "") == "required"

# Set by conftest before each test: whether it carries @pytest.mark.system. A test that asks for a system
# capability without the marker fails, so `pytest -m "not system"` (the fast tier) never needs one.
_current_test_is_system = True


def set_current_test_system(marked: bool) -> None:
    global _current_test_is_system
    _current_test_is_system = marked


def assert_system_test(what: str) -> None:
    """Fail a test that uses `what` (root, a tool, FUSE, a server) without @pytest.mark.system."""
    if not _current_test_is_system:
        pytest.fail(f"this test uses {what}: mark it @pytest.mark.system", pytrace=False)


def require(condition: bool, what: str) -> None:
    """Skip (locally) or fail (CI) when a capability the test needs is missing."""
    assert_system_test(what)
    if condition:
        return
    if SYSTEM_TESTS_REQUIRED:
        pytest.fail(f"required system capability missing: {what}", pytrace=False)
    pytest.skip(f"missing system capability: {what}")


def require_root() -> None:
    require(os.geteuid() == 0, "root")


def require_tool(name: str) -> str:
    """A tool on PATH, or beside this interpreter (a venv's bin/ when the tests run as venv/bin/python -m
    pytest without the venv on PATH)."""
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    require(path is not None, f"{name} on PATH or beside {sys.executable}")
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


@contextlib.contextmanager
def traversable_tmp_dir(prefix: str) -> Iterator[Path]:
    """A temp dir another uid (a job's) can traverse, removed afterwards: pytest's own tmp_path sits below a
    0700 directory."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
