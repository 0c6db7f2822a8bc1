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

from probes.runtime.resolver import (
    DNS_KIND_TEXT,
    DNS_LIFETIME_HEADROOM,
    MIN_LIFETIME,
    ResolverSetup,
    is_ip_address,
    resolve_name,
)
from probes.time.ntp_sources import NtpServer

NTP_EPOCH_OFFSET = 2208988800  # 1900-01-01 → 1970-01-01
NTP_PACKET = struct.Struct("!BBbbII4s8s8s8s8s")  # 48 bytes


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


def _address(server: NtpServer, timeout: float, dns_setup: Callable[[], ResolverSetup], dns_timeout: float) -> str:
    """The server's address: itself when it is one, else its first address from the host's resolver.
    Raises SntpRejected when the name does not resolve."""
    if is_ip_address(server.host):
        return server.host
    setup = dns_setup()
    if setup.resolver is None:
        raise SntpRejected(f"cannot resolve {server.host}: {setup.error}")
    lifetime = max(MIN_LIFETIME, timeout - DNS_LIFETIME_HEADROOM)
    outcome = resolve_name(setup.new_resolver(), server.host, dns_timeout, lifetime)
    if not outcome.ok:
        raise SntpRejected(f"cannot resolve {server.host}: {DNS_KIND_TEXT[outcome.kind]}")
    return outcome.addresses[0]


def query_server(
    server: NtpServer, timeout: float, dns_setup: Callable[[], ResolverSetup], dns_timeout: float
) -> ServerResult:
    """One server, name and exchange together bounded by `timeout`; never raises for the server's faults."""
    started = time.monotonic()
    try:
        address = _address(server, timeout, dns_setup, dns_timeout)
    except SntpRejected as exc:
        return ServerResult(server, None, str(exc))
    left = timeout - (time.monotonic() - started)
    if left <= 0.05:
        return ServerResult(server, None, "no time left after resolving the name", address)
    try:
        return ServerResult(server, sntp_query(address, server.port, left), address=address)
    except TimeoutError:
        return ServerResult(server, None, f"no answer within {left:.1f} s", address)
    except SntpRejected as exc:
        return ServerResult(server, None, str(exc), address)
    except OSError as exc:
        return ServerResult(server, None, f"{exc.strerror or exc}", address)
