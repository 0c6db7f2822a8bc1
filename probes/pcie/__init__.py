"""PCIe AER error counters and link training of the accelerators and the ports above them."""

from __future__ import annotations

from probes.family import Family, register_family
from probes.pcie.config import PcieConfig

FAMILY = register_family(
    Family(key="pcie", module=__name__, config=PcieConfig, title="PCIe", doc="docs/probes/pcie.md", order=30)
)
