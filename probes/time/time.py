"""time.sync: is the kernel clock disciplined, and how far is it from the configured NTP servers.

- Kernel state by adjtimex(2) with modes=0: read-only, unprivileged, not namespaced (a pod sees the host
  kernel's clock state). STA_UNSYNC or a TIME_ERROR return means nothing is disciplining the clock.
- Offset by SNTP (RFC 4330) to each of `time.ntp_servers`, written here so that every answer is validated:
  mode, stratum 1-15 (0 is a kiss-of-death), leap indicator 3 (server unsynchronised), and the echoed
  origin timestamp (a random nonce we sent), so a stale or forged datagram is never taken for an answer.
- chronyd's own view (`chronyc -n tracking`) as extra observed data when chronyd answers.

Named clock.py, not time.py, so that it does not shadow the standard library's `time`.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from probes.base import Finding, Probe, ProbeContext, ProbeOutput, ProbeParseError, Sample, Status, register
from probes.network.legacy import DNS_KIND_TEXT, ResolverSetup, make_resolver, resolve_name, run_parallel
from probes.runtime.addresses import split_host_port

# --- kernel clock (adjtimex) -----------------------------------------------------------------------

TIME_OK, TIME_INS, TIME_DEL, TIME_OOP, TIME_WAIT, TIME_ERROR = range(6)
STA_PLL = 0x0001
STA_UNSYNC = 0x0040
STA_CLOCKERR = 0x1000
STA_NANO = 0x2000
CLOCK_STATES = {
    TIME_OK: "TIME_OK",
    TIME_INS: "TIME_INS",
    TIME_DEL: "TIME_DEL",
    TIME_OOP: "TIME_OOP",
    TIME_WAIT: "TIME_WAIT",
    TIME_ERROR: "TIME_ERROR",
}


class Timeval(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


class Timex(ctypes.Structure):
    """struct timex of <sys/timex.h> (glibc). The kernel ABI is the same on x86_64 and aarch64 (LP64):
    208 bytes, natural alignment supplies the padding after the int members."""

    _fields_ = [
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("constant", ctypes.c_long),
        ("precision", ctypes.c_long),
        ("tolerance", ctypes.c_long),
        ("time", Timeval),
        ("tick", ctypes.c_long),
        ("ppsfreq", ctypes.c_long),
        ("jitter", ctypes.c_long),
        ("shift", ctypes.c_int),
        ("stabil", ctypes.c_long),
        ("jitcnt", ctypes.c_long),
        ("calcnt", ctypes.c_long),
        ("errcnt", ctypes.c_long),
        ("stbcnt", ctypes.c_long),
        ("tai", ctypes.c_int),
        ("_reserved", ctypes.c_int * 11),
    ]


@dataclass(frozen=True)
class KernelClock:
    state: int  # adjtimex's return value: TIME_OK ... TIME_ERROR
    status: int  # STA_* bits
    maxerror_us: int
    esterror_us: int
    offset: int  # µs, or ns with STA_NANO
    freq: int  # ppm << 16
    tai: int

    @property
    def unsynced(self) -> bool:
        return bool(self.status & STA_UNSYNC) or self.state == TIME_ERROR

    @property
    def offset_seconds(self) -> float:
        return self.offset / (1e9 if self.status & STA_NANO else 1e6)

    def observed(self) -> dict[str, Any]:
        return {
            "state": CLOCK_STATES.get(self.state, str(self.state)),
            "status": f"0x{self.status:04x}",
            "unsync": bool(self.status & STA_UNSYNC),
            "clockerr": bool(self.status & STA_CLOCKERR),
            "maxerror_seconds": self.maxerror_us / 1e6,
            "esterror_seconds": self.esterror_us / 1e6,
            "pll_offset_seconds": self.offset_seconds,
            "freq_ppm": round(self.freq / 65536, 3),
            "tai_offset": self.tai,
        }


_libc: ctypes.CDLL | None = None


def read_kernel_clock() -> KernelClock:
    """adjtimex(2) with modes=0: reads the kernel's clock discipline state without changing anything."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    tx = Timex()
    tx.modes = 0
    state = _libc.adjtimex(ctypes.byref(tx))
    if state < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return KernelClock(state, tx.status, tx.maxerror, tx.esterror, tx.offset, tx.freq, tx.tai)


# --- SNTP ------------------------------------------------------------------------------------------

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
    server: str
    answer: SntpAnswer | None
    error: str = ""
    address: str = ""


def query_server(
    entry: str, timeout: float, dns_setup: Callable[[], ResolverSetup], dns_timeout: float
) -> ServerResult:
    host, port = split_host_port(entry, 123)
    started = time.monotonic()
    try:
        ipaddress.ip_address(host)
        address = host
    except ValueError:
        setup = dns_setup()
        if setup.resolver is None:
            return ServerResult(entry, None, f"cannot resolve {host}: {setup.error}")
        outcome = resolve_name(setup.new_resolver(), host, dns_timeout, max(0.1, timeout - 0.5))
        if not outcome.ok:
            return ServerResult(entry, None, f"cannot resolve {host}: {DNS_KIND_TEXT[outcome.kind]}")
        address = outcome.addresses[0]
    left = timeout - (time.monotonic() - started)
    if left <= 0.05:
        return ServerResult(entry, None, "no time left after resolving the name", address)
    try:
        return ServerResult(entry, sntp_query(address, port, left), address=address)
    except TimeoutError:
        return ServerResult(entry, None, f"no answer within {left:.1f} s", address)
    except SntpRejected as exc:
        return ServerResult(entry, None, str(exc), address)
    except OSError as exc:
        return ServerResult(entry, None, f"{exc.strerror or exc}", address)


# --- chrony ----------------------------------------------------------------------------------------

_CHRONY_SECONDS = {
    "Last offset": "last_offset_seconds",
    "RMS offset": "rms_offset_seconds",
    "Root delay": "root_delay_seconds",
    "Root dispersion": "root_dispersion_seconds",
    "Update interval": "update_interval_seconds",
}
_CHRONY_PPM = {"Residual freq": "residual_freq_ppm", "Skew": "skew_ppm"}


def _number(text: str, key: str) -> float:
    try:
        return float(text.split()[0])
    except (IndexError, ValueError):
        raise ProbeParseError(f"chronyc tracking: {key}: not a number: {text!r}") from None


def parse_chrony_tracking(text: str) -> dict[str, Any]:
    """`chronyc -n tracking` → numbers in seconds and ppm; offsets positive when the clock is fast."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    missing = [k for k in ("Reference ID", "Stratum", "Leap status") if k not in fields]
    if missing:
        raise ProbeParseError(f"chronyc tracking: no {', '.join(missing)} line in {text[:120]!r}")
    out: dict[str, Any] = {
        "reference_id": fields["Reference ID"],
        "stratum": int(_number(fields["Stratum"], "Stratum")),
        "leap_status": fields["Leap status"],
    }
    if "Ref time (UTC)" in fields:
        out["ref_time_utc"] = fields["Ref time (UTC)"]
    if "System time" in fields:
        # "0.000006523 seconds slow of NTP time": slow means behind, a negative offset.
        value = fields["System time"]
        number = _number(value, "System time")
        out["system_time_offset_seconds"] = -number if " slow" in value else number
    if "Frequency" in fields:
        value = fields["Frequency"]
        number = _number(value, "Frequency")
        out["frequency_ppm"] = -number if value.endswith("slow") else number
    for key, name in {**_CHRONY_SECONDS, **_CHRONY_PPM}.items():
        if key in fields:
            out[name] = _number(fields[key], key)
    return out


def chrony_tracking(ctx: ProbeContext) -> tuple[dict[str, Any] | None, str]:
    """(tracking data, parse error); (None, "") when chronyc is absent or chronyd does not answer."""
    settings = ctx.config.time
    if not settings.chronyc_command:
        return None, ""
    result = ctx.host.run(
        [*settings.chronyc_command, "-n", "tracking"], timeout=min(settings.chronyc_timeout_seconds, ctx.remaining())
    )
    if not result.ok:  # not installed, timed out, "506 Cannot talk to daemon"
        return None, ""
    try:
        return parse_chrony_tracking(result.stdout), ""
    except ProbeParseError as exc:
        return None, str(exc)


# --- findings --------------------------------------------------------------------------------------

HINT_UNSYNCED = (
    "start or fix the time daemon on the node (systemctl status chronyd / systemd-timesyncd / ntpd; "
    "chronyc sources) so the kernel clock is disciplined"
)
HINT_SKEW = (
    "the node's clock is off: check `chronyc tracking` and `chronyc sources`, make sure NTP (UDP 123) to the "
    "servers is allowed, then step the clock (chronyc makestep)"
)


def kernel_finding(
    clock: KernelClock,
    answers: list[SntpAnswer],
    warn_offset: float,
    chrony: dict[str, Any] | None,
    unsynced_status: str = "warn",
) -> Finding:
    """The kernel's discipline state. Unsynced is a warning only while an NTP server vouches for the clock
    (|offset| below warn_offset_seconds): the time is right now, but nothing keeps it right."""
    observed = clock.observed()
    if chrony is not None:
        observed["chrony"] = chrony
    if not clock.unsynced:
        return Finding(
            "time.sync",
            "kernel",
            Status.OK,
            "OK",
            f"kernel clock synchronised (max error {clock.maxerror_us / 1000:.1f} ms, "
            f"estimated error {clock.esterror_us / 1000:.1f} ms)",
            observed=observed,
        )
    why = "STA_UNSYNC" if clock.status & STA_UNSYNC else "TIME_ERROR"
    good = [a for a in answers if abs(a.offset) < warn_offset]
    if good:
        best = min(good, key=lambda a: abs(a.offset))
        return Finding(
            "time.sync",
            "kernel",
            Status.WARN,
            "ClockUnsynced",
            f"kernel clock not synchronised ({why}), though an NTP server agrees within "
            f"{abs(best.offset) * 1000:.1f} ms",
            HINT_UNSYNCED,
            observed,
        )
    # With no NTP answer to measure against, an undisciplined clock is not yet a wrong clock: how bad it
    # is stays the operator's call (time.unsynced_status). Measured disagreement is always a failure.
    status = Status(unsynced_status) if not answers else Status.FAIL
    return Finding(
        "time.sync",
        "kernel",
        status,
        "ClockUnsynced",
        f"kernel clock not synchronised ({why}, max error {clock.maxerror_us / 1e6:g} s)"
        + ("; no NTP server answered to measure its offset" if not answers else "; NTP servers disagree with it"),
        HINT_UNSYNCED,
        observed,
    )


def server_finding(result: ServerResult, warn_offset: float, fail_offset: float) -> Finding:
    answer = result.answer
    observed: dict[str, Any] = {"address": result.address} if result.address else {}
    if answer is None:
        return Finding(
            "time.sync",
            result.server,
            Status.UNKNOWN,
            "NtpNoAnswer",
            f"no usable answer from NTP server {result.server}: {result.error}",
            "check the server is reachable over UDP 123 from this node and is itself synchronised",
            {**observed, "error": result.error},
        )
    observed.update(
        {
            "offset_seconds": round(answer.offset, 6),
            "delay_seconds": round(answer.delay, 6),
            "stratum": answer.stratum,
            "reference_id": answer.reference_id,
        }
    )
    magnitude = abs(answer.offset)
    direction = "behind" if answer.offset > 0 else "ahead of"
    text = f"clock {magnitude:.3f} s {direction} {result.server} (stratum {answer.stratum})"
    if magnitude >= fail_offset:
        return Finding("time.sync", result.server, Status.FAIL, "ClockSkew", text, HINT_SKEW, observed)
    if magnitude >= warn_offset:
        return Finding("time.sync", result.server, Status.WARN, "ClockSkew", text, HINT_SKEW, observed)
    return Finding(
        "time.sync",
        result.server,
        Status.OK,
        "OK",
        f"clock within {magnitude * 1000:.1f} ms of {result.server} (stratum {answer.stratum})",
        observed=observed,
    )


@register
class TimeProbe(Probe):
    name = "time"
    checks = ("time.sync",)
    default_interval = 60.0
    default_timeout = 8.0
    needs = "adjtimex(2) (unprivileged); UDP 123 to time.ntp_servers; chronyc (optional)"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.config.time
        out: ProbeOutput = []
        setup_cache: list[ResolverSetup] = []

        def dns_setup() -> ResolverSetup:
            if not setup_cache:
                setup_cache.append(make_resolver(ctx.host, ctx.config.network.dns))
            return setup_cache[0]

        if any(_needs_dns(entry) for entry in settings.ntp_servers):
            dns_setup()  # once, before the threads
        budget = max(0.1, min(settings.ntp_timeout_seconds, ctx.remaining() - 0.3))
        dns_timeout = ctx.config.network.dns.timeout_seconds
        jobs = [
            (lambda entry=entry: query_server(entry, budget, dns_setup, dns_timeout)) for entry in settings.ntp_servers
        ]
        results = run_parallel(jobs, budget + 0.5)
        answers: list[SntpAnswer] = []
        for entry, result in zip(settings.ntp_servers, results, strict=True):
            result = result or ServerResult(entry, None, "the query did not finish in time")
            out.append(server_finding(result, settings.warn_offset_seconds, settings.fail_offset_seconds))
            if result.answer is not None:
                answers.append(result.answer)
                labels = {"server": entry}
                out.append(
                    Sample(
                        "nodehealth_time_offset_seconds",
                        "Offset of the local clock from the NTP server (positive: local clock behind).",
                        result.answer.offset,
                        labels,
                    )
                )
                out.append(
                    Sample(
                        "nodehealth_time_ntp_delay_seconds",
                        "Round-trip delay to the NTP server.",
                        result.answer.delay,
                        labels,
                    )
                )
        chrony, chrony_error = chrony_tracking(ctx)
        if chrony_error:
            out.append(
                Finding(
                    "time.sync",
                    "chrony",
                    Status.UNKNOWN,
                    "ParseError",
                    f"cannot read chronyc tracking output: {chrony_error}",
                    "report the chronyc version and output; the kernel and SNTP checks still apply",
                )
            )
        try:
            clock = read_kernel_clock()
        except OSError as exc:
            out.append(
                Finding(
                    "time.sync",
                    "kernel",
                    Status.UNKNOWN,
                    "AdjtimexFailed",
                    f"adjtimex(2) failed: {exc.strerror}",
                    "a seccomp profile may block adjtimex: run the agent with the RuntimeDefault profile",
                )
            )
            return out
        out.append(kernel_finding(clock, answers, settings.warn_offset_seconds, chrony, settings.unsynced_status))
        out.append(
            Sample(
                "nodehealth_time_synced",
                "1 when the kernel clock is synchronised (no STA_UNSYNC).",
                0.0 if clock.unsynced else 1.0,
            )
        )
        out.append(
            Sample(
                "nodehealth_time_max_error_seconds",
                "Kernel clock maximum error (adjtimex maxerror).",
                clock.maxerror_us / 1e6,
            )
        )
        out.append(
            Sample(
                "nodehealth_time_estimated_error_seconds",
                "Kernel clock estimated error (adjtimex esterror).",
                clock.esterror_us / 1e6,
            )
        )
        return out


def _needs_dns(entry: str) -> bool:
    host, _ = split_host_port(entry, 123)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False
