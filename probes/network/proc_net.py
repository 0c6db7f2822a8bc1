"""Parsers for the HCCL port check: /proc/net/{tcp,tcp6,udp,udp6} rows, port-range sysctls, port lists.

Small pure functions over the kernel's text; a row or header they cannot read raises ProbeParseError.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from probes.base import ProbeParseError

TCP_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
    "0C": "NEW_SYN_RECV",
}


@dataclass(frozen=True)
class SocketEntry:
    protocol: str  # tcp, tcp6, udp, udp6
    local_address: str
    local_port: int
    remote_address: str
    remote_port: int
    state: str  # TCP state name; for UDP 07 (CLOSE) means unconnected, 01 connected
    uid: int
    inode: int


def _hex_address(text: str) -> tuple[str, int]:
    address_hex, _, port_hex = text.partition(":")
    port = int(port_hex, 16)
    raw = bytes.fromhex(address_hex)
    if len(raw) == 4:
        # The kernel prints the 32-bit word in host byte order (little-endian on x86_64 and aarch64).
        return str(ipaddress.IPv4Address(raw[::-1])), port
    if len(raw) == 16:
        address = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
        mapped = address.ipv4_mapped
        return (f"::ffff:{mapped}" if mapped else str(address)), port
    raise ValueError(f"address of {len(raw)} bytes")


def parse_proc_net_sockets(text: str, protocol: str) -> list[SocketEntry]:
    """/proc/net/{tcp,tcp6,udp,udp6} → sockets. Raises ProbeParseError on a header or row it cannot read."""
    lines = text.splitlines()
    if not lines:
        return []
    header = lines[0].split()
    if not header or header[0] != "sl" or "local_address" not in header or "inode" not in header:
        raise ProbeParseError(f"/proc/net/{protocol}: unexpected header {lines[0][:80]!r}")
    entries = []
    for line in lines[1:]:
        fields = line.split()
        if not fields:
            continue
        try:
            if not fields[0].endswith(":") or len(fields) < 10:
                raise ValueError("too few fields")
            local_address, local_port = _hex_address(fields[1])
            remote_address, remote_port = _hex_address(fields[2])
            state_hex = fields[3].upper()
            entries.append(
                SocketEntry(
                    protocol,
                    local_address,
                    local_port,
                    remote_address,
                    remote_port,
                    TCP_STATES.get(state_hex, state_hex),
                    int(fields[7]),
                    int(fields[9]),
                )
            )
        except ValueError as exc:
            raise ProbeParseError(f"/proc/net/{protocol}: cannot read row {line.strip()[:100]!r}: {exc}") from None
    return entries


def parse_port_ranges(text: str) -> list[tuple[int, int]]:
    """ip_local_reserved_ports / ip_local_port_range text → inclusive (first, last) ranges.

    Accepts "60000-60015,61000" (reserved ports, comma separated, possibly empty) and "32768\t60999"
    (the ephemeral range).
    """
    text = text.strip()
    if not text:
        return []
    if "," not in text and "-" not in text and len(text.split()) == 2:
        try:
            first, last = (int(p) for p in text.split())
        except ValueError:
            raise ProbeParseError(f"not a port range: {text[:80]!r}") from None
        return [(first, last)]
    ranges = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            first_text, _, last_text = part.partition("-")
            first = int(first_text)
            last = int(last_text) if last_text else first
        except ValueError:
            raise ProbeParseError(f"not a port range list: {text[:80]!r}") from None
        ranges.append((first, last))
    return ranges


def ports_outside(ranges: Sequence[tuple[int, int]], first: int, last: int) -> list[int]:
    return [p for p in range(first, last + 1) if not any(a <= p <= b for a, b in ranges)]


def compress_ports(ports: Iterable[int]) -> str:
    """[60000, 60001, 60002, 60005] → "60000-60002,60005"."""
    out: list[str] = []
    run: list[int] = []
    for port in sorted(set(ports)):
        if run and port == run[-1] + 1:
            run.append(port)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [port]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def sockets_in_range(entries: Iterable[SocketEntry], first: int, last: int) -> list[SocketEntry]:
    """Sockets that keep a port of the range from being bound: listeners, bound UDP, and connections whose
    *local* port is in the range (an ephemeral-port collision). TIME_WAIT has no owner and goes away."""
    return [
        e
        for e in entries
        if first <= e.local_port <= last and e.state not in ("TIME_WAIT", "NEW_SYN_RECV") and e.inode != 0
    ]
