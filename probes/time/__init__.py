"""Clock: the kernel's sync state (adjtimex) and the offset against NTP servers.

- `time`: the probe (time.sync); `config`: the `time:` section.
- `kernel_clock`: the kernel's discipline state (adjtimex); `chrony`: chronyd's own view; `ntp_sources`: which
  servers to ask; `sntp`: the SNTP client; `offsets`: judging the clock from the servers' offsets.
"""

from __future__ import annotations

from probes.family import Family, register_family
from probes.time.config import TimeConfig

FAMILY = register_family(
    Family(key="time", module=__name__, config=TimeConfig, title="Clock", doc="docs/probes/time.md", order=70)
)
