"""NVIDIA GPUs through NVML (nvidia-smi as the fallback): ECC, retirement, throttling, memory, holders, NVLink and
the NVSwitch fabric.

- `gpu`: the gpu probe (gpu.health, gpu.throttle, gpu.memory, gpu.holders, gpu.ledger); `reasons`, `findings`,
  `holder_findings`, `ledger_findings`: its checks' reasons and judgements; `metrics`: its samples;
- `model`: the GPUs' state as either backend reads it; `backends`: where NVML and nvidia-smi are, and the read;
  `nvml`: the NVML pass (shared by gpu.links); `nvidia_smi`: the nvidia-smi parsers;
- `links`: the gpu.links probe (gpu.nvlink, gpu.fabric); `links_nvml`: its NVML reads; `links_smi`: its
  nvidia-smi parsers and the link/fabric model both backends fill;
- `config`: the `gpu:` section.
"""

from __future__ import annotations

from probes.family import Family, register_family
from probes.gpu.config import GpuConfig

FAMILY = register_family(
    Family(key="gpu", module=__name__, config=GpuConfig, title="NVIDIA GPU", doc="docs/probes/gpu.md", order=40)
)
