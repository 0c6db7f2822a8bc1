"""Network probes: DNS resolution, egress to whitelisted hosts, NIC links, and the HCCL port range.

- network.dns: dnspython against explicit nameservers or the host's resolv.conf, never getaddrinfo (glibc
  blocks uncancellably for timeout x attempts x nameservers x search domains).
- network.egress: TCP connect, optional HTTP CONNECT proxy, TLS handshake and an HTTP GET, each phase under
  the target's deadline, so a whitelist gap reads as the phase that failed.
- network.links: rtnetlink (pyroute2) in the host's network namespace: admin state, carrier, carrier
  changes over time; names the default-route interface and whether the node has several NICs.
- network.ports: /proc/1/net/{tcp,tcp6,udp,udp6} of the host's namespace for sockets in the HCCL range,
  socket inode → pid → pod, and net.ipv4.ip_local_reserved_ports.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import http.client
import ipaddress
import os
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import dns.exception
import dns.nameserver
import dns.rdatatype
import dns.resolver

from probes.base import Finding, Probe, ProbeContext, ProbeOutput, ProbeParseError, Sample, Status, register
from probes.runtime.addresses import split_host_port

if TYPE_CHECKING:
    from agent.config import DnsConfig, EgressTarget
    from probes.runtime.host import Host

# dnspython overshoots its lifetime by its backoff sleep (measured up to 0.4 s): keep this much in hand.
DNS_LIFETIME_HEADROOM = 0.5
SYSTEMD_RESOLVED_STUB = "127.0.0.53"
MAX_WORKERS = 8

T = TypeVar("T")


def in_kubernetes_pod() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def run_parallel(jobs: Sequence[Callable[[], T]], wait_seconds: float) -> list[T | None]:
    """Run each job in a thread; results in order, None for a job still running after `wait_seconds`.

    Every job bounds itself (socket timeouts, resolver lifetimes); the wait is only a backstop, and the
    pool is not joined so a straggler never holds the probe past its deadline.
    """
    if not jobs:
        return []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(MAX_WORKERS, len(jobs)))
    try:
        futures = [pool.submit(job) for job in jobs]
        concurrent.futures.wait(futures, timeout=wait_seconds)
        return [f.result() if f.done() else None for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


# --- DNS -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolverSetup:
    resolver: dns.resolver.Resolver | None
    source: str  # "network.dns.nameservers" or the resolv.conf path used
    nameservers: tuple[str, ...]
    error: str = ""  # why there is no resolver (no nameserver configured)

    def new_resolver(self) -> dns.resolver.Resolver:
        """A private copy for one thread (resolve_name sets its timeouts; resolvers are not thread-safe)."""
        assert self.resolver is not None
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = list(self.resolver.nameservers)
        return resolver


def resolver_from_nameservers(entries: Sequence[str]) -> dns.resolver.Resolver:
    resolver = dns.resolver.Resolver(configure=False)
    servers: list[dns.nameserver.Nameserver] = []
    for entry in entries:
        address, port = split_host_port(entry, 53)
        servers.append(dns.nameserver.Do53Nameserver(address, port))
    resolver.nameservers = servers
    return resolver


def host_resolv_conf(host: Host) -> Path:
    """The host's resolv.conf, or systemd-resolved's upstream list when the host file names only its stub."""
    path = host.root_path("/etc/resolv.conf")
    with contextlib.suppress(OSError):
        servers = [
            line.split()[1]
            for line in path.read_text().splitlines()
            if line.strip().startswith("nameserver") and len(line.split()) > 1
        ]
        upstream = host.root_path("/run/systemd/resolve/resolv.conf")
        if servers and all(s == SYSTEMD_RESOLVED_STUB for s in servers) and upstream.is_file():
            return upstream
    return path


def make_resolver(host: Host, settings: DnsConfig, resolv_conf: Path | None = None) -> ResolverSetup:
    """A resolver for explicit nameservers, else for `resolv_conf` (default: the host's)."""
    if settings.nameservers:
        resolver = resolver_from_nameservers(settings.nameservers)
        return ResolverSetup(resolver, "network.dns.nameservers", tuple(settings.nameservers))
    path = resolv_conf or host_resolv_conf(host)
    try:
        resolver = dns.resolver.Resolver(filename=str(path))
    except dns.resolver.NoResolverConfiguration as exc:
        return ResolverSetup(None, str(path), (), error=f"no nameserver in {path} ({exc})")
    return ResolverSetup(resolver, str(path), tuple(str(ns) for ns in resolver.nameservers))


@dataclass(frozen=True)
class DnsOutcome:
    name: str
    addresses: tuple[str, ...]
    duration: float
    # "", "nxdomain", "servfail", "refused", "no_nameserver", "timeout", "no_answer", "error"
    kind: str = ""
    detail: str = ""

    @property
    def ok(self) -> bool:
        return not self.kind


def _server_errors(errors: Iterable[Any]) -> tuple[set[str], str]:
    """rcodes and a short text from dnspython's NoNameservers / LifetimeTimeout `errors` list."""
    rcodes: set[str] = set()
    parts: list[str] = []
    for item in errors:
        server, _tcp, port, err = item[0], item[1], item[2], item[3]
        text = err if isinstance(err, str) else (f"{type(err).__name__}: {err}" if str(err) else type(err).__name__)
        if isinstance(err, str):
            rcodes.add(err)
        # str(Do53Nameserver) is "Do53:10.0.0.10@53".
        where = str(server).removeprefix("Do53:").replace("@", ":") if "@" in str(server) else f"{server}:{port}"
        parts.append(f"{where} {text}")
    return rcodes, "; ".join(dict.fromkeys(parts))


def resolve_name(resolver: dns.resolver.Resolver, name: str, timeout: float, lifetime: float) -> DnsOutcome:
    """A then AAAA for one name, bounded by `lifetime` (plus dnspython's overshoot); errors classified."""
    resolver.timeout = min(timeout, lifetime)
    resolver.lifetime = lifetime
    started = time.monotonic()
    deadline = started + lifetime
    addresses: list[str] = []
    try:
        for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            left = deadline - time.monotonic()
            if left <= 0.05:
                raise dns.resolver.LifetimeTimeout(timeout=lifetime, errors=[])
            try:
                answer = resolver.resolve(name, rdtype, search=False, lifetime=left)
            except dns.resolver.NoAnswer:
                continue
            addresses.extend(str(rr) for rr in answer)
            if addresses:
                break
    except dns.resolver.NXDOMAIN:
        return DnsOutcome(name, (), time.monotonic() - started, "nxdomain", "the name does not exist")
    except dns.resolver.NoNameservers as exc:
        rcodes, text = _server_errors(exc.kwargs.get("errors") or [])
        kind = "servfail" if "SERVFAIL" in rcodes else "refused" if "REFUSED" in rcodes else "error"
        return DnsOutcome(name, (), time.monotonic() - started, kind, text or str(exc))
    except dns.exception.Timeout as exc:
        _, text = _server_errors(exc.kwargs.get("errors") or [])
        return DnsOutcome(name, (), time.monotonic() - started, "timeout", text)
    except dns.exception.DNSException as exc:
        return DnsOutcome(name, (), time.monotonic() - started, "error", f"{type(exc).__name__}: {exc}")
    duration = time.monotonic() - started
    if not addresses:
        return DnsOutcome(name, (), duration, "no_answer", "no A or AAAA record")
    return DnsOutcome(name, tuple(addresses), duration)


DNS_HINTS = {
    "nxdomain": "the name does not exist for this resolver: check the spelling, the search domain, and whether "
    "a split-horizon DNS serves this name only inside another network",
    "servfail": "the nameserver failed to resolve (upstream unreachable, DNSSEC failure): check the DNS "
    "server's own upstreams and logs",
    "refused": "the nameserver refuses to answer this client: check its allow-list (allow-query / ACL)",
    "no_nameserver": "no nameserver is configured: fix /etc/resolv.conf on the node (or set network.dns.nameservers)",
    "timeout": "no answer from any nameserver: check the nameserver is up and reachable (firewall, routes) "
    "from this node, e.g. dig @SERVER NAME",
    "no_answer": "the name exists but has no address record: check the DNS zone",
    "error": "check the nameserver with dig @SERVER NAME",
}

DNS_KIND_TEXT = {
    "nxdomain": "NXDOMAIN",
    "servfail": "SERVFAIL",
    "refused": "REFUSED",
    "no_nameserver": "no nameserver",
    "timeout": "timeout",
    "no_answer": "no address record",
    "error": "error",
}


def dns_finding(outcome: DnsOutcome, setup: ResolverSetup, lifetime: float, slow_seconds: float) -> Finding:
    observed: dict[str, Any] = {
        "seconds": round(outcome.duration, 4),
        "nameservers": list(setup.nameservers),
        "source": setup.source,
    }
    if outcome.ok:
        observed["addresses"] = list(outcome.addresses[:8])
        if outcome.duration > slow_seconds:
            return Finding(
                "network.dns",
                outcome.name,
                Status.WARN,
                "DnsSlow",
                f"{outcome.name} resolved in {outcome.duration:.2f} s, above {slow_seconds:g} s",
                "the nameserver answers slowly (overloaded, or its first nameserver times out and the next one "
                "answers): check each nameserver with dig and reorder or fix the slow one",
                observed,
            )
        return Finding(
            "network.dns",
            outcome.name,
            Status.OK,
            "OK",
            f"{outcome.name} → {', '.join(outcome.addresses[:3])} in {outcome.duration * 1000:.0f} ms",
            observed=observed,
        )
    observed["error"] = outcome.kind
    servers = ", ".join(setup.nameservers) or "none"
    if outcome.kind == "timeout":
        message = f"{outcome.name}: timeout, no answer from {servers} within {lifetime:.1f} s"
    elif outcome.kind == "no_nameserver":
        message = f"{outcome.name}: no nameserver: {outcome.detail}"
    elif outcome.kind == "error":
        message = f"{outcome.name}: error from {servers}: {outcome.detail}"
    else:
        message = f"{outcome.name}: {DNS_KIND_TEXT[outcome.kind]} from {servers}"
    if outcome.detail:
        observed["detail"] = outcome.detail
    return Finding("network.dns", outcome.name, Status.FAIL, "DnsFailed", message, DNS_HINTS[outcome.kind], observed)


@register
class DnsProbe(Probe):
    name = "network.dns"
    checks = ("network.dns",)
    default_interval = 60.0
    default_timeout = 10.0
    needs = "UDP/TCP port 53 to the nameservers; the host's /etc/resolv.conf"

    def _jobs(self, ctx: ProbeContext) -> list[tuple[str, ResolverSetup]]:
        settings = ctx.config.network.dns
        host_setup = make_resolver(ctx.host, settings)
        jobs = [(name, host_setup) for name in dict.fromkeys(settings.names)]
        if settings.cluster_names and in_kubernetes_pod():
            # Cluster names resolve through the pod's own resolver (ClusterFirstWithHostNet), not the node's.
            pod_setup = make_resolver(ctx.host, settings, resolv_conf=Path("/etc/resolv.conf"))
            jobs += [(name, pod_setup) for name in dict.fromkeys(settings.cluster_names) if name not in settings.names]
        return jobs

    def applicable(self, ctx: ProbeContext) -> str | None:
        settings = ctx.config.network.dns
        if settings.names or (settings.cluster_names and in_kubernetes_pod()):
            return None
        return "no names configured in network.dns.names"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.config.network.dns
        lifetime = min(settings.lifetime_seconds, ctx.remaining() - DNS_LIFETIME_HEADROOM)
        jobs = self._jobs(ctx)
        out: ProbeOutput = []
        if lifetime < 0.1:
            return [
                Finding(
                    "network.dns",
                    name,
                    Status.UNKNOWN,
                    "DeadlineExceeded",
                    f"{name}: no time left in the probe's deadline to resolve",
                    "raise probes.network.dns.timeout_seconds",
                )
                for name, _ in jobs
            ]

        def job(name: str, setup: ResolverSetup) -> Callable[[], DnsOutcome]:
            def call() -> DnsOutcome:
                if setup.resolver is None:
                    return DnsOutcome(name, (), 0.0, "no_nameserver", setup.error)
                return resolve_name(setup.new_resolver(), name, settings.timeout_seconds, lifetime)

            return call

        outcomes = run_parallel([job(n, s) for n, s in jobs], ctx.remaining())
        for (name, setup), outcome in zip(jobs, outcomes, strict=True):
            if outcome is None:
                out.append(
                    Finding(
                        "network.dns",
                        name,
                        Status.UNKNOWN,
                        "DeadlineExceeded",
                        f"{name}: the lookup did not finish within the probe's deadline",
                        "raise probes.network.dns.timeout_seconds or lower network.dns.lifetime_seconds",
                    )
                )
                continue
            out.append(dns_finding(outcome, setup, lifetime, settings.slow_seconds))
            out.append(
                Sample(
                    "nodehealth_network_dns_lookup_seconds",
                    "Time to resolve the name (also when the lookup failed).",
                    outcome.duration,
                    {"name": name},
                )
            )
        return out


# --- egress ----------------------------------------------------------------------------------------


def parse_hosts_file(text: str) -> dict[str, list[str]]:
    """/etc/hosts → lower-case name → addresses in file order."""
    names: dict[str, list[str]] = {}
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) < 2:
            continue
        try:
            ipaddress.ip_address(fields[0].split("%", 1)[0])
        except ValueError:
            continue
        for name in fields[1:]:
            names.setdefault(name.lower(), []).append(fields[0])
    return names


class EgressError(Exception):
    """One failed phase of an egress check: the reason code and a one-line message."""

    def __init__(self, reason: str, message: str, **observed: Any) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.observed = observed


@dataclass
class EgressResult:
    target: EgressTarget
    connect_seconds: float | None = None
    duration: float = 0.0
    address: str = ""
    tls_version: str = ""
    http_status: int | None = None
    error: EgressError | None = None


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self, phase: str) -> float:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise EgressError("EgressTimeout", f"no time left before {phase} (deadline {self.seconds:g} s)")
        return remaining


def _resolve_for_egress(
    host_name: str,
    dns_setup: Callable[[], ResolverSetup],
    hosts: Callable[[], dict[str, list[str]]],
    deadline: Deadline,
    dns_timeout: float,
) -> list[str]:
    try:
        ipaddress.ip_address(host_name)
        return [host_name]
    except ValueError:
        pass
    from_hosts = hosts().get(host_name.lower())
    if from_hosts:
        return from_hosts
    setup = dns_setup()
    if setup.resolver is None:
        raise EgressError("EgressDnsFailed", f"cannot resolve {host_name}: {setup.error}", dns_error="no_nameserver")
    lifetime = max(0.1, deadline.left("DNS") - DNS_LIFETIME_HEADROOM)
    outcome = resolve_name(setup.new_resolver(), host_name, dns_timeout, lifetime)
    if not outcome.ok:
        raise EgressError(
            "EgressDnsFailed",
            f"cannot resolve {host_name}: {DNS_KIND_TEXT[outcome.kind]} ({outcome.detail or 'no detail'})",
            dns_error=outcome.kind,
            nameservers=list(setup.nameservers),
        )
    # IPv4 first: many egress firewalls are IPv4-only, and A comes before AAAA in resolve_name anyway.
    return list(outcome.addresses)


# connect(2) errors that mean a route or firewall rejected the destination, with what usually causes them.
REJECTED_ERRNOS = {
    errno.EHOSTUNREACH: "no route to host: an unreachable route or an ICMP host-unreachable/prohibited reject",
    errno.ENETUNREACH: "network unreachable: no route to it",
    errno.EACCES: "a local firewall rule or prohibit route",
    errno.EPERM: "a local firewall rule",
    errno.EINVAL: "a blackhole route",
}


def _connect(addresses: Sequence[str], port: int, deadline: Deadline, what: str) -> tuple[socket.socket, str]:
    last: EgressError | None = None
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(deadline.left(f"connecting to {what}"))
            sock.connect((address, port))
            return sock, address
        except TimeoutError:
            sock.close()
            raise EgressError(
                "EgressTimeout",
                f"TCP connect to {what} ({address}:{port}) got no answer within {deadline.seconds:g} s",
                phase="connect",
                address=address,
            ) from None
        except ConnectionRefusedError:
            sock.close()
            last = EgressError(
                "EgressRefused", f"{what} ({address}:{port}) refused the connection", phase="connect", address=address
            )
        except OSError as exc:
            sock.close()
            if exc.errno not in REJECTED_ERRNOS:
                raise
            last = EgressError(
                "EgressRefused",
                f"connection to {what} ({address}:{port}) rejected: {errno.errorcode.get(exc.errno or 0, exc.errno)}, "
                f"{REJECTED_ERRNOS[exc.errno]}",
                phase="connect",
                address=address,
                errno=errno.errorcode.get(exc.errno or 0, exc.errno),
            )
        except EgressError:
            sock.close()
            raise
    assert last is not None
    raise last


def _read_http_head(sock: socket.socket, deadline: Deadline, limit: int = 16384) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        sock.settimeout(deadline.left("the proxy's answer"))
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            break
    return data


def _proxy_connect(sock: socket.socket, proxy: str, host: str, port: int, deadline: Deadline) -> None:
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    request = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: node-health\r\n\r\n"
    try:
        sock.settimeout(deadline.left("the proxy CONNECT"))
        sock.sendall(request.encode())
        head = _read_http_head(sock, deadline)
    except TimeoutError:
        raise EgressError(
            "EgressTimeout", f"proxy {proxy} did not answer CONNECT {authority} in time", phase="proxy"
        ) from None
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1", "replace").strip()
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise EgressError("EgressRefused", f"proxy {proxy} sent no HTTP answer to CONNECT {authority}", phase="proxy")
    status = int(parts[1])
    if status // 100 != 2:
        raise EgressError(
            "EgressRefused",
            f"proxy {proxy} answered {status_line[len(parts[0]) + 1 :]} to CONNECT {authority}",
            phase="proxy",
            proxy_status=status,
        )


@functools.lru_cache(maxsize=16)
def _ssl_context(ca_file: str | None, ca_file_mtime_ns: int) -> ssl.SSLContext:
    """Loading the system CA store takes hundreds of ms: one context per CA file version, reused."""
    context = ssl.create_default_context()
    if ca_file is not None:
        context.load_verify_locations(cafile=ca_file)
    return context


def _tls_handshake(sock: socket.socket, host: str, ca_file: Path | None, deadline: Deadline) -> ssl.SSLSocket:
    try:
        mtime = ca_file.stat().st_mtime_ns if ca_file is not None else 0
        context = _ssl_context(str(ca_file) if ca_file is not None else None, mtime)
    except (OSError, ssl.SSLError) as exc:
        raise EgressError("EgressTlsFailed", f"cannot load ca_file {ca_file}: {exc}", phase="tls") from None
    try:
        sock.settimeout(deadline.left("the TLS handshake"))
        return context.wrap_socket(sock, server_hostname=host)
    except ssl.SSLCertVerificationError as exc:
        raise EgressError(
            "EgressTlsFailed",
            f"TLS certificate of {host} rejected: {exc.verify_message or exc.reason}",
            phase="tls",
            tls_error=exc.verify_message or str(exc.reason),
        ) from None
    except ssl.SSLError as exc:
        raise EgressError(
            "EgressTlsFailed",
            f"TLS handshake with {host} failed: {exc.reason or exc}",
            phase="tls",
            tls_error=str(exc.reason or exc),
        ) from None
    except TimeoutError:
        raise EgressError(
            "EgressTimeout", f"TLS handshake with {host} did not finish within {deadline.seconds:g} s", phase="tls"
        ) from None
    except (ConnectionResetError, BrokenPipeError) as exc:
        # A firewall filtering by SNI resets the connection at the ClientHello.
        raise EgressError(
            "EgressRefused", f"connection reset during the TLS handshake with {host} ({exc})", phase="tls"
        ) from None


def _http_get(sock: socket.socket, target: EgressTarget, deadline: Deadline) -> tuple[int, str]:
    default_port = 443 if target.tls else 80
    host_header = target.host if target.port == default_port else f"{target.host}:{target.port}"
    conn = http.client.HTTPConnection(target.host, target.port, timeout=deadline.left("the HTTP request"))
    conn.sock = sock
    try:
        conn.putrequest("GET", target.http_path or "/", skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host_header)
        conn.putheader("User-Agent", "node-health")
        conn.putheader("Connection", "close")
        conn.endheaders()
        sock.settimeout(deadline.left("the HTTP answer"))
        response = conn.getresponse()
        return response.status, response.reason
    except TimeoutError:
        raise EgressError(
            "EgressTimeout", f"no HTTP answer to GET {target.http_path} within {deadline.seconds:g} s", phase="http"
        ) from None
    except (http.client.HTTPException, OSError) as exc:
        raise EgressError(
            "EgressHttpStatus",
            f"no valid HTTP answer to GET {target.http_path}: {type(exc).__name__}: {exc}",
            phase="http",
        ) from None
    finally:
        conn.close()


def check_egress(
    target: EgressTarget,
    budget: float,
    dns_setup: Callable[[], ResolverSetup],
    hosts: Callable[[], dict[str, list[str]]],
    dns_timeout: float,
    ca_file: Path | None,
) -> EgressResult:
    """One target, every phase bounded by min(target.timeout_seconds, budget)."""
    result = EgressResult(target)
    started = time.monotonic()
    deadline = Deadline(min(target.timeout_seconds, budget))
    sock: socket.socket | None = None
    try:
        if target.proxy:
            proxy_host, proxy_port = split_host_port(target.proxy[len("http://") :].rstrip("/"), 3128)
            addresses = _resolve_for_egress(proxy_host, dns_setup, hosts, deadline, dns_timeout)
            connect_started = time.monotonic()
            sock, result.address = _connect(addresses, proxy_port, deadline, f"proxy {target.proxy}")
            result.connect_seconds = time.monotonic() - connect_started
            _proxy_connect(sock, target.proxy, target.host, target.port, deadline)
        else:
            addresses = _resolve_for_egress(target.host, dns_setup, hosts, deadline, dns_timeout)
            connect_started = time.monotonic()
            sock, result.address = _connect(addresses, target.port, deadline, target.host)
            result.connect_seconds = time.monotonic() - connect_started
        if target.tls:
            sock = _tls_handshake(sock, target.host, ca_file, deadline)
            result.tls_version = sock.version() or ""  # type: ignore[union-attr]
        if target.http_path is not None:
            status, reason = _http_get(sock, target, deadline)
            result.http_status = status
            if status not in target.expect_status:
                raise EgressError(
                    "EgressHttpStatus",
                    f"GET {target.http_path} answered {status} {reason} (expected "
                    f"{', '.join(str(s) for s in target.expect_status)})",
                    phase="http",
                )
    except EgressError as exc:
        result.error = exc
    except OSError as exc:
        result.error = EgressError("EgressRefused", f"{type(exc).__name__}: {exc}", phase="connect", errno=exc.errno)
    except Exception as exc:  # noqa: BLE001 - a bug or an exotic library error must not take the other targets down
        result.error = EgressError("EgressCheckFailed", f"the check itself failed: {type(exc).__name__}: {exc}")
    finally:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        result.duration = time.monotonic() - started
    return result


EGRESS_HINTS = {
    "EgressDnsFailed": "the name does not resolve from this node: check network.dns findings and the node's "
    "resolv.conf; a missing internal DNS record or split-horizon zone",
    "EgressRefused": "the connection is actively refused or rejected: add this host:port to the egress "
    "whitelist / proxy allow-list, or check the service is listening",
    "EgressTimeout": "packets are dropped: the egress firewall or security group silently drops this "
    "destination; add it to the whitelist, or check routes and the proxy",
    "EgressTlsFailed": "TLS failed: an intercepting proxy with its own CA (set ca_file to its CA), a wrong "
    "certificate or hostname, or a protocol mismatch",
    "EgressHttpStatus": "the service answers but not with the expected status: a mirror under maintenance "
    "(503), an authentication wall (401/403), or a wrong http_path",
    "EgressCheckFailed": "report this with the message; the other targets are still checked",
}


def egress_findings(result: EgressResult) -> ProbeOutput:
    target = result.target
    subject = target.subject
    observed: dict[str, Any] = {
        "host": target.host,
        "port": target.port,
        "duration_seconds": round(result.duration, 4),
    }
    if result.address:
        observed["address"] = result.address
    if result.connect_seconds is not None:
        observed["connect_seconds"] = round(result.connect_seconds, 4)
    if target.proxy:
        observed["proxy"] = target.proxy
    if result.tls_version:
        observed["tls_version"] = result.tls_version
    if result.http_status is not None:
        observed["http_status"] = result.http_status
    out: ProbeOutput = []
    labels = {"target": subject}
    if result.connect_seconds is not None:
        out.append(
            Sample(
                "nodehealth_network_egress_connect_seconds",
                "TCP connect time to the egress target (or its proxy).",
                result.connect_seconds,
                labels,
            )
        )
    out.append(
        Sample(
            "nodehealth_network_egress_duration_seconds",
            "Time for the whole egress check: DNS, connect, proxy, TLS and HTTP.",
            result.duration,
            labels,
        )
    )
    if result.error is not None:
        observed.update(result.error.observed)
        out.insert(
            0,
            Finding(
                "network.egress",
                subject,
                Status.UNKNOWN if result.error.reason == "EgressCheckFailed" else Status.FAIL,
                result.error.reason,
                f"{subject}: {result.error.message}",
                EGRESS_HINTS[result.error.reason],
                observed,
            ),
        )
        return out
    steps = ["connect"] + (["TLS " + result.tls_version] if result.tls_version else [])
    if result.http_status is not None:
        steps.append(f"HTTP {result.http_status}")
    out.insert(
        0,
        Finding(
            "network.egress",
            subject,
            Status.OK,
            "OK",
            f"{subject}: {', '.join(steps)} in {result.duration * 1000:.0f} ms",
            observed=observed,
        ),
    )
    return out


@register
class EgressProbe(Probe):
    name = "network.egress"
    checks = ("network.egress",)
    default_interval = 120.0
    default_timeout = 15.0
    needs = "outbound TCP to the configured targets (network.egress)"

    def applicable(self, ctx: ProbeContext) -> str | None:
        return None if ctx.config.network.egress else "no targets configured in network.egress"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        targets = ctx.config.network.egress
        dns_settings = ctx.config.network.dns
        setup_lock = threading.Lock()
        cached: dict[str, Any] = {}

        def dns_setup() -> ResolverSetup:
            with setup_lock:
                if "setup" not in cached:
                    cached["setup"] = make_resolver(ctx.host, dns_settings)
                return cached["setup"]

        def hosts() -> dict[str, list[str]]:
            with setup_lock:
                if "hosts" not in cached:
                    try:
                        cached["hosts"] = parse_hosts_file(ctx.host.root_path("/etc/hosts").read_text())
                    except OSError:
                        cached["hosts"] = {}
                return cached["hosts"]

        budget = max(0.1, ctx.remaining() - 0.2)

        def job(target: EgressTarget) -> Callable[[], EgressResult]:
            ca_file = ctx.host.root_path(target.ca_file) if target.ca_file else None
            return lambda: check_egress(target, budget, dns_setup, hosts, dns_settings.timeout_seconds, ca_file)

        results = run_parallel([job(t) for t in targets], ctx.remaining())
        out: ProbeOutput = []
        for target, result in zip(targets, results, strict=True):
            if result is None:
                out.append(
                    Finding(
                        "network.egress",
                        target.subject,
                        Status.UNKNOWN,
                        "DeadlineExceeded",
                        f"{target.subject}: the check did not finish within the probe's deadline",
                        "raise probes.network.egress.timeout_seconds above the targets' timeout_seconds",
                    )
                )
                continue
            out.extend(egress_findings(result))
        return out


# --- links -----------------------------------------------------------------------------------------

CLONE_NEWNET = 0x40000000
IFF_UP = 0x1
DOWN_OPERSTATES = {"DOWN", "LOWERLAYERDOWN", "NOTPRESENT"}


@dataclass(frozen=True)
class LinkState:
    name: str
    index: int
    admin_up: bool
    operstate: str
    carrier: int | None
    carrier_changes: int | None
    kind: str | None  # IFLA_INFO_KIND: veth, bridge, bond...; None for plain hardware
    parent_device: str | None  # IFLA_PARENT_DEV_NAME (kernel ≥ 5.17): the bus device, e.g. 0000:3b:00.0
    mtu: int | None = None
    global_addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class NetSnapshot:
    links: tuple[LinkState, ...]
    default_route_interfaces: tuple[str, ...]  # IPv4 first, by metric
    netns: str  # what was inspected, for messages


def _link_state(link: Any, addresses: dict[int, list[str]]) -> LinkState:
    return LinkState(
        name=link.get("ifname") or f"if{link['index']}",
        index=link["index"],
        admin_up=bool(link["flags"] & IFF_UP),
        operstate=str(link.get("operstate") or "UNKNOWN").upper(),
        carrier=link.get("carrier"),
        carrier_changes=link.get("carrier_changes"),
        kind=link.get_nested("IFLA_LINKINFO", "IFLA_INFO_KIND"),
        parent_device=link.get("parent_dev_name"),
        mtu=link.get("mtu"),
        global_addresses=tuple(addresses.get(link["index"], ())),
    )


def read_netlink_snapshot(netns_label: str) -> NetSnapshot:
    """Links, global addresses and default routes of the calling process's network namespace."""
    from pyroute2 import IPRoute  # ~20 MiB once imported: only ever imported in the short-lived child

    with IPRoute() as ipr:
        links = ipr.get_links()
        addresses: dict[int, list[str]] = {}
        for addr in ipr.get_addr():
            if addr["scope"] == 0:  # RT_SCOPE_UNIVERSE: a global address, not link-local or host
                addresses.setdefault(addr["index"], []).append(str(addr.get("address")))
        defaults: list[tuple[int, int, int]] = []
        for family_rank, family in enumerate((socket.AF_INET, socket.AF_INET6)):
            for route in ipr.get_default_routes(family=family):
                oif = route.get("oif")
                if oif is not None:
                    defaults.append((family_rank, route.get("priority") or 0, oif))
        by_index = {link["index"]: link.get("ifname") for link in links}
        default_names = tuple(dict.fromkeys(by_index.get(oif) or f"if{oif}" for _, _, oif in sorted(defaults)))
        return NetSnapshot(tuple(_link_state(link, addresses) for link in links), default_names, netns_label)


def _setns(fd: int, nstype: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _in_netns(netns_path: str | None, fn: Callable[..., T], *args: Any) -> T:
    """Runs in a child (ChildCalls): enter the network namespace, then call fn. The child is single-
    threaded, so setns moves all of it; the agent process itself never changes namespace."""
    if netns_path is not None:
        fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(fd, CLONE_NEWNET)
        finally:
            os.close(fd)
    return fn(*args)


def call_in_netns(host: Host, key: str, netns_path: str | None, fn: Callable[..., T], *args: Any, timeout: float) -> T:
    """fn(*args) in a forked child inside the namespace, with a deadline. Raises OSError (TimeoutError when
    the deadline passed)."""
    result = host.child_call(key, _in_netns, netns_path, fn, *args, timeout=timeout)
    if result.ok:
        return result.value
    if result.hung:
        raise TimeoutError(errno.ETIMEDOUT, f"{key}: no answer within {timeout:.1f} s ({result.error})")
    raise OSError(result.errno or errno.EIO, result.error)


def netlink_snapshot(host: Host, netns_path: str | None, netns_label: str, timeout: float) -> NetSnapshot:
    # In a child: pyroute2 costs ~20 MiB once imported, and only ever is in the short-lived child.
    return call_in_netns(host, "netlink-links", netns_path, read_netlink_snapshot, netns_label, timeout=timeout)


def choose_netns(host: Host, configured: str) -> tuple[str | None, str]:
    """(path to enter or None for the agent's own namespace, a label for messages)."""
    if configured:
        return configured, configured
    host_ns = host.proc_path(1, "ns", "net")
    try:
        theirs = os.stat(host_ns)
        ours = os.stat("/proc/self/ns/net")
    except OSError as exc:
        return None, f"agent's own (cannot open {host_ns}: {exc.strerror})"
    if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
        return None, "host (hostNetwork)"
    return str(host_ns), f"host ({host_ns})"


def read_files(directory: str, names: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for name in names:
        with open(os.path.join(directory, name)) as fh:
            out[name] = fh.read()
    return out


def read_host_net_sysctls(host: Host, names: tuple[str, ...], timeout: float) -> dict[str, str]:
    """net.ipv4.<name> as the host's network namespace sees them: network sysctls belong to the namespace
    of the process that reads them, and the agent's pod has its own. Raises OSError."""
    netns_path, _ = choose_netns(host, "")
    directory = str(host.proc_path("sys", "net", "ipv4"))
    return call_in_netns(host, "net-sysctls", netns_path, read_files, directory, names, timeout=timeout)


def is_physical(link: LinkState, sys_class_net: Path) -> bool:
    """A NIC backed by a bus device: IFLA_PARENT_DEV_NAME, or a `device` link in sysfs."""
    if link.parent_device:
        return True
    if link.kind:
        return False
    return (sys_class_net / link.name / "device").exists()


@dataclass
class CarrierHistory:
    """Carrier-change counter samples of one interface, for changes within a sliding window."""

    index: int
    samples: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, now: float, changes: int, window: float) -> int | None:
        """Record a sample; changes within the last `window` seconds, or None before a baseline exists."""
        if self.samples and changes < self.samples[-1][1]:
            self.samples.clear()  # the counter went back: the device was re-created
        self.samples.append((now, changes))
        # Keep the newest sample at or before the window's start as the baseline.
        while len(self.samples) >= 2 and self.samples[1][0] <= now - window:
            self.samples.popleft()
        if len(self.samples) < 2:
            return None
        return changes - self.samples[0][1]


def link_findings(link: LinkState, changes_in_window: int | None, max_changes: float, window: float) -> list[Finding]:
    observed: dict[str, Any] = {
        "operstate": link.operstate.lower(),
        "admin_up": link.admin_up,
        "carrier": link.carrier,
        "carrier_changes": link.carrier_changes,
    }
    if link.mtu is not None:
        observed["mtu"] = link.mtu
    if link.parent_device:
        observed["device"] = link.parent_device
    if changes_in_window is not None:
        observed["carrier_changes_in_window"] = changes_in_window
    if not link.admin_up:
        return [
            Finding(
                "network.links",
                link.name,
                Status.FAIL,
                "LinkDown",
                f"{link.name} is administratively down",
                f"bring it up (ip link set {link.name} up) and check why it was set down (NetworkManager, netplan, "
                "a maintenance script)",
                observed,
            )
        ]
    if link.operstate in DOWN_OPERSTATES or link.carrier == 0:
        return [
            Finding(
                "network.links",
                link.name,
                Status.FAIL,
                "LinkDown",
                f"{link.name} has no carrier (operstate {link.operstate.lower()})",
                "the cable, transceiver or switch port is down: check the link light, `ethtool "
                f"{link.name}`, and the switch port",
                observed,
            )
        ]
    if changes_in_window is not None and changes_in_window > max_changes:
        return [
            Finding(
                "network.links",
                link.name,
                Status.FAIL,
                "LinkFlapping",
                f"{link.name} changed carrier {changes_in_window} times in the last {window / 60:g} min "
                f"(limit {max_changes:g})",
                "a flapping link breaks collective communication: reseat or replace the cable/transceiver, "
                f"check the switch port's error counters and `ethtool -S {link.name}`",
                observed,
            )
        ]
    return [Finding("network.links", link.name, Status.OK, "OK", f"{link.name} up, carrier present", observed=observed)]


@register
class LinksProbe(Probe):
    name = "network.links"
    checks = ("network.links",)
    default_interval = 30.0
    default_timeout = 5.0
    needs = "rtnetlink in the host network namespace (hostNetwork, or CAP_SYS_ADMIN and /proc/1/ns/net)"

    FLAP_WINDOW_SECONDS = 3600.0

    def __init__(self) -> None:
        self._history: dict[tuple[str, str], CarrierHistory] = {}

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.config.network.links
        netns_path, netns_label = choose_netns(ctx.host, settings.netns)
        try:
            snapshot = netlink_snapshot(ctx.host, netns_path, netns_label, ctx.remaining())
        except (OSError, TimeoutError) as exc:
            return [
                Finding(
                    "network.links",
                    "",
                    Status.UNKNOWN,
                    "NetlinkFailed",
                    f"cannot read links in network namespace {netns_label}: {exc}",
                    "the agent needs CAP_SYS_ADMIN to enter /proc/1/ns/net, or hostNetwork: true",
                )
            ]
        by_name = {link.name: link for link in snapshot.links}
        sys_class_net = ctx.host.sys_path("class", "net")
        physical = [link.name for link in snapshot.links if is_physical(link, sys_class_net)]
        wanted = list(settings.interfaces) or physical
        out: ProbeOutput = []
        now = time.monotonic()
        seen: set[tuple[str, str]] = set()
        for name in wanted:
            link = by_name.get(name)
            if link is None:
                out.append(
                    Finding(
                        "network.links",
                        name,
                        Status.FAIL,
                        "LinkDown",
                        f"{name} does not exist",
                        "the interface is missing: driver not loaded, renamed (check `ip link`), or the NIC failed; "
                        "fix network.links.interfaces if the name changed",
                        {"netns": netns_label},
                    )
                )
                continue
            changes_in_window = None
            if link.carrier_changes is not None:
                key = (snapshot.netns, name)
                seen.add(key)
                history = self._history.get(key)
                if history is None or history.index != link.index:
                    history = self._history[key] = CarrierHistory(link.index)
                changes_in_window = history.add(now, link.carrier_changes, self.FLAP_WINDOW_SECONDS)
            out.extend(
                link_findings(link, changes_in_window, settings.max_carrier_changes_per_hour, self.FLAP_WINDOW_SECONDS)
            )
            labels = {"interface": name}
            up = link.admin_up and link.carrier != 0 and link.operstate not in DOWN_OPERSTATES
            out.append(
                Sample("nodehealth_network_link_up", "1 when the link is up with carrier.", 1.0 if up else 0.0, labels)
            )
            if link.carrier_changes is not None:
                out.append(
                    Sample(
                        "nodehealth_network_link_carrier_changes_total",
                        "Carrier changes of the link since the device was created (IFLA_CARRIER_CHANGES).",
                        link.carrier_changes,
                        labels,
                        kind="counter",
                    )
                )
        for key in set(self._history) - seen:
            del self._history[key]
        candidates = [
            link.name
            for link in snapshot.links
            if link.name in physical and link.admin_up and link.carrier != 0 and link.global_addresses
        ]
        default_iface = snapshot.default_route_interfaces[0] if snapshot.default_route_interfaces else None
        out.append(
            Finding(
                "network.links",
                "",
                Status.OK,
                "OK",
                f"default route via {default_iface or 'none'}; "
                f"{len(candidates)} physical NIC(s) up with a global address"
                + (" (multi-NIC: set NCCL_SOCKET_IFNAME / HCCL_SOCKET_IFNAME)" if len(candidates) > 1 else ""),
                observed={
                    "netns": netns_label,
                    "default_route_interface": default_iface,
                    "default_route_interfaces": list(snapshot.default_route_interfaces),
                    "multi_nic": len(candidates) > 1,
                    "physical_interfaces": physical,
                    "socket_ifname_candidates": candidates,
                },
            )
        )
        return out


# --- HCCL port range -------------------------------------------------------------------------------

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
        first, last = (int(p) for p in text.split())
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


@dataclass(frozen=True)
class PortHolder:
    pid: int
    command: str
    owner: str  # CgroupOwner.describe()
    in_pod: bool


def sockets_in_range(entries: Iterable[SocketEntry], first: int, last: int) -> list[SocketEntry]:
    """Sockets that keep a port of the range from being bound: listeners, bound UDP, and connections whose
    *local* port is in the range (an ephemeral-port collision). TIME_WAIT has no owner and goes away."""
    return [
        e
        for e in entries
        if first <= e.local_port <= last and e.state not in ("TIME_WAIT", "NEW_SYN_RECV") and e.inode != 0
    ]


def ports_findings(
    subject: str,
    occupied: Sequence[SocketEntry],
    holders: dict[int, list[PortHolder]],
    scan_error: str,
) -> Finding:
    if not occupied:
        return Finding("network.ports", subject, Status.OK, "OK", f"no socket uses ports {subject}")
    ports = sorted({e.local_port for e in occupied})
    described: list[str] = []
    all_in_pods = True
    observed_holders: list[dict[str, Any]] = []
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
    unique = list(dict.fromkeys(described))
    observed: dict[str, Any] = {
        "ports": ports,
        "pids": sorted({h["pid"] for h in observed_holders}),
        "holders": observed_holders[:20],
        "in_pod": all_in_pods,
    }
    if scan_error:
        observed["scan_error"] = scan_error
    shown = "; ".join(unique[:4]) + (f"; and {len(unique) - 4} more" if len(unique) > 4 else "")
    if all_in_pods:
        return Finding(
            "network.ports",
            subject,
            Status.WARN,
            "PortRangeOccupied",
            f"HCCL ports {compress_ports(ports)} in use by pods: {shown}",
            "a running job holds them (expected while it runs); a second job on this node must use another "
            "HCCL_IF_BASE_PORT / HCCL_HOST_SOCKET_PORT_RANGE",
            observed,
        )
    return Finding(
        "network.ports",
        subject,
        Status.FAIL,
        "PortRangeOccupied",
        f"HCCL ports {compress_ports(ports)} held outside Kubernetes: {shown}",
        "HCCL will fail to bind: stop the leftover process (kill PID) from an earlier job, or move the range "
        "(HCCL_IF_BASE_PORT) and network.ports.base together",
        observed,
    )


@register
class PortsProbe(Probe):
    name = "network.ports"
    checks = ("network.ports",)
    default_interval = 60.0
    default_timeout = 10.0
    needs = "/proc/1/net/{tcp,tcp6,udp,udp6} and /proc/*/fd of the host (hostPID)"

    PROTOCOLS = ("tcp", "tcp6", "udp", "udp6")

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.config.network.ports
        first, last = settings.base, settings.base + settings.count - 1
        subject = f"{first}-{last}"
        entries: list[SocketEntry] = []
        for protocol in self.PROTOCOLS:
            path = ctx.host.proc_path(1, "net", protocol)
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue  # no IPv6 in this kernel
            except OSError as exc:
                return [
                    Finding(
                        "network.ports",
                        subject,
                        Status.UNKNOWN,
                        "ProcNetUnreadable",
                        f"cannot read {path}: {exc.strerror}",
                        "the agent needs hostPID to read the host's /proc/1/net",
                    )
                ]
            entries.extend(parse_proc_net_sockets(text, protocol))
        occupied = sockets_in_range(entries, first, last)
        holders, scan_error = self._holders(ctx, {e.inode for e in occupied})
        out: ProbeOutput = [ports_findings(subject, occupied, holders, scan_error)]
        out.append(
            Sample(
                "nodehealth_network_hccl_ports_in_use",
                "Ports of the HCCL range used by a socket on the host.",
                len({e.local_port for e in occupied}),
            )
        )
        if settings.check_reserved:
            out.extend(self._reserved(ctx, subject, first, last))
        return out

    def _holders(self, ctx: ProbeContext, inodes: set[int]) -> tuple[dict[int, list[PortHolder]], str]:
        if not inodes:
            return {}, ""
        from probes.runtime import procfs as _procfs

        try:
            scan = _procfs.scan_open_files(ctx.host, sockets=inodes, timeout=max(0.1, ctx.remaining() - 0.2))
        except _procfs.ScanError as exc:
            return {}, str(exc)
        holders: dict[int, list[PortHolder]] = {}
        seen: set[tuple[int, int]] = set()
        for match in scan.matches:
            inode = match.key[1]
            if (inode, match.pid) in seen:
                continue
            seen.add((inode, match.pid))
            info = _procfs.process_info(ctx.host.proc, match.pid)
            if info is None:
                continue
            holders.setdefault(inode, []).append(
                PortHolder(match.pid, info.command, info.cgroup.describe(), info.cgroup.in_pod)
            )
        return holders, ""

    def _reserved(self, ctx: ProbeContext, subject: str, first: int, last: int) -> list[Finding]:
        try:
            texts = read_host_net_sysctls(
                ctx.host, ("ip_local_reserved_ports", "ip_local_port_range"), min(2.0, ctx.remaining())
            )
            reserved = parse_port_ranges(texts["ip_local_reserved_ports"])
        except OSError as exc:
            return [
                Finding(
                    "network.ports",
                    "net.ipv4.ip_local_reserved_ports",
                    Status.UNKNOWN,
                    "SysctlUnreadable",
                    f"cannot read net.ipv4.ip_local_reserved_ports: {exc.strerror}",
                    "",
                )
            ]
        ephemeral: list[tuple[int, int]] = []
        with contextlib.suppress(OSError, ValueError, ProbeParseError):
            ephemeral = parse_port_ranges(texts["ip_local_port_range"])
        missing = ports_outside(reserved, first, last)
        exposed = [p for p in missing if not ephemeral or any(a <= p <= b for a, b in ephemeral)]
        observed = {
            "reserved": compress_ports(p for a, b in reserved for p in range(a, min(b, 65535) + 1)),
            "ephemeral_range": f"{ephemeral[0][0]}-{ephemeral[0][1]}" if ephemeral else None,
            "not_reserved": compress_ports(exposed),
        }
        if exposed:
            return [
                Finding(
                    "network.ports",
                    "net.ipv4.ip_local_reserved_ports",
                    Status.WARN,
                    "PortsNotReserved",
                    f"HCCL ports {compress_ports(exposed)} are in the ephemeral range but not in "
                    "net.ipv4.ip_local_reserved_ports: any outgoing connection may take them",
                    f"sysctl -w net.ipv4.ip_local_reserved_ports={subject} (keep existing entries) and persist it "
                    "in /etc/sysctl.d/",
                    observed,
                )
            ]
        return [
            Finding(
                "network.ports",
                "net.ipv4.ip_local_reserved_ports",
                Status.OK,
                "OK",
                f"HCCL ports {subject} reserved or outside the ephemeral range",
                observed=observed,
            )
        ]
