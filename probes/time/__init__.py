"""Clock: the kernel's sync state (adjtimex) and the offset against NTP servers."""

from __future__ import annotations

from probes.family import Family, register_family
from probes.time.config import TimeConfig

FAMILY = register_family(
    Family(key="time", module=__name__, config=TimeConfig, title="Clock", doc="docs/probes/time.md", order=70)
)
