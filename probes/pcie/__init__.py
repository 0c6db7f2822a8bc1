"""PCIe AER error counters and link training of the accelerators and the ports above them.

- `pcie`: the probe (pcie.aer, pcie.link); `config`: the `pcie:` section.
- `sysfs`: the PCI functions to check and their link state; `devices`: which accelerators a function serves;
  `aer`: the AER counters and what changed between runs.
"""

from __future__ import annotations

from probes.family import Family, register_family
from probes.pcie.config import PcieConfig

FAMILY = register_family(
    Family(key="pcie", module=__name__, config=PcieConfig, title="PCIe", doc="docs/probes/pcie.md", order=30)
)
