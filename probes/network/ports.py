"""network.ports: is the HCCL port range free, and reserved from the ephemeral range.

Sockets come from /proc/1/net/{tcp,tcp6,udp,udp6} (the host's namespace, with hostPID); their holders from
one scan of /proc/*/fd in a child with a deadline, each pid classified by its cgroup (in a pod or not).
net.ipv4.ip_local_reserved_ports is read by a child inside the host's network namespace, because network
sysctls belong to the namespace of the reader.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
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

PORTS = Check("network.ports")
RESERVED_SUBJECT = "net.ipv4.ip_local_reserved_ports"

PORT_RANGE_OCCUPIED = Reason(
    "PortRangeOccupied",
    Status.FAIL,
    "sockets use ports of the HCCL range; observed.holders names port, protocol, pid, command, owner and in_pod. "
    "Fail when any holder is outside Kubernetes or unknown, warn when all are in pods",
    "stop the leftover process of an earlier job (kill PID), or move HCCL_IF_BASE_PORT and network.ports.base together",
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


@dataclass(frozen=True)
class PortHolder:
    pid: int
    command: str
    owner: str  # CgroupOwner.describe()
    in_pod: bool


def port_holders(ctx: ProbeContext, inodes: set[int]) -> tuple[dict[int, list[PortHolder]], str]:
    """Socket inode → the processes holding it, and the scan error if the scan failed.

    The one place that knows how holders are found: a shared device/port holders module replaces it."""
    if not inodes:
        return {}, ""
    from probes.runtime import procfs

    try:
        scan = procfs.scan_open_files(ctx.host, sockets=inodes, timeout=max(0.1, ctx.remaining() - 0.2))
    except procfs.ScanError as exc:
        return {}, str(exc)
    holders: dict[int, list[PortHolder]] = {}
    seen: set[tuple[int, int]] = set()
    for match in scan.matches:
        inode = match.key[1]
        if (inode, match.pid) in seen:
            continue
        seen.add((inode, match.pid))
        info = procfs.process_info(ctx.host.proc, match.pid)
        if info is None:
            continue
        holders.setdefault(inode, []).append(
            PortHolder(match.pid, info.command, info.cgroup.describe(), info.cgroup.in_pod)
        )
    return holders, ""


def _describe_holders(
    occupied: Sequence[SocketEntry], holders: dict[int, list[PortHolder]]
) -> tuple[list[str], list[dict[str, Any]], bool]:
    """(one line per socket holder, observed holders, whether every holder is in a pod)."""
    described: list[str] = []
    observed_holders: list[dict[str, Any]] = []
    all_in_pods = True
    for entry in occupied:
        owners = holders.get(entry.inode, [])
        if not owners:
            all_in_pods = False
            described.append(f"{entry.local_port}/{entry.protocol} (owner unknown)")
        for holder in owners:
            all_in_pods = all_in_pods and holder.in_pod
            described.append(
                f"{entry.local_port}/{entry.protocol} pid {holder.pid} ({holder.command[:40]}, {holder.owner})"
            )
            observed_holders.append(
                {
                    "port": entry.local_port,
                    "protocol": entry.protocol,
                    "state": entry.state.lower(),
                    "pid": holder.pid,
                    "command": holder.command[:120],
                    "owner": holder.owner,
                    "in_pod": holder.in_pod,
                }
            )
    return list(dict.fromkeys(described)), observed_holders, all_in_pods


def ports_finding(
    subject: str, occupied: Sequence[SocketEntry], holders: dict[int, list[PortHolder]], scan_error: str
) -> Finding:
    if not occupied:
        return PORTS.ok(subject, f"no socket uses ports {subject}")
    ports = sorted({e.local_port for e in occupied})
    described, observed_holders, all_in_pods = _describe_holders(occupied, holders)
    observed: dict[str, Any] = {
        "ports": ports,
        "pids": sorted({h["pid"] for h in observed_holders}),
        "holders": observed_holders[:20],
        "in_pod": all_in_pods,
    }
    if scan_error:
        observed["scan_error"] = scan_error
    shown = "; ".join(described[:4]) + (f"; and {len(described) - 4} more" if len(described) > 4 else "")
    if all_in_pods:
        message = f"HCCL ports {compress_ports(ports)} in use by pods: {shown}"
        hint = (
            "a running job holds them (expected while it runs); a second job on this node must use another "
            "HCCL_IF_BASE_PORT / HCCL_HOST_SOCKET_PORT_RANGE"
        )
        return PORTS.report(PORT_RANGE_OCCUPIED, subject, message, observed, hint=hint, status=Status.WARN)
    message = f"HCCL ports {compress_ports(ports)} held outside Kubernetes: {shown}"
    hint = (
        "HCCL will fail to bind: stop the leftover process (kill PID) from an earlier job, or move the range "
        "(HCCL_IF_BASE_PORT) and network.ports.base together"
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
        holders, scan_error = port_holders(ctx, {e.inode for e in occupied})
        out: ProbeOutput = [ports_finding(subject, occupied, holders, scan_error)]
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
