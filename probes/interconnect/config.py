"""Config of the interconnect family (`interconnect:`)."""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Literal

from pydantic import Field, field_validator

from probes.family import PositiveSeconds, Section

_PORT = re.compile(r"^[A-Za-z0-9_.-]{1,64}/[0-9]{1,3}$")
_HCA_ENTRY = r"[A-Za-z0-9_.-]{1,64}(?::[0-9]{1,3})?"
_IB_HCA = re.compile(rf"^\^?=?{_HCA_ENTRY}(?:,{_HCA_ENTRY}){{0,63}}$")

# The counters (files under ports/<n>/counters/) the probe judges, by what an increase means.
LINK_COUNTERS = ("link_downed", "link_error_recovery")
ERROR_COUNTERS = (
    "symbol_error",
    "port_rcv_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)


PORTS_STATE = "interconnect-ports.json"
NVLINK_STATE = "gpu-nvlink.json"


class InterconnectConfig(Section):
    # Ports that must be there, as `<hca>/<port>` (`mlx5_0/1`); a missing one is HcaPortMissing. Empty: every port
    # the node has is checked, none is required (a node without HCAs skips).
    expected_ports: list[str] = []
    # The rate every checked port must run at, in Gb/s as sysfs prints it (`400 Gb/sec (4X NDR)` → 400); a port
    # below it is HcaPortDegraded with `degraded_status`. Null: no rate check.
    expected_rate_gbps: float | None = Field(None, gt=0)
    degraded_status: Literal["warn", "fail"] = "warn"
    # Link layers checked (`InfiniBand`, `Ethernet` for RoCE); a port of another layer is left out.
    link_layers: list[Literal["InfiniBand", "Ethernet"]] = ["InfiniBand", "Ethernet"]
    # Increases within `window_seconds` that make a problem: link_downed + link_error_recovery (HcaPortFlapping,
    # fail) and symbol_error + port_rcv_errors + local_link_integrity_errors + excessive_buffer_overrun_errors
    # (HcaPortErrors, warn).
    window_seconds: PositiveSeconds = 3600.0
    link_down_threshold: int = Field(1, ge=1)
    error_threshold: int = Field(100, ge=1)
    # Where the counter windows (PORTS_STATE and NVLINK_STATE in it) survive an agent restart: a writable directory
    # of the agent's, the host's /var/lib/node-health that the DaemonSet mounts there, so a pod deleted and
    # recreated (a rollout, an eviction) keeps them too. "" or unwritable: kept in memory, logged once.
    state_dir: str = "/var/lib/node-health"
    # NVLink (the gpu.links probe, docs/probes/gpu.md): active links each GPU must have; null: as many as the GPU
    # of this node with the most (on an HGX board every GPU has the same number, so the one with fewer has lost
    # links).
    nvlink_expected_active_links: int | None = Field(None, ge=0)
    # Replay + CRC error increase within window_seconds that warns (NvlinkErrors); any recovery error fails.
    nvlink_error_threshold: int = Field(100, ge=1)
    # On NVSwitch systems: nv-fabricmanager must run as a host process (FabricManagerDown otherwise).
    fabric_manager_check: bool = True
    # The collective's interface (the network.collective probe, docs/probes/network.md): what jobs give
    # NCCL_SOCKET_IFNAME / HCCL_SOCKET_IFNAME, in their syntax (`ib0`, a prefix list `ib,eth`, `^docker,lo` to
    # exclude, `=eth0` for exact names); "" when jobs set nothing.
    collective_ifname: str = ""
    # What jobs give NCCL_IB_HCA, in its syntax (`mlx5` a prefix, `=mlx5_0:1,mlx5_1:1` exact cards and ports,
    # `^=mlx5_4` to exclude): it must select at least one ACTIVE HCA port, or NCCL falls back to TCP sockets; "" when
    # jobs set nothing.
    collective_ib_hca: str = ""
    # Subnets the collective's peers are on (CIDRs): the route to each must leave by the collective's interface.
    collective_peer_subnets: list[str] = []
    # Network namespace to inspect (a path such as /run/netns/x); "": the host's.
    collective_netns: str = ""

    def state_path(self, name: str) -> str:
        """The file `name` under state_dir; "" (memory only) when state_dir is ""."""
        return os.path.join(self.state_dir, name) if self.state_dir else ""

    @field_validator("state_dir")
    @classmethod
    def _state_dir(cls, value: str) -> str:
        if value and not os.path.isabs(value):
            raise ValueError(f'{value!r} is not an absolute directory like /var/lib/node-health (or "")')
        return value

    @field_validator("collective_peer_subnets")
    @classmethod
    def _subnets(cls, values: list[str]) -> list[str]:
        for value in values:
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError:
                raise ValueError(f"{value!r} is not a subnet like 10.20.0.0/16") from None
        return values

    @field_validator("collective_ib_hca")
    @classmethod
    def _ib_hca(cls, value: str) -> str:
        if value and not _IB_HCA.match(value):
            raise ValueError(f"{value!r} is not an NCCL_IB_HCA list like =mlx5_0:1,mlx5_1:1 (^ excludes, = is exact)")
        return value

    @field_validator("expected_ports")
    @classmethod
    def _ports(cls, values: list[str]) -> list[str]:
        for value in values:
            if not _PORT.match(value):
                raise ValueError(f"{value!r} is not a port like mlx5_0/1 (<hca>/<port number>)")
        return values
