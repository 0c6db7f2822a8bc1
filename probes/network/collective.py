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

NCCL_IB_HCA (`interconnect.collective_ib_hca`, the same syntax with an optional `:port` per card, NCCL's
environment variable documentation and net_ib.cc) must select at least one HCA port of the node that is ACTIVE,
and every card it names must exist: NCCL uses only the ACTIVE ports it selects and, with none, finds no IB device
and falls back to TCP sockets, silently and many times slower. Read from sysfs (/sys/class/infiniband).
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from probes.base import (
    NOT_APPLICABLE,
    Check,
    Finding,
    Probe,
    ProbeContext,
    ProbeOutput,
    ProbeParseError,
    Reason,
    Status,
    register,
)
from probes.interconnect.config import InterconnectConfig
from probes.interconnect.sysfs import list_ports, read_port
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
COLLECTIVE_HCA_MISSING = Reason(
    "CollectiveHcaMissing",
    Status.FAIL,
    "interconnect.collective_ib_hca (what jobs give NCCL_IB_HCA) selects no HCA port of this node, or names a card "
    "or port the node lacks",
    "NCCL finds no (or fewer) IB devices and falls back to TCP sockets: fix the value jobs and the agent use "
    "(`ibv_devinfo -l` or /sys/class/infiniband lists the cards; `=` makes names exact), or bring the HCA back "
    "(driver, firmware, a renamed device)",
)
COLLECTIVE_HCA_DOWN = Reason(
    "CollectiveHcaDown",
    Status.FAIL,
    "every HCA port NCCL_IB_HCA selects is down (not ACTIVE): NCCL skips them all and falls back to TCP sockets",
    "bring the ports up (cable, switch port, subnet manager: `ibstat`); interconnect.ports names each port's state",
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
    COLLECTIVE_HCA_MISSING,
    COLLECTIVE_HCA_DOWN,
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


@dataclass(frozen=True)
class HcaSpec:
    entries: tuple[tuple[str, int | None], ...]  # card (a prefix unless exact), port (None: every port)
    exclude: bool
    exact: bool

    def entry_matches(self, entry: tuple[str, int | None], hca: str, port: int) -> bool:
        name, wanted = entry
        return (hca == name if self.exact else hca.startswith(name)) and wanted in (None, port)

    def matches(self, hca: str, port: int) -> bool:
        return any(self.entry_matches(entry, hca, port) for entry in self.entries) != self.exclude


def parse_ib_hca(text: str) -> HcaSpec:
    """NCCL_IB_HCA syntax: `^` excludes, then `=` makes names exact, then `card[:port]` comma-separated."""
    spec = parse_ifname(text)
    entries = []
    for token in spec.prefixes:
        name, _, port = token.partition(":")
        entries.append((name, int(port) if port.isdigit() else None))
    return HcaSpec(tuple(entries), spec.exclude, spec.exact)


def judge_ib_hca(sys_root: str | Path, value: str) -> Finding:
    """The HCA ports NCCL_IB_HCA selects among sysfs's: none (or a card it names absent) fails, none ACTIVE fails."""
    spec = parse_ib_hca(value)
    ports = [(hca, port) for hca, port in list_ports(sys_root) if port.isdigit()]
    selected = [(hca, port) for hca, port in ports if spec.matches(hca, int(port))]
    subject = f"NCCL_IB_HCA={value}"
    present = ", ".join(f"{hca}/{port}" for hca, port in ports) or "none"
    absent = (
        [] if spec.exclude else [e for e in spec.entries if not any(spec.entry_matches(e, h, int(p)) for h, p in ports)]
    )
    names = [f"{hca}/{port}" for hca, port in selected]
    observed: dict[str, object] = {"selected": names, "present": present}
    if not selected or absent:
        named = ", ".join(name if port is None else f"{name}:{port}" for name, port in absent)
        what = f"names {named}, which this node lacks" if absent else "selects no HCA port of this node"
        message = f"{subject} {what} (HCA ports: {present}); NCCL uses the rest or falls back to TCP sockets"
        return COLLECTIVE.report(COLLECTIVE_HCA_MISSING, subject, message, observed)
    active = []
    for hca, port in selected:
        try:
            if read_port(sys_root, hca, port, ()).state[1] == "ACTIVE":
                active.append(f"{hca}/{port}")
        except ProbeParseError:
            continue  # an unreadable port is not one NCCL can count on; interconnect.ports says why
    observed["active"] = active
    if not active:
        message = f"{subject}: none of {', '.join(names)} is ACTIVE; NCCL falls back to TCP sockets"
        return COLLECTIVE.report(COLLECTIVE_HCA_DOWN, subject, message, observed)
    return COLLECTIVE.ok(subject, f"{subject}: {len(active)} of {len(selected)} selected HCA ports ACTIVE", observed)


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
        settings = ctx.settings(InterconnectConfig)
        if settings.collective_ifname or settings.collective_ib_hca or list_ports(ctx.host.sys):
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
        hca: ProbeOutput = (
            [judge_ib_hca(ctx.host.sys, settings.collective_ib_hca)] if settings.collective_ib_hca else []
        )
        return hca + self._socket(ctx, settings)

    def _socket(self, ctx: ProbeContext, settings: InterconnectConfig) -> ProbeOutput:
        """NCCL_SOCKET_IFNAME / HCCL_SOCKET_IFNAME: the interface, its address and the routes to the peers."""
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
