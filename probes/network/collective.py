"""network.collective: the interface NCCL/HCCL bootstrap and socket traffic uses (category interconnect).

Jobs name it with NCCL_SOCKET_IFNAME / HCCL_SOCKET_IFNAME; the agent is told the same value
(`interconnect.collective_ifname`) and checks, in the host's network namespace (a forked child, netns.py), that an
interface matches it, that each match is up and has an address, and that the route to each of
`interconnect.collective_peer_subnets` leaves by one of them. With nothing configured on a node with several
candidate interfaces, it warns with the interface NCCL would pick by its own rules (ncclFindInterfaces in NCCL's
misc/socket.cc: `ib*` first, else every interface but `docker*`, `lo` and `virbr*`, else `docker*`, then `lo`;
among them the first in the kernel's order), since a job that leaves the choice to NCCL/HCCL may send its
collective over the management network. The syntax (NCCL's environment variable documentation): a comma-separated
list of prefixes; `^` before the list excludes them; `=` before it makes every name exact.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass

from probes.base import (
    NOT_APPLICABLE,
    Check,
    Finding,
    Probe,
    ProbeContext,
    ProbeOutput,
    Reason,
    Status,
    register,
)
from probes.interconnect.config import InterconnectConfig
from probes.interconnect.sysfs import list_ports
from probes.network.links import LinkState, NetSnapshot, read_netlink_snapshot
from probes.network.netns import call_in_netns, choose_netns

_ACCELERATOR = re.compile(r"^(?:nvidia|davinci)\d+$")
COLLECTIVE = Check("network.collective", category="interconnect")

COLLECTIVE_IFACE_MISSING = Reason(
    "CollectiveIfaceMissing",
    Status.FAIL,
    "no interface matches interconnect.collective_ifname (what jobs give NCCL_SOCKET_IFNAME/HCCL_SOCKET_IFNAME)",
    "jobs on this node fail at their collective's bootstrap (`no socket interface found`): bring the interface up "
    "under its expected name (udev rules, the HCA's driver), or fix the value jobs and the agent use",
)
COLLECTIVE_IFACE_DOWN = Reason(
    "CollectiveIfaceDown",
    Status.FAIL,
    "an interface the collective uses is down or has no address",
    "bring it up with its address (`ip link set IFACE up`, the node's network config); check the cable and switch "
    "port; `ip -br addr show IFACE`",
)
COLLECTIVE_ROUTE_MISMATCH = Reason(
    "CollectiveRouteMismatch",
    Status.FAIL,
    "the route to a peer subnet (interconnect.collective_peer_subnets) leaves by another interface than the "
    "collective's",
    "add the route over the collective's interface (`ip route add SUBNET dev IFACE`) or fix the routing table; "
    "`ip route get PEER` shows the interface the kernel picks",
)
COLLECTIVE_IFACE_AMBIGUOUS = Reason(
    "CollectiveIfaceAmbiguous",
    Status.WARN,
    "several candidate interfaces and interconnect.collective_ifname unset: NCCL/HCCL pick one by their own rules",
    "set NCCL_SOCKET_IFNAME/HCCL_SOCKET_IFNAME in jobs to the interface of the training network, and the same "
    "value in interconnect.collective_ifname so the agent checks it",
)
COLLECTIVE_UNREADABLE = Reason(
    "CollectiveUnreadable",
    Status.UNKNOWN,
    "the network namespace's links and routes could not be read in time",
    "the agent needs CAP_SYS_ADMIN to enter the host's network namespace (or hostNetwork)",
)
COLLECTIVE_REASONS = (
    COLLECTIVE_IFACE_MISSING,
    COLLECTIVE_IFACE_DOWN,
    COLLECTIVE_ROUTE_MISMATCH,
    COLLECTIVE_IFACE_AMBIGUOUS,
    COLLECTIVE_UNREADABLE,
)


@dataclass(frozen=True)
class IfaceSpec:
    prefixes: tuple[str, ...]
    exclude: bool
    exact: bool

    def matches(self, name: str) -> bool:
        hit = any(name == p if self.exact else name.startswith(p) for p in self.prefixes)
        return hit != self.exclude


def parse_ifname(text: str) -> IfaceSpec:
    """NCCL_SOCKET_IFNAME syntax: `^` excludes, then `=` makes names exact, then a comma-separated list."""
    value = text.strip()
    exclude = value.startswith("^")
    value = value[1:] if exclude else value
    exact = value.startswith("=")
    value = value[1:] if exact else value
    return IfaceSpec(tuple(p.strip() for p in value.split(",") if p.strip()), exclude, exact)


def nccl_default(links: list[LinkState]) -> list[LinkState]:
    """The interfaces NCCL takes with NCCL_SOCKET_IFNAME unset, in its order of attempts (first that has any)."""
    with_address = [link for link in links if link.global_addresses]
    for spec in ("ib", "^docker,lo,virbr", "docker", "lo", "virbr"):
        chosen = [link for link in with_address if parse_ifname(spec).matches(link.name)]
        if chosen:
            return chosen
    return []


def read_collective(netns_label: str, subnets: list[str]) -> tuple[NetSnapshot, dict[str, str | None]]:
    """Runs in the child: the links snapshot and, per peer subnet, the interface the route to it leaves by."""
    from pyroute2 import IPRoute  # only ever imported in the short-lived child
    from pyroute2.netlink.exceptions import NetlinkError

    snapshot = read_netlink_snapshot(netns_label)
    routes: dict[str, str | None] = {}
    by_index = {link.index: link.name for link in snapshot.links}
    with IPRoute() as ipr:
        for subnet in subnets:
            network = ipaddress.ip_network(subnet, strict=False)
            peer = next(network.hosts(), network.network_address)
            try:
                answer = ipr.route("get", dst=str(peer))
            except (NetlinkError, OSError):  # no route (ENETUNREACH): the kernel answers with an error
                routes[subnet] = None
                continue
            oif = answer[0].get("RTA_OIF") if answer else None
            routes[subnet] = by_index.get(oif) if oif is not None else None
    return snapshot, routes


@register
class CollectiveProbe(Probe):
    name = "network.collective"
    checks = ("network.collective",)
    categories = ("interconnect",)
    reasons = COLLECTIVE_REASONS
    default_interval = 60.0
    default_timeout = 10.0
    needs = "netlink in the host's network namespace (CAP_SYS_ADMIN to enter it, or hostNetwork)"

    def applicable(self, ctx: ProbeContext) -> str | None:
        """Configured, or a node with accelerators or HCAs: a plain server runs no collective."""
        if ctx.settings(InterconnectConfig).collective_ifname or list_ports(ctx.host.sys):
            return None
        try:
            names = os.listdir(ctx.host.dev)
        except OSError:
            names = []
        if any(_ACCELERATOR.match(name) for name in names):
            return None
        return "no accelerator (/dev/nvidiaN, /dev/davinciN), no HCA and interconnect.collective_ifname unset"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        why = self.applicable(ctx)
        if why is not None:
            return [COLLECTIVE.report(NOT_APPLICABLE, "", why)]
        settings = ctx.settings(InterconnectConfig)
        netns_path, label = choose_netns(ctx.host, settings.collective_netns)
        try:
            snapshot, routes = call_in_netns(
                ctx.host,
                "collective",
                netns_path,
                read_collective,
                label,
                list(settings.collective_peer_subnets),
                timeout=ctx.remaining(0.5),
            )
        except OSError as exc:
            return [COLLECTIVE.report(COLLECTIVE_UNREADABLE, "", f"{label}: {exc}")]
        links = list(snapshot.links)
        if not settings.collective_ifname:
            return [self._unset(links, label)]
        spec = parse_ifname(settings.collective_ifname)
        chosen = [link for link in links if spec.matches(link.name)]
        subject = settings.collective_ifname
        if not chosen:
            present = ", ".join(link.name for link in links)
            message = f"no interface matches {subject!r} in {label} (there are: {present})"
            return [COLLECTIVE.report(COLLECTIVE_IFACE_MISSING, subject, message)]
        out: ProbeOutput = [self._interface(link) for link in chosen]
        names = {link.name for link in chosen}
        for subnet, leaves_by in routes.items():
            observed = {"route_interface": leaves_by or "", "collective_interfaces": sorted(names)}
            if leaves_by in names:
                out.append(COLLECTIVE.ok(subnet, f"route to {subnet} leaves by {leaves_by}", observed))
            else:
                by = f"by {leaves_by}" if leaves_by else "nowhere (no route)"
                message = f"route to {subnet} leaves {by}, not by {', '.join(sorted(names))}"
                out.append(COLLECTIVE.report(COLLECTIVE_ROUTE_MISMATCH, subnet, message, observed))
        return out

    @staticmethod
    def _interface(link: LinkState) -> Finding:
        observed = {"up": link.up, "operstate": link.operstate, "addresses": list(link.global_addresses)}
        if not link.up:
            message = f"{link.name} is down ({link.operstate})"
            return COLLECTIVE.report(COLLECTIVE_IFACE_DOWN, link.name, message, observed)
        if not link.global_addresses:
            return COLLECTIVE.report(COLLECTIVE_IFACE_DOWN, link.name, f"{link.name} has no address", observed)
        return COLLECTIVE.ok(link.name, f"{link.name} up with {', '.join(link.global_addresses)}", observed)

    @staticmethod
    def _unset(links: list[LinkState], label: str) -> Finding:
        candidates = [
            link.name for link in links if link.global_addresses and parse_ifname("^docker,lo,virbr").matches(link.name)
        ]
        if not candidates:
            return COLLECTIVE.report(NOT_APPLICABLE, "", f"no interface with an address in {label} besides lo/docker")
        picked = nccl_default(links)
        first = picked[0].name if picked else "none"
        observed = {"candidates": candidates, "nccl_pick": first}
        if len(candidates) == 1:
            return COLLECTIVE.ok("", f"one candidate interface, {first}: NCCL and HCCL take it", observed)
        message = (
            f"{len(candidates)} candidate interfaces ({', '.join(candidates)}) and no collective interface "
            f"configured: NCCL would bootstrap on {first} (ib* first, else the first but docker*, lo, virbr*), HCCL by "
            "its own order; that may be the management network, not the training one"
        )
        return COLLECTIVE.report(COLLECTIVE_IFACE_AMBIGUOUS, "", message, observed)
