"""NVIDIA GPUs through NVML (nvidia-smi as the fallback): ECC, retirement, throttling, memory, holders."""

from __future__ import annotations

from probes.family import Family, register_family
from probes.gpu.config import GpuConfig

FAMILY = register_family(
    Family(key="gpu", module=__name__, config=GpuConfig, title="NVIDIA GPU", doc="docs/probes/gpu.md", order=40)
)
