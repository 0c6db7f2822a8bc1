"""One egress target, phase by phase: name, TCP connect, optional HTTP CONNECT through a proxy, TLS, HTTP GET.

Every phase runs under the target's deadline, itself cut to what the probe run has left, so a whitelist gap
reads as the phase that failed (EgressTimeout at `connect`, EgressTlsFailed at `tls`) instead of a probe
that overran. Each failure is classified into one reason here.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import http.client
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from probes.base import Reason, Status
from probes.runtime.addresses import split_host_port
from probes.runtime.resolver import (
    DNS_KIND_TEXT,
    DNS_LIFETIME_HEADROOM,
    MIN_LIFETIME,
    ResolverSetup,
    is_ip_address,
    parse_hosts_file,
    resolve_name,
)

if TYPE_CHECKING:
    from probes.network.config import EgressTarget

EGRESS_DNS_FAILED = Reason(
    "EgressDnsFailed",
    Status.FAIL,
    "the target's (or its proxy's) name does not resolve from this node",
    "the name does not resolve from this node: check the network.dns findings and the node's resolv.conf; "
    "add the missing internal DNS record (or split-horizon zone)",
)
EGRESS_REFUSED = Reason(
    "EgressRefused",
    Status.FAIL,
    "actively refused or rejected: TCP RST, ICMP unreachable, a blackhole or prohibit route (observed.errno), "
    "the proxy answering CONNECT with e.g. 403, or a reset at the TLS ClientHello (SNI filtering)",
    "add this host:port to the egress whitelist / proxy allow-list, or check the service is listening",
)
EGRESS_PROXY_AUTH_REQUIRED = Reason(
    "EgressProxyAuthRequired",
    Status.FAIL,
    "the proxy answered CONNECT with 407 Proxy Authentication Required: it lets this node through only with "
    "credentials (observed.proxy_authenticate names the scheme it asks for)",
    "proxy authentication required: check the proxy credentials the node's jobs use (HTTPS_PROXY="
    "http://USER:PASSWORD@PROXY:PORT; expired or rotated?) or have the proxy admit this node's address without "
    "them; the agent's own CONNECT carries none",
)
EGRESS_PROXY_STALLED = Reason(
    "EgressProxyStalled",
    Status.FAIL,
    "the proxy accepted the TCP connection but did not answer CONNECT within the deadline (observed.phase proxy)",
    "the proxy accepted the connection but did not answer the CONNECT: the proxy is stalled or filtering (not "
    "the network on the way to it); check the proxy's health and logs, and its own route to the destination",
)
EGRESS_TIMEOUT = Reason(
    "EgressTimeout",
    Status.FAIL,
    "no answer in time at observed.phase (dns, connect, tls, http): packets silently dropped",
    "the egress firewall or security group silently drops this destination: whitelist it, or check the "
    "routes and the proxy",
)
EGRESS_TLS_FAILED = Reason(
    "EgressTlsFailed",
    Status.FAIL,
    "the TLS handshake failed; observed.tls_error has OpenSSL's reason (self-signed certificate, hostname "
    "mismatch, WRONG_VERSION_NUMBER)",
    "an intercepting proxy with its own CA: set ca_file to its CA; otherwise fix the certificate, the "
    "hostname or the port",
)
EGRESS_HTTP_STATUS = Reason(
    "EgressHttpStatus",
    Status.FAIL,
    "the server answered GET http_path with a status not in expect_status (a mirror answering 503), or with "
    "no valid HTTP",
    "a mirror under maintenance (503), an authentication wall (401/403), or a wrong http_path",
)
EGRESS_CHECK_FAILED = Reason(
    "EgressCheckFailed",
    Status.UNKNOWN,
    "the check itself raised an unexpected error",
    "report it with the message; the other targets are still checked",
)
EGRESS_FAILURES = (
    EGRESS_DNS_FAILED,
    EGRESS_REFUSED,
    EGRESS_PROXY_AUTH_REQUIRED,
    EGRESS_PROXY_STALLED,
    EGRESS_TIMEOUT,
    EGRESS_TLS_FAILED,
    EGRESS_HTTP_STATUS,
    EGRESS_CHECK_FAILED,
)


class EgressError(Exception):
    """One failed phase of an egress check: its reason and a one-line message."""

    def __init__(self, reason: Reason, message: str, **observed: Any) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.observed = observed


@dataclass
class EgressResult:
    target: EgressTarget
    deadline_seconds: float = 0.0  # the target's timeout, cut to what the probe run had left
    connect_seconds: float | None = None
    duration: float = 0.0
    address: str = ""
    tls_version: str = ""
    http_status: int | None = None
    phases: dict[str, float] = field(default_factory=dict)  # phase → seconds, in order
    error: EgressError | None = None


class Deadline:
    def __init__(self, seconds: float, configured: float) -> None:
        self.seconds = max(0.0, seconds)
        self.configured = configured
        self.end = time.monotonic() + self.seconds

    def left(self, phase: str, what: str) -> float:
        """Seconds left for `phase` (dns, connect, proxy, tls, http); EgressTimeout at that phase when none."""
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise EgressError(EGRESS_TIMEOUT, f"no time left before {what} ({self.describe()})", phase=phase)
        return remaining

    def describe(self) -> str:
        if self.seconds < self.configured:
            return f"{self.seconds:.1f} s, cut from timeout_seconds {self.configured:g} s to the probe's deadline"
        return f"{self.seconds:g} s"


class NameLookup:
    """Names of targets and proxies → addresses: /etc/hosts of the host first, then the host's resolver.
    Both are read once per probe run, on first use, by whichever thread needs them first."""

    def __init__(self, hosts_file: Path, dns_setup: Callable[[], ResolverSetup], dns_timeout: float) -> None:
        self._hosts_file = hosts_file
        self._dns_setup = dns_setup
        self._dns_timeout = dns_timeout
        self._lock = threading.Lock()
        self._setup: ResolverSetup | None = None
        self._hosts: dict[str, list[str]] | None = None

    def _cached(self) -> tuple[dict[str, list[str]], ResolverSetup]:
        with self._lock:
            if self._hosts is None:
                try:
                    self._hosts = parse_hosts_file(self._hosts_file.read_text())
                except OSError:
                    self._hosts = {}
            if self._setup is None:
                self._setup = self._dns_setup()
            return self._hosts, self._setup

    def addresses(self, name: str, deadline: Deadline) -> list[str]:
        if is_ip_address(name):
            return [name]
        hosts, setup = self._cached()
        if hosts.get(name.lower()):
            return hosts[name.lower()]
        if setup.resolver is None:
            raise EgressError(EGRESS_DNS_FAILED, f"cannot resolve {name}: {setup.error}", dns_error="no_nameserver")
        lifetime = deadline.left("dns", f"resolving {name}") - DNS_LIFETIME_HEADROOM
        if lifetime < MIN_LIFETIME:
            raise EgressError(EGRESS_TIMEOUT, f"no time left to resolve {name} ({deadline.describe()})", phase="dns")
        outcome = resolve_name(setup.new_resolver(), name, self._dns_timeout, lifetime)
        if not outcome.ok:
            raise EgressError(
                EGRESS_DNS_FAILED,
                f"cannot resolve {name}: {DNS_KIND_TEXT[outcome.kind]} ({outcome.detail or 'no detail'})",
                dns_error=outcome.kind,
                nameservers=list(setup.nameservers),
            )
        # A records first (resolve_name asks for A before AAAA): many egress firewalls are IPv4-only.
        return list(outcome.addresses)


# connect(2) errors that mean a route or firewall rejected the destination, with what usually causes them.
REJECTED_ERRNOS = {
    errno.EHOSTUNREACH: "no route to host: an unreachable route or an ICMP host-unreachable/prohibited reject",
    errno.ENETUNREACH: "network unreachable: no route to it",
    errno.EACCES: "a local firewall rule or prohibit route",
    errno.EPERM: "a local firewall rule",
    errno.EINVAL: "a blackhole route",
}


def _rejected(exc: OSError, what: str, address: str, port: int) -> EgressError:
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return EgressError(
        EGRESS_REFUSED,
        f"connection to {what} ({address}:{port}) rejected: {name}, {REJECTED_ERRNOS[exc.errno or 0]}",
        phase="connect",
        address=address,
        errno=name,
    )


# RFC 8305's Connection Attempt Delay: how long one attempt has alone before the next address is tried too
# (curl's --happy-eyeballs-timeout-ms default is 200 ms, the RFC recommends 250 ms).
CONNECTION_ATTEMPT_DELAY = 0.25


def interleaved(addresses: Sequence[str]) -> list[str]:
    """RFC 8305 section 4: alternate the address families, starting with the first address's family, so a dead
    family costs one attempt delay, not a connect timeout per address."""
    first = [a for a in addresses if (":" in a) == (":" in addresses[0])] if addresses else []
    second = [a for a in addresses if a not in first]
    out: list[str] = []
    for index in range(max(len(first), len(second))):
        out.extend(group[index] for group in (first, second) if index < len(group))
    return out


def _failure_text(error: OSError | None) -> str:
    if error is None:
        return "no answer"
    if isinstance(error, ConnectionRefusedError):
        return "refused"
    name = errno.errorcode.get(error.errno or 0, str(error.errno))
    return f"rejected ({name})"


def connect(addresses: Sequence[str], port: int, deadline: Deadline, what: str) -> tuple[socket.socket, str]:
    """TCP to the address that accepts first, racing them as curl does (RFC 8305 Happy Eyeballs): the next
    address starts when the one before failed or had CONNECTION_ATTEMPT_DELAY alone, so a dead first address
    (an IPv6 mirror address that drops packets) costs a quarter of a second, not the deadline. The error names
    every address that failed and how; `failed` in its observed maps each to its failure."""
    order = interleaved(addresses)
    if not order:
        raise EgressError(EGRESS_DNS_FAILED, f"no address for {what}", phase="dns")
    pending: dict[socket.socket, str] = {}
    failed: dict[str, OSError | None] = {}
    next_start = 0.0
    index = 0
    try:
        while True:
            now = time.monotonic()
            if index < len(order) and (now >= next_start or not pending):
                address = order[index]
                index += 1
                sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                code = sock.connect_ex((address, port))
                if code in (0, errno.EINPROGRESS):
                    pending[sock] = address
                else:
                    sock.close()
                    failed[address] = OSError(code, os.strerror(code))
                    continue
                next_start = now + CONNECTION_ATTEMPT_DELAY
            if not pending:
                break
            remaining = deadline.end - time.monotonic()
            if remaining <= 0:
                break
            wait = min(remaining, max(0.0, next_start - time.monotonic())) if index < len(order) else remaining
            _, writable, _ = select.select([], list(pending), [], wait)
            for sock in writable:
                address = pending.pop(sock)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code == 0:
                    sock.setblocking(True)
                    return sock, address
                sock.close()
                failed[address] = OSError(code, os.strerror(code))
    finally:
        for sock in pending:
            sock.close()
    return _no_connection(order, failed, port, deadline, what)


def _no_connection(
    order: Sequence[str], failed: dict[str, OSError | None], port: int, deadline: Deadline, what: str
) -> NoReturn:
    errors = {address: failed.get(address) for address in order}
    tried = "; ".join(f"{shown_address(address)}:{port} {_failure_text(error)}" for address, error in errors.items())
    observed: dict[str, Any] = {"failed": {address: _failure_text(error) for address, error in errors.items()}}
    silent = [address for address, error in errors.items() if error is None]
    if silent:
        raise EgressError(
            EGRESS_TIMEOUT,
            f"TCP connect to {what} got no answer within {deadline.describe()} ({tried})",
            phase="connect",
            address=silent[0],
            **observed,
        )
    for address, error in errors.items():
        if error is not None and error.errno in REJECTED_ERRNOS:
            rejected = _rejected(error, what, address, port)
            rejected.message += f" ({tried})" if len(errors) > 1 else ""
            rejected.observed.update(observed)
            raise rejected
        if error is not None and not isinstance(error, ConnectionRefusedError) and error.errno != errno.ECONNREFUSED:
            raise error
    address = order[-1]
    message = f"{what} ({shown_address(address)}:{port}) refused the connection" + (
        f" ({tried})" if len(errors) > 1 else ""
    )
    raise EgressError(EGRESS_REFUSED, message, phase="connect", address=address, **observed)


def shown_address(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _read_http_head(sock: socket.socket, deadline: Deadline, limit: int = 16384) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        sock.settimeout(deadline.left("proxy", "the proxy's answer"))
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            break
    return data


def proxy_connect(sock: socket.socket, proxy: str, host: str, port: int, deadline: Deadline) -> None:
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    request = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: node-health\r\n\r\n"
    sock.settimeout(deadline.left("proxy", "the proxy CONNECT"))  # none left: the deadline's, not the proxy's
    try:
        sock.sendall(request.encode())
        head = _read_http_head(sock, deadline)
    except (TimeoutError, EgressError) as exc:
        if isinstance(exc, EgressError) and exc.reason is not EGRESS_TIMEOUT:
            raise
        # Connected, asked, no answer: the proxy itself sits on the request (or drops it), not a firewall on the
        # way to it, which would have stopped the TCP connect.
        raise EgressError(
            EGRESS_PROXY_STALLED,
            f"proxy {proxy} accepted the connection but did not answer CONNECT {authority} within "
            f"{deadline.describe()}",
            phase="proxy",
        ) from None
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1", "replace").strip()
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise EgressError(EGRESS_REFUSED, f"proxy {proxy} sent no HTTP answer to CONNECT {authority}", phase="proxy")
    status = int(parts[1])
    answer = safe_header(status_line[len(parts[0]) + 1 :])
    if status == 407:
        scheme = safe_header(_header(head, b"proxy-authenticate"))
        asks = f" (Proxy-Authenticate: {scheme})" if scheme else ""
        raise EgressError(
            EGRESS_PROXY_AUTH_REQUIRED,
            f"proxy {proxy} answered {answer} to CONNECT {authority}: proxy authentication required{asks}",
            phase="proxy",
            proxy_status=status,
            proxy_authenticate=scheme,
        )
    if status // 100 != 2:
        message = f"proxy {proxy} answered {answer} to CONNECT {authority}"
        raise EgressError(EGRESS_REFUSED, message, phase="proxy", proxy_status=status)


def _header(head: bytes, name: bytes) -> str:
    """The first value of one header of an HTTP answer's head ("" when absent)."""
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().decode("latin-1", "replace")
    return ""


def safe_header(text: str, limit: int = 120) -> str:
    """A proxy's header text as a message may show it: printable characters only, bounded."""
    return "".join(ch if ch.isprintable() else "?" for ch in text[:limit])


_SSL_CONTEXT_LOCK = threading.Lock()


@functools.lru_cache(maxsize=16)
def _cached_ssl_context(ca_file: str | None, ca_file_mtime_ns: int) -> ssl.SSLContext:
    context = ssl.create_default_context()
    if ca_file is not None:
        context.load_verify_locations(cafile=ca_file)
    return context


def _ssl_context(ca_file: str | None, ca_file_mtime_ns: int) -> ssl.SSLContext:
    """Loading the system CA store takes hundreds of ms of CPU with the GIL held: one context per CA file
    version, reused, and built by one thread while the targets' other threads wait for it rather than each
    loading its own copy (twenty targets at once would starve the probe's own deadline)."""
    with _SSL_CONTEXT_LOCK:
        return _cached_ssl_context(ca_file, ca_file_mtime_ns)


def tls_handshake(sock: socket.socket, host: str, ca_file: Path | None, deadline: Deadline) -> ssl.SSLSocket:
    try:
        mtime = ca_file.stat().st_mtime_ns if ca_file is not None else 0
        context = _ssl_context(str(ca_file) if ca_file is not None else None, mtime)
    except (OSError, ssl.SSLError) as exc:
        raise EgressError(EGRESS_TLS_FAILED, f"cannot load ca_file {ca_file}: {exc}", phase="tls") from None
    try:
        sock.settimeout(deadline.left("tls", "the TLS handshake"))
        return context.wrap_socket(sock, server_hostname=host)
    except ssl.SSLCertVerificationError as exc:
        why = exc.verify_message or str(exc.reason)
        message = f"TLS certificate of {host} rejected: {why}"
        raise EgressError(EGRESS_TLS_FAILED, message, phase="tls", tls_error=why) from None
    except ssl.SSLError as exc:
        why = str(exc.reason or exc)
        message = f"TLS handshake with {host} failed: {why}"
        raise EgressError(EGRESS_TLS_FAILED, message, phase="tls", tls_error=why) from None
    except TimeoutError:
        message = f"TLS handshake with {host} did not finish within {deadline.describe()}"
        raise EgressError(EGRESS_TIMEOUT, message, phase="tls") from None
    except (ConnectionResetError, BrokenPipeError) as exc:
        # A firewall filtering by SNI resets the connection at the ClientHello.
        message = f"connection reset during the TLS handshake with {host} ({exc})"
        raise EgressError(EGRESS_REFUSED, message, phase="tls") from None


def http_get(sock: socket.socket, target: EgressTarget, deadline: Deadline) -> tuple[int, str]:
    default_port = 443 if target.tls else 80
    host_header = target.host if target.port == default_port else f"{target.host}:{target.port}"
    conn = http.client.HTTPConnection(target.host, target.port, timeout=deadline.left("http", "the HTTP request"))
    conn.sock = sock
    try:
        conn.putrequest("GET", target.http_path or "/", skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host_header)
        conn.putheader("User-Agent", "node-health")
        conn.putheader("Connection", "close")
        conn.endheaders()
        sock.settimeout(deadline.left("http", "the HTTP answer"))
        response = conn.getresponse()
        return response.status, response.reason
    except TimeoutError:
        message = f"no HTTP answer to GET {target.http_path} within {deadline.describe()}"
        raise EgressError(EGRESS_TIMEOUT, message, phase="http") from None
    except (http.client.HTTPException, OSError) as exc:
        message = f"no valid HTTP answer to GET {target.http_path}: {type(exc).__name__}: {exc}"
        raise EgressError(EGRESS_HTTP_STATUS, message, phase="http") from None
    finally:
        conn.close()


class _Phases:
    """Times the phases of one check into result.phases."""

    def __init__(self, result: EgressResult) -> None:
        self.result = result
        self.mark = time.monotonic()

    def done(self, phase: str) -> None:
        now = time.monotonic()
        self.result.phases[phase] = self.result.phases.get(phase, 0.0) + (now - self.mark)
        self.mark = now


def _open(target: EgressTarget, deadline: Deadline, names: NameLookup, result: EgressResult) -> socket.socket:
    """DNS and TCP connect (to the proxy and through its CONNECT when there is one)."""
    phases = _Phases(result)
    if target.proxy:
        proxy_host, proxy_port = split_host_port(target.proxy[len("http://") :].rstrip("/"), 3128)
        host, port, what = proxy_host, proxy_port, f"proxy {target.proxy}"
    else:
        host, port, what = target.host, target.port, target.host
    addresses = names.addresses(host, deadline)
    phases.done("dns")
    sock, result.address = connect(addresses, port, deadline, what)
    phases.done("connect")
    result.connect_seconds = result.phases["connect"]
    if target.proxy:
        try:
            proxy_connect(sock, target.proxy, target.host, target.port, deadline)
        except BaseException:
            sock.close()
            raise
        phases.done("proxy")
    return sock


def _tls_phase(
    sock: socket.socket, target: EgressTarget, ca_file: Path | None, deadline: Deadline, result: EgressResult
) -> ssl.SSLSocket:
    phases = _Phases(result)
    tls_sock = tls_handshake(sock, target.host, ca_file, deadline)
    result.tls_version = tls_sock.version() or ""
    phases.done("tls")
    return tls_sock


def _http_phase(sock: socket.socket, target: EgressTarget, deadline: Deadline, result: EgressResult) -> None:
    phases = _Phases(result)
    try:
        status, reason = http_get(sock, target, deadline)
    finally:
        phases.done("http")
    result.http_status = status
    if status not in target.expect_status:
        expected = ", ".join(str(s) for s in target.expect_status)
        message = f"GET {target.http_path} answered {status} {reason} (expected {expected})"
        raise EgressError(EGRESS_HTTP_STATUS, message, phase="http")


def check_egress(target: EgressTarget, probe_end: float, names: NameLookup, ca_file: Path | None) -> EgressResult:
    """One target, every phase bounded by min(target.timeout_seconds, what is left until probe_end)."""
    started = time.monotonic()
    deadline = Deadline(min(target.timeout_seconds, probe_end - started), target.timeout_seconds)
    result = EgressResult(target, deadline_seconds=deadline.seconds)
    sock: socket.socket | None = None
    try:
        sock = _open(target, deadline, names, result)
        if target.tls:
            sock = _tls_phase(sock, target, ca_file, deadline, result)
        if target.http_path is not None:
            _http_phase(sock, target, deadline, result)
    except EgressError as exc:
        result.error = exc
    except OSError as exc:
        message = f"{type(exc).__name__}: {exc}"
        result.error = EgressError(EGRESS_REFUSED, message, phase="connect", errno=exc.errno)
    except Exception as exc:  # noqa: BLE001 - a bug or an exotic library error must not take the other targets down
        result.error = EgressError(EGRESS_CHECK_FAILED, f"the check itself failed: {type(exc).__name__}: {exc}")
    finally:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        result.duration = time.monotonic() - started
    return result
