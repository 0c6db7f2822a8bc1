"""One egress target, phase by phase: name, TCP connect (`probes.network.connect`: every address, raced),
optional HTTP CONNECT through a proxy (`probes.network.proxy`), TLS, HTTP GET.

Every phase runs under the target's deadline, itself cut to what the probe run has left, so a whitelist gap
reads as the phase that failed (EgressTimeout at `connect`, EgressTlsFailed at `tls`) instead of a probe
that overran. Each failure is classified into one reason here.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from probes.network.connect import connect
from probes.network.egress_errors import (
    EGRESS_CHECK_FAILED,
    EGRESS_DNS_FAILED,
    EGRESS_HTTP_STATUS,
    EGRESS_REFUSED,
    EGRESS_TIMEOUT,
    EGRESS_TLS_FAILED,
    Deadline,
    EgressError,
)
from probes.network.proxy import Proxy, auth_refused, parse_proxy, proxy_connect, read_credentials
from probes.runtime.resolver import (
    DNS_KIND_TEXT,
    DNS_LIFETIME_HEADROOM,
    MIN_LIFETIME,
    ResolverSetup,
    is_ip_address,
    parse_hosts_file,
    resolve_name,
)
from probes.text import redact_userinfo

if TYPE_CHECKING:
    from probes.network.config import EgressTarget


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
    # The addresses that lost the connect race to `address`, with how each failed ("no answer" when it was
    # still trying): a dual-stack name whose IPv6 address is dead answers, and says so.
    lost: dict[str, str] = field(default_factory=dict)
    proxy: Proxy | None = None  # parsed, credentials hidden: what findings show as the proxy


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
        outcome = resolve_name(setup.new_resolver(), name, self._dns_timeout, lifetime, both_families=True)
        if not outcome.ok:
            raise EgressError(
                EGRESS_DNS_FAILED,
                f"cannot resolve {name}: {DNS_KIND_TEXT[outcome.kind]} ({outcome.detail or 'no detail'})",
                dns_error=outcome.kind,
                nameservers=list(setup.nameservers),
            )
        # A records first, then AAAA (many egress firewalls are IPv4-only): connect() races them all.
        return list(outcome.addresses)


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


def forwarded(target: EgressTarget) -> bool:
    """Plain HTTP through a proxy goes as curl sends it: `GET http://host/path` to the proxy (forward proxying),
    which proxies allow where they refuse CONNECT to port 80; TLS and bare TCP go through CONNECT."""
    return bool(target.proxy) and not target.tls and target.http_path is not None


def http_get(sock: socket.socket, target: EgressTarget, deadline: Deadline, proxy: Proxy | None) -> tuple[int, str]:
    """GET http_path on the connection (`proxy`: to that forward proxy, in absolute form, with its credentials)."""
    default_port = 443 if target.tls else 80
    host = f"[{target.host}]" if ":" in target.host else target.host
    host_header = host if target.port == default_port else f"{host}:{target.port}"
    path = target.http_path or "/"
    conn = http.client.HTTPConnection(target.host, target.port, timeout=deadline.left("http", "the HTTP request"))
    conn.sock = sock
    try:
        conn.putrequest("GET", f"http://{host_header}{path}" if proxy else path, True, True)
        conn.putheader("Host", host_header)
        conn.putheader("User-Agent", "node-health")
        if proxy is not None and proxy.userinfo:
            conn.putheader("Proxy-Authorization", proxy.authorization())
        conn.putheader("Connection", "close")
        conn.endheaders()
        sock.settimeout(deadline.left("http", "the HTTP answer"))
        response = conn.getresponse()
        if proxy is not None and response.status == 407:
            scheme = response.getheader("Proxy-Authenticate") or ""
            answer = f"{response.status} {response.reason}"
            raise auth_refused(proxy, answer, f"GET http://{host_header}{path}", scheme[:120])
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


def with_credentials(target: EgressTarget, proxy: Proxy) -> Proxy:
    """The proxy with proxy_credentials_file's credentials, read now (a rotated Secret is used at the next run);
    as it is without that file (the URL's userinfo, or none)."""
    if not target.proxy_credentials_file:
        return proxy
    return proxy.with_credentials(read_credentials(Path(target.proxy_credentials_file)), "proxy_credentials_file")


def _open(target: EgressTarget, deadline: Deadline, names: NameLookup, result: EgressResult) -> socket.socket:
    """DNS and TCP connect (to the proxy, and through its CONNECT unless the request is forwarded)."""
    phases = _Phases(result)
    proxy = result.proxy
    if proxy is not None:
        host, port, what = proxy.host, proxy.port, f"proxy {proxy.shown}"
    else:
        host, port, what = target.host, target.port, target.host
    addresses = names.addresses(host, deadline)
    phases.done("dns")
    sock, result.address, result.lost = connect(addresses, port, deadline, what)
    phases.done("connect")
    result.connect_seconds = result.phases["connect"]
    if proxy is not None and not forwarded(target):
        try:
            proxy_connect(sock, proxy, target.host, target.port, deadline)
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
        status, reason = http_get(sock, target, deadline, result.proxy if forwarded(target) else None)
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
        if target.proxy:
            result.proxy = parse_proxy(target.proxy)  # shown in observed, whatever happens next
            result.proxy = with_credentials(target, result.proxy)
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
        message = f"the check itself failed: {type(exc).__name__}: {redact_userinfo(str(exc))}"
        result.error = EgressError(EGRESS_CHECK_FAILED, message)
    finally:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        result.duration = time.monotonic() - started
    return result
