"""Network: DNS, egress to the hosts jobs need, NIC links, the HCCL port range.

Map: `config` (the `network:` section), `reasons` (shared reasons), `dns` (network.dns), `egress` (the
network.egress probe) with `egress_check` (one target, phase by phase), `egress_errors` (its reasons, error and
deadline), `connect` (Happy Eyeballs TCP connect) and `proxy` (proxy URL, credentials, CONNECT), `links`
(network.links) with `netns` (calls inside a network namespace), `ports` (network.ports) with `proc_net`.
"""

from __future__ import annotations

from probes.family import Family, register_family
from probes.network.config import NetworkConfig

FAMILY = register_family(
    Family(
        key="network", module=__name__, config=NetworkConfig, title="Network", doc="docs/probes/network.md", order=60
    )
)
