"""Probe families, the lower layer of node-health. Importing `all_probes()` discovers every module here.

Layout: `probes/<family>/` is a family package (its `__init__.py` declares the family: config section,
title, docs page); `probes/<family>/<name>.py` holds the probe named `<family>.<name>`, and a family's
probe named just `<family>` lives in `probes/<family>/<family>.py`. A single module `probes/<name>.py` may
be a family of its own. `probes/runtime/` is the probe runtime (host access, /proc scanning, py-spy);
`probes/base.py` the contract. Nothing in this package imports `agent`.

- `base`: the contract (statuses, findings, reasons, categories, the probe class and registry); `family`:
  families and their config sections; `text`: text escaped and bounded for where it is shown.
- `ledger`: what the npu and gpu families say alike of the device plugins' ledger.
- `runtime/`: the probe runtime. The families: `host/`, `npu/`, `pcie/`, `gpu/`, `storage/`, `network/`,
  `interconnect/` (InfiniBand/RoCE HCA ports), `time/`, `kernel/` (the kernel log), `site/` (the site's own
  checks).
"""

from __future__ import annotations

import importlib
import pkgutil

from probes.base import REGISTRY, Probe
from probes.family import FAMILIES, Family

# Not probe modules: the contract and the runtime.
_NOT_PROBES = {f"{__name__}.base", f"{__name__}.runtime"}


def _discover() -> None:
    for info in pkgutil.walk_packages(__path__, prefix=f"{__name__}.", onerror=_raise):
        if any(info.name == skip or info.name.startswith(skip + ".") for skip in _NOT_PROBES):
            continue
        importlib.import_module(info.name)


def _raise(name: str) -> None:
    raise ImportError(f"cannot import probe package {name}")


def all_probes() -> dict[str, type[Probe]]:
    """Every registered probe class by name, after importing each probe module of this package."""
    _discover()
    return dict(sorted(REGISTRY.items()))


def all_families() -> dict[str, Family]:
    """Every declared family by config key, in `config --defaults` order."""
    _discover()
    return dict(sorted(FAMILIES.items(), key=lambda item: (item[1].order, item[0])))
