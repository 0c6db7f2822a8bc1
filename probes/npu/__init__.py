"""Ascend NPUs through npu-smi and hccn_tool: chip health, HBM, out-of-band holders, the chips' RoCE ports, Huawei's
fault grading and HBM ECC.

- npu.py: the npu probe (npu.smi, npu.health, npu.hbm, npu.holders, npu.ledger); smi.py: running npu-smi;
  info_table.py, details.py, completeness.py: its parsers; findings.py, holder_findings.py, ledger_findings.py:
  its judgements; metrics.py: its samples; reasons.py: its reasons.
- roce.py: the npu.roce probe (link, flaps, net_health, optical, address per chip through hccn_tool);
  hccn.py: running hccn_tool (bounded parallel children); hccn_parse.py: its parsers and /etc/hccn.conf;
  roce_findings.py: its judgements and samples; link_window.py: the link-flap window kept across restarts.
- grade.py: the npu.grade probe (error codes graded by faultCode.json or fault_codes.py's built-in table).
- ecc.py: the npu.ecc probe (HBM ECC per chip) and its parser.
- chipmap.py: the chips the per-chip probes read and the identity their findings carry; chip_reasons.py: the
  checks and reasons of npu.roce, npu.grade and npu.ecc.
- config.py: the `npu:` section.
"""

from __future__ import annotations

from probes.family import Family, register_family
from probes.npu.config import NpuConfig

FAMILY = register_family(
    Family(key="npu", module=__name__, config=NpuConfig, title="Ascend NPU", doc="docs/probes/npu.md", order=20)
)
