"""The kernel log (/dev/kmsg) matched against node-problem-detector style rules.

- `log`: the probe (kernel.log); `config`: the `kernel_log:` section.
- `kmsg`: /dev/kmsg's record format and its non-blocking reader; `rules`: the rule engine; `default_rules`: the
  default rules, with where each spelling comes from.
"""

from __future__ import annotations

from probes.family import Family, register_family
from probes.kernel.config import KernelLogConfig

FAMILY = register_family(
    Family(
        key="kernel_log",
        module=__name__,
        config=KernelLogConfig,
        title="Kernel log",
        doc="docs/probes/kernel_log.md",
        order=80,
    )
)
