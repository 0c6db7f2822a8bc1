"""Network: DNS, egress to the hosts jobs need, NIC links, the HCCL port range."""

from __future__ import annotations

from probes.family import Family, register_family
from probes.network.config import NetworkConfig

FAMILY = register_family(
    Family(
        key="network", module=__name__, config=NetworkConfig, title="Network", doc="docs/probes/network.md", order=60
    )
)
