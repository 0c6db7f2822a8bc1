"""Probe families, one module each. Importing `all_probes()` discovers every module in this package."""

from __future__ import annotations

import importlib
import pkgutil

from probes.base import REGISTRY, Probe

_SKIP_MODULES = {"base"}


def all_probes() -> dict[str, type[Probe]]:
    """Every registered probe class by name, after importing each probe module of this package."""
    for info in pkgutil.iter_modules(__path__):
        if info.name in _SKIP_MODULES or info.name.startswith("_"):
            continue
        importlib.import_module(f"{__name__}.{info.name}")
    return dict(sorted(REGISTRY.items()))


def all_checks() -> dict[str, str]:
    """Check name → probe name."""
    return {check: name for name, cls in all_probes().items() for check in cls.checks}
