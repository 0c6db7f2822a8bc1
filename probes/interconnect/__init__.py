"""InfiniBand/RoCE HCA ports (the node's interconnect): port state, rate and error counters from sysfs.

- `config.py`: the `interconnect:` section (expected ports and rate, counter thresholds, the window, the
  baseline's state file).
- `sysfs.py`: `/sys/class/infiniband/<hca>/ports/<n>` read and parsed (state, phys_state, rate, link_layer,
  counters).
- `window.py`: counter increases within a window, persisted so an agent restart keeps them; a counter that goes
  down (driver reload) is a new baseline, never a burst.
- `reasons.py`: the reason codes.
- `ports.py`: the `interconnect.ports` probe.
"""

from __future__ import annotations

from probes.family import Family, register_family
from probes.interconnect.config import InterconnectConfig

FAMILY = register_family(
    Family(
        key="interconnect",
        module=__name__,
        config=InterconnectConfig,
        title="Interconnect (InfiniBand/RoCE HCA ports)",
        doc="docs/probes/interconnect.md",
        order=55,
    )
)
