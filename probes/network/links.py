"""network.links: NIC admin state, carrier and carrier changes over time, in the host's network namespace.

rtnetlink through pyroute2, read in a forked child that entered the namespace (probes/network/netns.py):
pyroute2 costs ~20 MiB once imported, so only the short-lived child ever imports it. The node summary names
the default-route interface and whether the node has several NICs, the input for NCCL/HCCL_SOCKET_IFNAME.
"""

from __future__ import annotations

import socket
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probes.base import Check, Finding, Probe, ProbeContext, ProbeOutput, Reason, Sample, Status, register
from probes.network.config import LinksConfig, NetworkConfig
from probes.network.netns import call_in_netns, choose_netns

if TYPE_CHECKING:
    from probes.runtime.host import Host

LINKS = Check("network.links")

LINK_DOWN = Reason(
    "LinkDown",
    Status.FAIL,
    "the interface is administratively down, has no carrier (operstate down / lowerlayerdown), or a "
    "configured interface does not exist",
    "ip link set IF up; check the cable, transceiver and switch port (ethtool IF); fix network.links.interfaces "
    "after a rename",
)
LINK_FLAPPING = Reason(
    "LinkFlapping",
    Status.FAIL,
    "more than max_carrier_changes_per_hour carrier changes in the last hour (needs two runs of the same agent)",
    "reseat or replace the cable or transceiver; check the switch port and ethtool -S IF",
)
NETLINK_FAILED = Reason(
    "NetlinkFailed",
    Status.UNKNOWN,
    "could not enter the network namespace or read rtnetlink",
    "run with hostNetwork, or give the agent CAP_SYS_ADMIN and hostPID (to enter /proc/1/ns/net)",
)

IFF_UP = 0x1
DOWN_OPERSTATES = {"DOWN", "LOWERLAYERDOWN", "NOTPRESENT"}


@dataclass(frozen=True)
class LinkState:
    name: str
    index: int
    admin_up: bool
    operstate: str
    carrier: int | None
    carrier_changes: int | None
    kind: str | None  # IFLA_INFO_KIND: veth, bridge, bond...; None for plain hardware
    parent_device: str | None  # IFLA_PARENT_DEV_NAME (kernel ≥ 5.17): the bus device, e.g. 0000:3b:00.0
    mtu: int | None = None
    global_addresses: tuple[str, ...] = ()

    @property
    def up(self) -> bool:
        return self.admin_up and self.carrier != 0 and self.operstate not in DOWN_OPERSTATES


@dataclass(frozen=True)
class NetSnapshot:
    links: tuple[LinkState, ...]
    default_route_interfaces: tuple[str, ...]  # IPv4 first, by metric
    netns: str  # what was inspected, for messages


def _link_state(link: Any, addresses: dict[int, list[str]]) -> LinkState:
    return LinkState(
        name=link.get("ifname") or f"if{link['index']}",
        index=link["index"],
        admin_up=bool(link["flags"] & IFF_UP),
        operstate=str(link.get("operstate") or "UNKNOWN").upper(),
        carrier=link.get("carrier"),
        carrier_changes=link.get("carrier_changes"),
        kind=link.get_nested("IFLA_LINKINFO", "IFLA_INFO_KIND"),
        parent_device=link.get("parent_dev_name"),
        mtu=link.get("mtu"),
        global_addresses=tuple(addresses.get(link["index"], ())),
    )


def read_netlink_snapshot(netns_label: str) -> NetSnapshot:
    """Runs in the child: links, global addresses and default routes of its network namespace."""
    from pyroute2 import IPRoute  # ~20 MiB once imported: only ever imported in the short-lived child

    with IPRoute() as ipr:
        links = ipr.get_links()
        addresses: dict[int, list[str]] = {}
        for addr in ipr.get_addr():
            if addr["scope"] == 0:  # RT_SCOPE_UNIVERSE: a global address, not link-local or host
                addresses.setdefault(addr["index"], []).append(str(addr.get("address")))
        defaults: list[tuple[int, int, int]] = []
        for family_rank, family in enumerate((socket.AF_INET, socket.AF_INET6)):
            for route in ipr.get_default_routes(family=family):
                oif = route.get("oif")
                if oif is not None:
                    defaults.append((family_rank, route.get("priority") or 0, oif))
        by_index = {link["index"]: link.get("ifname") for link in links}
        default_names = tuple(dict.fromkeys(by_index.get(oif) or f"if{oif}" for _, _, oif in sorted(defaults)))
        return NetSnapshot(tuple(_link_state(link, addresses) for link in links), default_names, netns_label)


def netlink_snapshot(host: Host, netns_path: str | None, netns_label: str, timeout: float) -> NetSnapshot:
    return call_in_netns(host, "netlink-links", netns_path, read_netlink_snapshot, netns_label, timeout=timeout)


def is_physical(link: LinkState, sys_class_net: Path) -> bool:
    """A NIC backed by a bus device: IFLA_PARENT_DEV_NAME, or a `device` link in sysfs."""
    if link.parent_device:
        return True
    if link.kind:
        return False
    return (sys_class_net / link.name / "device").exists()


@dataclass
class CarrierHistory:
    """Carrier-change counter samples of one interface, for changes within a sliding window."""

    index: int
    samples: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, now: float, changes: int, window: float) -> int | None:
        """Record a sample; changes within the last `window` seconds, or None before a baseline exists."""
        if self.samples and changes < self.samples[-1][1]:
            self.samples.clear()  # the counter went back: the device was re-created
        self.samples.append((now, changes))
        # Keep the newest sample at or before the window's start as the baseline.
        while len(self.samples) >= 2 and self.samples[1][0] <= now - window:
            self.samples.popleft()
        if len(self.samples) < 2:
            return None
        return changes - self.samples[0][1]


def link_observed(link: LinkState, changes_in_window: int | None) -> dict[str, Any]:
    observed: dict[str, Any] = {
        "operstate": link.operstate.lower(),
        "admin_up": link.admin_up,
        "carrier": link.carrier,
        "carrier_changes": link.carrier_changes,
    }
    if link.mtu is not None:
        observed["mtu"] = link.mtu
    if link.parent_device:
        observed["device"] = link.parent_device
    if changes_in_window is not None:
        observed["carrier_changes_in_window"] = changes_in_window
    return observed


def link_findings(link: LinkState, changes_in_window: int | None, max_changes: float, window: float) -> list[Finding]:
    observed = link_observed(link, changes_in_window)
    name = link.name
    if not link.admin_up:
        hint = (
            f"bring it up (ip link set {name} up) and check why it was set down (NetworkManager, netplan, "
            "a maintenance script)"
        )
        return [LINKS.report(LINK_DOWN, name, f"{name} is administratively down", observed, hint=hint)]
    if link.operstate in DOWN_OPERSTATES or link.carrier == 0:
        hint = (
            f"the cable, transceiver or switch port is down: check the link light, `ethtool {name}`, "
            "and the switch port"
        )
        message = f"{name} has no carrier (operstate {link.operstate.lower()})"
        return [LINKS.report(LINK_DOWN, name, message, observed, hint=hint)]
    if changes_in_window is not None and changes_in_window > max_changes:
        hint = (
            "a flapping link breaks collective communication: reseat or replace the cable/transceiver, "
            f"check the switch port's error counters and `ethtool -S {name}`"
        )
        message = (
            f"{name} changed carrier {changes_in_window} times in the last {window / 60:g} min (limit {max_changes:g})"
        )
        return [LINKS.report(LINK_FLAPPING, name, message, observed, hint=hint)]
    return [LINKS.ok(name, f"{name} up, carrier present", observed)]


def link_samples(link: LinkState) -> list[Sample]:
    labels = {"interface": link.name}
    out = [Sample("nodehealth_network_link_up", "1 when the link is up with carrier.", 1.0 if link.up else 0.0, labels)]
    if link.carrier_changes is not None:
        out.append(
            Sample(
                "nodehealth_network_link_carrier_changes_total",
                "Carrier changes of the link since the device was created (IFLA_CARRIER_CHANGES).",
                link.carrier_changes,
                labels,
                kind="counter",
            )
        )
    return out


def summary_finding(snapshot: NetSnapshot, physical: list[str]) -> Finding:
    candidates = [
        link.name
        for link in snapshot.links
        if link.name in physical and link.admin_up and link.carrier != 0 and link.global_addresses
    ]
    default_iface = snapshot.default_route_interfaces[0] if snapshot.default_route_interfaces else None
    multi = len(candidates) > 1
    message = (
        f"default route via {default_iface or 'none'}; {len(candidates)} physical NIC(s) up with a global address"
        + (" (multi-NIC: set NCCL_SOCKET_IFNAME / HCCL_SOCKET_IFNAME)" if multi else "")
    )
    observed = {
        "netns": snapshot.netns,
        "default_route_interface": default_iface,
        "default_route_interfaces": list(snapshot.default_route_interfaces),
        "multi_nic": multi,
        "physical_interfaces": physical,
        "socket_ifname_candidates": candidates,
    }
    return LINKS.ok("", message, observed)


@register
class LinksProbe(Probe):
    name = "network.links"
    checks = ("network.links",)
    reasons = (LINK_DOWN, LINK_FLAPPING, NETLINK_FAILED)
    default_interval = 30.0
    default_timeout = 5.0
    needs = "rtnetlink in the host network namespace (hostNetwork, or CAP_SYS_ADMIN and /proc/1/ns/net)"

    FLAP_WINDOW_SECONDS = 3600.0

    def __init__(self) -> None:
        self._history: dict[tuple[str, str], CarrierHistory] = {}

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(NetworkConfig).links
        netns_path, netns_label = choose_netns(ctx.host, settings.netns)
        try:
            snapshot = netlink_snapshot(ctx.host, netns_path, netns_label, ctx.remaining())
        except OSError as exc:
            message = f"cannot read links in network namespace {netns_label}: {exc}"
            return [LINKS.report(NETLINK_FAILED, "", message, {"netns": netns_label})]
        sys_class_net = ctx.host.sys_path("class", "net")
        physical = [link.name for link in snapshot.links if is_physical(link, sys_class_net)]
        out = self._interfaces(snapshot, list(settings.interfaces) or physical, settings)
        out.append(summary_finding(snapshot, physical))
        return out

    def _interfaces(self, snapshot: NetSnapshot, wanted: list[str], settings: LinksConfig) -> ProbeOutput:
        by_name = {link.name: link for link in snapshot.links}
        out: ProbeOutput = []
        now = time.monotonic()
        seen: set[tuple[str, str]] = set()
        for name in wanted:
            link = by_name.get(name)
            if link is None:
                hint = (
                    "the interface is missing: driver not loaded, renamed (check `ip link`), or the NIC failed; "
                    "fix network.links.interfaces if the name changed"
                )
                message = f"{name} does not exist"
                out.append(LINKS.report(LINK_DOWN, name, message, {"netns": snapshot.netns}, hint=hint))
                continue
            changes_in_window = None
            if link.carrier_changes is not None:
                key = (snapshot.netns, name)
                seen.add(key)
                changes_in_window = self._changes_in_window(key, link, now)
            window = self.FLAP_WINDOW_SECONDS
            out.extend(link_findings(link, changes_in_window, settings.max_carrier_changes_per_hour, window))
            out.extend(link_samples(link))
        for key in set(self._history) - seen:
            del self._history[key]
        return out

    def _changes_in_window(self, key: tuple[str, str], link: LinkState, now: float) -> int | None:
        history = self._history.get(key)
        if history is None or history.index != link.index:
            history = self._history[key] = CarrierHistory(link.index)
        if link.carrier_changes is None:
            return None
        return history.add(now, link.carrier_changes, self.FLAP_WINDOW_SECONDS)
