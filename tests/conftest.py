"""pytest fixtures shared by the tests. Helpers live in tests/support (tests import those, never this file)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def python_exe() -> str:
    return sys.executable


@pytest.fixture
def double() -> Iterator[Any]:
    """The Kubernetes API double (tests/support/kube_double.py) serving on 127.0.0.1, stopped afterwards."""
    from support.kube_double import running_double

    with running_double() as api:
        yield api
