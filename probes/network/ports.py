"""network.ports: is the HCCL port range free, and reserved from the ephemeral range.

Sockets come from /proc/1/net/{tcp,tcp6,udp,udp6} (the host's namespace, with hostPID); their holders from
one scan of /proc/*/fd with a deadline, classified by the shared holders module (the pod, a container outside
Kubernetes, a service, a bare process) with the stop command that fits. Ports held by pods are a warn naming
the pods; ports held outside Kubernetes fail, the hint naming the real PIDs. HCCL is Ascend's: on a node
without /dev/davinciN the check does not apply unless network.ports.only_with_npus is false.
net.ipv4.ip_local_reserved_ports is read by a child inside the host's network namespace, because network
sysctls belong to the namespace of the reader.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from probes.base import (
    Check,
    Finding,
    Probe,
    ProbeContext,
    ProbeOutput,
    ProbeParseError,
    Reason,
    Sample,
    Status,
    register,
)
from probes.network.config import NetworkConfig
from probes.network.netns import read_host_net_sysctls
from probes.network.proc_net import (
    SocketEntry,
    compress_ports,
    parse_port_ranges,
    parse_proc_net_sockets,
    ports_outside,
    sockets_in_range,
)
from probes.runtime.holders import (
    Holder,
    PodNames,
    Sighting,
    collect_holders,
    device_nodes,
    list_processes,
    pods_of,
    stop_hint,
)
from probes.runtime.procfs import ScanError, described, scan_open_files

PORTS = Check("network.ports")
RESERVED_SUBJECT = "net.ipv4.ip_local_reserved_ports"

PORT_RANGE_OCCUPIED = Reason(
    "PortRangeOccupied",
    Status.FAIL,
    "sockets use ports of the HCCL range; the message names each holder (PID, executable, pod or container). "
    "Fail when any holder is outside Kubernetes or not found, warn when all are in pods",
    "stop the leftover holder with the command the hint names (kill PID, docker/podman/nerdctl stop ID, crictl stopp), "
    "or move HCCL_IF_BASE_PORT and network.ports.base together",
    also=(Status.WARN,),
)
PORTS_NOT_RESERVED = Reason(
    "PortsNotReserved",
    Status.WARN,
    "ports of the range lie in the ephemeral range (ip_local_port_range) but not in "
    "net.ipv4.ip_local_reserved_ports, so any outgoing connection may take them",
    "sysctl -w net.ipv4.ip_local_reserved_ports=BASE-LAST (merged with the existing entries), persisted in "
    "/etc/sysctl.d/",
)
PROC_NET_UNREADABLE = Reason(
    "ProcNetUnreadable",
    Status.UNKNOWN,
    "/proc/1/net/* could not be read",
    "run the agent with hostPID to read the host's /proc/1/net",
)
SYSCTL_UNREADABLE = Reason(
    "SysctlUnreadable",
    Status.UNKNOWN,
    "net.ipv4.ip_local_reserved_ports could not be read in the host's network namespace",
    "run with hostPID and CAP_SYS_ADMIN (to enter /proc/1/ns/net) or hostNetwork",
)

PROTOCOLS = ("tcp", "tcp6", "udp", "udp6")
NPU_NODES = ("davinci[0-9]*",)


def port_holders(ctx: ProbeContext, occupied: Sequence[SocketEntry]) -> tuple[dict[int, list[Holder]], str]:
    """Socket inode → the processes holding it (classified by the shared holders module), and the scan error
    when the /proc/*/fd scan failed."""
    inodes = {entry.inode for entry in occupied}
    if not inodes:
        return {}, ""
    try:
        scan = scan_open_files(ctx.host, sockets=inodes, timeout=max(0.1, ctx.remaining() - 0.2))
    except ScanError as exc:
        return {}, str(exc)
    sightings = [Sighting(m.pid, str(m.key[1]), "socket", m.start_time) for m in scan.matches]
    holders, _ = collect_holders(ctx.host.proc, sightings, PodNames(ctx.host.root), known=described(scan))
    by_inode: dict[int, list[Holder]] = {}
    for holder in holders:
        for inode in holder.things:
            by_inode.setdefault(int(inode), []).append(holder)
    return by_inode, ""


def _holder_lines(
    occupied: Sequence[SocketEntry], holders: dict[int, list[Holder]], redact: bool
) -> tuple[list[Holder], list[Holder], list[str], list[dict[str, Any]]]:
    """(holders in pods, holders outside Kubernetes, sockets with no holder found, observed holders)."""
    in_pods: dict[tuple[int, int], Holder] = {}
    outside: dict[tuple[int, int], Holder] = {}
    orphans: list[str] = []
    observed: list[dict[str, Any]] = []
    for entry in occupied:
        owners = holders.get(entry.inode, [])
        if not owners:
            orphans.append(f"{entry.local_port}/{entry.protocol}")
        for holder in owners:
            (in_pods if holder.in_pod else outside)[holder.key] = holder
            observed.append(
                {"port": entry.local_port, "protocol": entry.protocol, "state": entry.state.lower()}
                | holder.to_dict(redact)
                | {"in_pod": holder.in_pod}
            )
    return list(in_pods.values()), list(outside.values()), list(dict.fromkeys(orphans)), observed


def _ports_of(holder: Holder, occupied: Sequence[SocketEntry]) -> str:
    inodes = {int(thing) for thing in holder.things}
    return compress_ports(e.local_port for e in occupied if e.inode in inodes)


def ports_finding(
    ctx: ProbeContext, subject: str, occupied: Sequence[SocketEntry], holders: dict[int, list[Holder]], scan_error: str
) -> Finding:
    if not occupied:
        return PORTS.ok(subject, f"no socket uses ports {subject}")
    redact = ctx.redact_cmdlines
    ports = sorted({e.local_port for e in occupied})
    in_pods, outside, orphans, observed_holders = _holder_lines(occupied, holders, redact)
    observed: dict[str, Any] = {
        "ports": ports,
        "pids": sorted({h["pid"] for h in observed_holders}),
        "holders": observed_holders[:20],
        "in_pod": not outside and not orphans,
    }
    if scan_error:
        observed["scan_error"] = scan_error
    pods = pods_of(in_pods)
    pod_text = "; ".join(
        f"{members[0].where()}: ports {_ports_of(members[0], occupied)} by {list_processes(members, redact)}"
        for members in pods.values()
    )
    if not outside and not orphans:
        message = f"HCCL ports {compress_ports(ports)} in use by {len(pods)} pod(s): {pod_text}"
        hint = (
            "a running job holds them (expected while it runs); a second job on this node must use another "
            "HCCL_IF_BASE_PORT / HCCL_HOST_SOCKET_PORT_RANGE, or wait for that pod to finish"
        )
        return PORTS.report(PORT_RANGE_OCCUPIED, subject, message, observed, hint=hint, status=Status.WARN)
    parts = [f"ports {_ports_of(holder, occupied)} by {holder.phrase(redact)}" for holder in outside[:4]] + [
        f"{port} (holder not found{': ' + scan_error if scan_error else ''})" for port in orphans[:4]
    ]
    message = f"HCCL ports {compress_ports(ports)} held outside Kubernetes: {'; '.join(parts)}"
    if pod_text:
        message += f"; also in use by pods: {pod_text}"
    stop = stop_hint(outside) if outside else "find the holder (ss -tulpn | grep PORT) and stop it"
    hint = (
        f"HCCL will fail to bind: stop the leftover holder ({stop}), or move HCCL_IF_BASE_PORT and "
        "network.ports.base together"
    )
    return PORTS.report(PORT_RANGE_OCCUPIED, subject, message, observed, hint=hint)


def reserved_finding(subject: str, first: int, last: int, texts: dict[str, str]) -> Finding:
    """Ports of the range that an outgoing connection may take: in the ephemeral range, not reserved."""
    reserved = parse_port_ranges(texts["ip_local_reserved_ports"])
    ephemeral: list[tuple[int, int]] = []
    with contextlib.suppress(KeyError, ProbeParseError):
        ephemeral = parse_port_ranges(texts["ip_local_port_range"])
    missing = ports_outside(reserved, first, last)
    exposed = [p for p in missing if not ephemeral or any(a <= p <= b for a, b in ephemeral)]
    observed = {
        "reserved": compress_ports(p for a, b in reserved for p in range(a, min(b, 65535) + 1)),
        "ephemeral_range": f"{ephemeral[0][0]}-{ephemeral[0][1]}" if ephemeral else None,
        "not_reserved": compress_ports(exposed),
    }
    if not exposed:
        return PORTS.ok(RESERVED_SUBJECT, f"HCCL ports {subject} reserved or outside the ephemeral range", observed)
    message = (
        f"HCCL ports {compress_ports(exposed)} are in the ephemeral range but not in "
        "net.ipv4.ip_local_reserved_ports: any outgoing connection may take them"
    )
    hint = (
        f"sysctl -w net.ipv4.ip_local_reserved_ports={subject} (keep existing entries) and persist it in /etc/sysctl.d/"
    )
    return PORTS.report(PORTS_NOT_RESERVED, RESERVED_SUBJECT, message, observed, hint=hint)


@register
class PortsProbe(Probe):
    name = "network.ports"
    checks = ("network.ports",)
    reasons = (PORT_RANGE_OCCUPIED, PORTS_NOT_RESERVED, PROC_NET_UNREADABLE, SYSCTL_UNREADABLE)
    default_interval = 60.0
    default_timeout = 10.0
    needs = "/proc/1/net/{tcp,tcp6,udp,udp6} and /proc/*/fd of the host (hostPID)"

    def applicable(self, ctx: ProbeContext) -> str | None:
        if ctx.settings(NetworkConfig).ports.only_with_npus and not device_nodes(ctx.host.dev, NPU_NODES):
            return "no Ascend NPU on this host (/dev/davinciN): the HCCL port range does not apply"
        return None

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(NetworkConfig).ports
        first, last = settings.base, settings.base + settings.count - 1
        subject = f"{first}-{last}"
        entries: list[SocketEntry] = []
        for protocol in PROTOCOLS:
            path = ctx.host.proc_path(1, "net", protocol)
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue  # no IPv6 in this kernel
            except OSError as exc:
                message = f"cannot read {path}: {exc.strerror}"
                return [PORTS.report(PROC_NET_UNREADABLE, subject, message, {"path": str(path)})]
            entries.extend(parse_proc_net_sockets(text, protocol))
        occupied = sockets_in_range(entries, first, last)
        holders, scan_error = port_holders(ctx, occupied)
        out: ProbeOutput = [ports_finding(ctx, subject, occupied, holders, scan_error)]
        out.append(
            Sample(
                "nodehealth_network_hccl_ports_in_use",
                "Ports of the HCCL range used by a socket on the host.",
                len({e.local_port for e in occupied}),
            )
        )
        if settings.check_reserved:
            out.append(self._reserved(ctx, subject, first, last))
        return out

    def _reserved(self, ctx: ProbeContext, subject: str, first: int, last: int) -> Finding:
        names = ("ip_local_reserved_ports", "ip_local_port_range")
        try:
            texts = read_host_net_sysctls(ctx.host, names, min(2.0, ctx.remaining()))
        except OSError as exc:
            message = f"cannot read net.ipv4.ip_local_reserved_ports: {exc.strerror or exc}"
            return PORTS.report(SYSCTL_UNREADABLE, RESERVED_SUBJECT, message)
        return reserved_finding(subject, first, last, texts)
