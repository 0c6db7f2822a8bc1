"""pytest configuration shared by the tests. Helpers live in tests/support (tests import those, never this file)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from support import system

# A probe that emits a reason (or a status for it) it does not declare raises in every test, and in every
# agent the tests start as a subprocess.
os.environ["NODE_HEALTH_STRICT_REASONS"] = "1"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    system.set_current_test_system(item.get_closest_marker("system") is not None)


@pytest.fixture
def python_exe() -> str:
    return sys.executable


@pytest.fixture
def double() -> Iterator[Any]:
    """The Kubernetes API double (tests/support/kube_double.py) serving on 127.0.0.1, stopped afterwards."""
    from support.kube_double import running_double

    system.assert_system_test("the Kubernetes API double (a server on 127.0.0.1)")
    with running_double() as api:
        yield api
