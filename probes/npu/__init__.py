"""Ascend NPUs through npu-smi and hccn_tool: chip health, HBM, out-of-band holders, the chips' RoCE ports,
Huawei's fault grading and HBM ECC.

- `npu`: the probe (npu.smi, npu.health, npu.hbm, npu.holders, npu.ledger); `config`: the `npu:` section.
- `smi`: running npu-smi; `info_table`, `details`, `completeness`: its outputs parsed, and whether a table is
  whole (pure).
- `findings`: npu.health and npu.hbm; `holder_findings`: who holds each chip; `ledger_findings`: the chips as
  the device plugin's ledger has them (npu.ledger).
- `metrics`: the per-chip samples; `reasons`: the checks and every reason the family gives.
- `roce`: the npu.roce probe (link, flaps, net_health, optical, address per chip through hccn_tool); `hccn`:
  running hccn_tool (bounded parallel children); `hccn_parse`: its parsers and /etc/hccn.conf; `roce_findings`:
  its judgements and samples; `link_window`: the link-flap window kept across restarts.
- `grade`: the npu.grade probe (error codes graded by faultCode.json or `fault_codes`' built-in table).
- `ecc`: the npu.ecc probe (HBM ECC per chip) and its parser.
- `public_faults`: the MindCluster public-fault code of each per-chip reason (the agent's default table).
- `chipmap`: the chips the per-chip probes read and the identity their findings carry; `chip_reasons`: the
  checks and reasons of npu.roce, npu.grade and npu.ecc.
"""

from __future__ import annotations

from probes.family import Family, register_family
from probes.npu.config import NpuConfig

FAMILY = register_family(
    Family(key="npu", module=__name__, config=NpuConfig, title="Ascend NPU", doc="docs/probes/npu.md", order=20)
)
