"""Ascend NPUs through npu-smi: chip health, HBM, out-of-band holders."""

from __future__ import annotations

from probes.family import Family, register_family
from probes.npu.config import NpuConfig

FAMILY = register_family(
    Family(key="npu", module=__name__, config=NpuConfig, title="Ascend NPU", doc="docs/probes/npu.md", order=20)
)
