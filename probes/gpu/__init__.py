"""NVIDIA GPUs through NVML (nvidia-smi as the fallback): ECC, retirement, throttling, memory, holders.

- `gpu`: the probe (gpu.health, gpu.throttle, gpu.memory, gpu.holders); `config`: the `gpu:` section.
- `backends`: where the NVIDIA tools are, and reading every GPU: `nvml` (NVML, first) or `nvidia_smi` (the
  fallback's pure parsers), both into `model`, the one state the checks judge.
- `findings`: the judgements on one GPU's state; `holder_findings`: who holds each GPU; `ledger_findings`: the
  GPUs as the device plugin's ledger has them (gpu.ledger).
- `metrics`: the per-GPU samples; `reasons`: the checks and every reason the family gives.
"""

from __future__ import annotations

from probes.family import Family, register_family
from probes.gpu.config import GpuConfig

FAMILY = register_family(
    Family(key="gpu", module=__name__, config=GpuConfig, title="NVIDIA GPU", doc="docs/probes/gpu.md", order=40)
)
