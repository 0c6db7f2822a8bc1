"""Network: DNS, egress to the hosts jobs need, NIC links, the HCCL port range.

- `dns`, `egress`, `links`, `ports`: the probes network.dns, network.egress, network.links, network.ports;
  `config`: the `network:` section; `reasons`: the reasons dns and egress share.
- `collective`: the network.collective probe (the interfaces and HCAs NCCL/HCCL are told to use exist and are up).
- `egress_check`: one egress target, phase by phase (name, TCP, proxy CONNECT, TLS, HTTP); `egress_errors`: its
  reasons, error and deadline; `connect`: the Happy Eyeballs TCP connect; `proxy`: the proxy URL, its credentials
  and CONNECT.
- `netns`: running a function in another network namespace; `proc_net`: /proc/net rows and port sysctls parsed.
"""

from __future__ import annotations

from probes.family import Family, register_family
from probes.network.config import NetworkConfig

FAMILY = register_family(
    Family(
        key="network", module=__name__, config=NetworkConfig, title="Network", doc="docs/probes/network.md", order=60
    )
)
