"""Ascend NPUs through npu-smi: chip health, HBM, out-of-band holders.

- `npu`: the probe (npu.smi, npu.health, npu.hbm, npu.holders); `config`: the `npu:` section.
- `smi`: running npu-smi; `info_table`, `details`, `completeness`: its outputs parsed, and whether a table is
  whole (pure).
- `findings`: npu.health and npu.hbm; `holder_findings`: who holds each chip; `ledger_findings`: the chips as
  the device plugin's ledger has them (npu.ledger).
- `metrics`: the per-chip samples; `reasons`: the checks and every reason the family gives.
"""

from __future__ import annotations

from probes.family import Family, register_family
from probes.npu.config import NpuConfig

FAMILY = register_family(
    Family(key="npu", module=__name__, config=NpuConfig, title="Ascend NPU", doc="docs/probes/npu.md", order=20)
)
