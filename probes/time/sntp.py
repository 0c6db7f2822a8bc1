"""SNTP (RFC 4330) written here so that every answer is validated: server mode, stratum 1-15 (0 is a
kiss-of-death), leap indicator 3 (server unsynchronised), and the echoed origin timestamp, a random nonce
we sent, so a stale or forged datagram is never taken for an answer.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from probes.runtime.parallel import run_parallel
from probes.runtime.resolver import (
    DNS_KIND_TEXT,
    DNS_LIFETIME_HEADROOM,
    MIN_LIFETIME,
    NSS_DNS,
    NSS_FILES,
    HostNames,
    ResolverSetup,
    is_ip_address,
    resolve_name,
)
from probes.time.ntp_sources import NtpServer

NTP_EPOCH_OFFSET = 2208988800  # 1900-01-01 → 1970-01-01
NTP_PACKET = struct.Struct("!BBbbII4s8s8s8s8s")  # 48 bytes
# A name's addresses asked at most (a pool name may give many more; chrony's maxsources is at most 16).
MAX_MEMBERS = 16


class SntpRejected(Exception):
    """The server answered, but not with something usable (kiss-of-death, unsynchronised, not our answer)."""


@dataclass(frozen=True)
class SntpAnswer:
    offset: float  # seconds the local clock is behind (+) or ahead (-) of the server
    delay: float  # round trip, seconds
    stratum: int
    leap: int
    version: int
    reference_id: str
    root_delay: float
    root_dispersion: float


def ntp_to_unix(raw: bytes) -> float:
    seconds, fraction = struct.unpack("!II", raw)
    if seconds & 0x80000000 == 0:
        seconds += 1 << 32  # era 1 (from 2036-02-07), RFC 4330 section 3
    return seconds - NTP_EPOCH_OFFSET + fraction / 2**32


def _short_format(value: int) -> float:
    return (value >> 16) + (value & 0xFFFF) / 65536


def _reference_id(raw: bytes, stratum: int) -> str:
    if stratum <= 1:  # a kiss code (stratum 0) or a reference clock name (stratum 1), ASCII
        return raw.rstrip(b"\0").decode("ascii", "replace")
    return str(ipaddress.IPv4Address(raw))


def sntp_request(nonce: bytes) -> bytes:
    """A client request (LI 0, version 4, mode 3) whose transmit timestamp is a random nonce.

    A nonce instead of our clock leaks no time and lets the echoed origin prove the answer is to this
    request; our send time is kept locally for the offset.
    """
    return bytes([0x23]) + bytes(39) + nonce


def parse_sntp_reply(data: bytes, nonce: bytes, sent: float, received: float) -> SntpAnswer:
    """Validate a server reply and compute offset and delay. Raises SntpRejected when it is no answer."""
    if len(data) < NTP_PACKET.size:
        raise SntpRejected(f"short reply ({len(data)} bytes)")
    first, stratum, _poll, _precision, root_delay, root_dispersion, ref_id, _ref, origin, recv_ts, xmit_ts = (
        NTP_PACKET.unpack_from(data)
    )
    leap, version, mode = first >> 6, (first >> 3) & 0x7, first & 0x7
    if mode != 4:
        raise SntpRejected(f"not a server reply (mode {mode})")
    if stratum == 0:
        code = ref_id.rstrip(b"\0").decode("ascii", "replace") or "?"
        raise SntpRejected(f"kiss-of-death {code} (stratum 0)")
    if stratum > 15:
        raise SntpRejected(f"stratum {stratum}: the server is not synchronised")
    if leap == 3:
        raise SntpRejected("leap indicator 3: the server's clock is not synchronised")
    if origin != nonce:
        raise SntpRejected("origin timestamp does not echo our request (a stale or forged reply)")
    if xmit_ts == bytes(8):
        raise SntpRejected("zero transmit timestamp")
    t2, t3 = ntp_to_unix(recv_ts), ntp_to_unix(xmit_ts)
    return SntpAnswer(
        offset=((t2 - sent) + (t3 - received)) / 2,
        delay=(received - sent) - (t3 - t2),
        stratum=stratum,
        leap=leap,
        version=version,
        reference_id=_reference_id(ref_id, stratum),
        root_delay=_short_format(root_delay),
        root_dispersion=_short_format(root_dispersion),
    )


def sntp_query(address: str, port: int, timeout: float) -> SntpAnswer:
    """One SNTP exchange. A connected socket, so an ICMP port-unreachable ends the wait at once."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    nonce = secrets.token_bytes(8)
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.connect((address, port))
        sent = time.time()
        sock.send(sntp_request(nonce))
        data = sock.recv(1024)
        received = time.time()
    return parse_sntp_reply(data, nonce, sent, received)


@dataclass(frozen=True)
class ServerResult:
    server: NtpServer
    answer: SntpAnswer | None
    error: str = ""
    address: str = ""
    resolved_from: str = ""  # "/etc/hosts" or "dns" for a name; "" for an address
    # The name resolved nowhere (every source said so): the server was never asked.
    unresolved: bool = False
    # Of how many addresses of the server's name this one is (a pool member); 1: the server is one address.
    members: int = 1

    @property
    def subject(self) -> str:
        """The server as configured; a member of a name with several addresses as `NAME (ADDRESS)`."""
        return f"{self.server.entry} ({self.address})" if self.members > 1 else self.server.entry


@dataclass(frozen=True)
class NameSources:
    """How a server's name becomes an address: the host's /etc/hosts and DNS in its nsswitch.conf order, as
    the host's time daemon resolves it (through the C library), DNS with the host's resolver."""

    names: HostNames
    dns_setup: Callable[[], ResolverSetup]
    dns_timeout: float


class Unresolved(SntpRejected):
    """No source knows the name."""


def _addresses(server: NtpServer, timeout: float, lookup: NameSources) -> tuple[list[str], str]:
    """(the server's addresses, where they came from): itself when it is one, else every address the first
    source of the lookup order that knows the name gives (a pool's members). Raises Unresolved naming what each
    source said."""
    if is_ip_address(server.host):
        return [server.host], ""
    said: list[str] = []
    for source in lookup.names.order:
        if source == NSS_FILES:
            found = lookup.names.from_hosts_file(server.host)
            if found:
                return list(dict.fromkeys(found)), "/etc/hosts"
            said.append("not in /etc/hosts")
        elif source == NSS_DNS:
            setup = lookup.dns_setup()
            if setup.resolver is None:
                said.append(f"DNS: {setup.error}")
                continue
            lifetime = max(MIN_LIFETIME, timeout - DNS_LIFETIME_HEADROOM)
            outcome = resolve_name(setup.new_resolver(), server.host, lookup.dns_timeout, lifetime)
            if outcome.ok:
                return list(dict.fromkeys(outcome.addresses)), NSS_DNS
            said.append(f"DNS: {DNS_KIND_TEXT[outcome.kind]}")
    if not said:
        said.append("the host's nsswitch.conf consults neither /etc/hosts nor DNS")
    raise Unresolved(f"cannot resolve {server.host}: {'; '.join(said)}")


def _ask(server: NtpServer, address: str, left: float, resolved_from: str, members: int) -> ServerResult:
    """One address of the server, bounded by `left` seconds; never raises for the server's faults."""
    if left <= 0.05:
        return ServerResult(
            server, None, "no time left after resolving the name", address, resolved_from, False, members
        )
    try:
        answer = sntp_query(address, server.port, left)
    except TimeoutError:
        return ServerResult(server, None, f"no answer within {left:.1f} s", address, resolved_from, False, members)
    except SntpRejected as exc:
        return ServerResult(server, None, str(exc), address, resolved_from, False, members)
    except OSError as exc:
        return ServerResult(server, None, f"{exc.strerror or exc}", address, resolved_from, False, members)
    return ServerResult(server, answer, address=address, resolved_from=resolved_from, members=members)


def query_server(server: NtpServer, timeout: float, lookup: NameSources) -> list[ServerResult]:
    """One configured server, name and exchanges together bounded by `timeout`; never raises for the server's
    faults. A name with several addresses (a pool) is asked at up to MAX_MEMBERS of them at once, and judged,
    as chrony judges a pool, by the first `max_sources` that answer: those and every member that gave no usable
    answer come back, one result each."""
    started = time.monotonic()
    try:
        addresses, resolved_from = _addresses(server, timeout, lookup)
    except Unresolved as exc:
        return [ServerResult(server, None, str(exc), unresolved=True)]
    left = timeout - (time.monotonic() - started)
    if len(addresses) == 1:
        return [_ask(server, addresses[0], left, resolved_from, 1)]
    members = addresses[:MAX_MEMBERS]
    jobs = [(lambda address=address: _ask(server, address, left, resolved_from, len(members))) for address in members]
    results = run_parallel(jobs, left + 0.2)
    done = [
        result
        or ServerResult(server, None, "the query did not finish in time", address, resolved_from, False, len(members))
        for address, result in zip(members, results, strict=True)
    ]
    answered = [result for result in done if result.answer is not None][: server.max_sources]
    return [result for result in done if result.answer is None or result in answered]
