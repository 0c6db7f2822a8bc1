"""Name resolution for every family that resolves a name (network.dns, network.egress, time): the host's
resolver (its resolv.conf under the host root, or nameservers the caller names) or the pod's own resolv.conf,
and /etc/hosts. Everything is passed in as plain values (nameservers, timeouts, whether the search list
applies), so no family reads another's settings.

Never getaddrinfo: glibc blocks uncancellably for timeout x attempts x nameservers x search domains, so a
lookup could outlive the probe's deadline. The lookup (`probes.runtime.dnsquery`) asks the nameservers as glibc
would, with resolv.conf's `timeout:` and `attempts:`, inside a lifetime every caller cuts to what the probe run
has left; dnspython reads resolv.conf and builds and parses the messages.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import dns.exception
import dns.name
import dns.nameserver
import dns.rcode
import dns.rdatatype
import dns.resolver

from probes.runtime.addresses import split_host_port
from probes.runtime.dnsquery import (
    LookupTimeout,
    Nameserver,
    ResolvOptions,
    Tries,
    TrySchedule,
    ask,
    candidates,
    parse_resolv_options,
)
from probes.runtime.paths import HostPaths

# dnspython overshoots its lifetime by its backoff sleep (measured up to 0.4 s): keep this much in hand.
DNS_LIFETIME_HEADROOM = 0.5
# Below this a lookup cannot even get one try out: it is not started.
MIN_LIFETIME = 0.1
SYSTEMD_RESOLVED_STUB = "127.0.0.53"
# How long one try of one nameserver waits, unless the operator says otherwise (network.dns.timeout_seconds).
DEFAULT_TRY_SECONDS = 2.0


def in_kubernetes_pod() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


@dataclass(frozen=True)
class HostResolverSettings:
    """How the node's own resolver is set up for one probe run (the agent sets it on the probe's context).

    `nameservers` ("ip" or "ip:port") replace the host's resolv.conf when given; `source` names the setting
    that lists them, for findings; `try_seconds` is how long one try of one nameserver waits.
    """

    nameservers: tuple[str, ...] = ()
    source: str = ""
    try_seconds: float = DEFAULT_TRY_SECONDS

    def setup(self, paths: HostPaths) -> ResolverSetup:
        return host_resolver(paths, self.nameservers, self.source)


class ConfiguredResolver(dns.resolver.Resolver):
    """dnspython's resolver configuration (nameservers, search list, ndots), with the resolv.conf options that
    set glibc's tries (`timeout:`, `attempts:`), which dnspython does not follow; None for nameservers named by
    a setting rather than a resolv.conf."""

    resolv_options: ResolvOptions | None = None


@dataclass(frozen=True)
class ResolverSetup:
    resolver: dns.resolver.Resolver | None
    source: str  # the setting that lists the nameservers, or the resolv.conf path used
    nameservers: tuple[str, ...]
    error: str = ""  # why there is no resolver (no nameserver configured)
    # Expand relative names with the resolv.conf search list (cluster names: kubernetes.default.svc).
    search: bool = False
    options: ResolvOptions | None = None  # a resolv.conf's timeout and attempts; None: named nameservers

    def new_resolver(self) -> ConfiguredResolver:
        """A private copy for one thread (resolvers are not thread-safe)."""
        if self.resolver is None:
            raise ValueError(f"no resolver: {self.error}")
        resolver = ConfiguredResolver(configure=False)
        resolver.nameservers = list(self.resolver.nameservers)
        resolver.search = list(self.resolver.search)
        resolver.domain = self.resolver.domain
        resolver.ndots = self.resolver.ndots
        resolver.resolv_options = self.options
        return resolver


def resolver_from_nameservers(entries: Sequence[str]) -> dns.resolver.Resolver:
    resolver = dns.resolver.Resolver(configure=False)
    servers: list[dns.nameserver.Nameserver] = []
    for entry in entries:
        address, port = split_host_port(entry, 53)
        servers.append(dns.nameserver.Do53Nameserver(address, port))
    resolver.nameservers = servers
    return resolver


def _resolv_conf_nameservers(path: Path) -> list[str]:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return [
            line.split()[1]
            for line in path.read_text().splitlines()
            if line.strip().startswith("nameserver") and len(line.split()) > 1
        ]
    return []


def host_resolv_conf(paths: HostPaths) -> Path:
    """The host's resolv.conf, or systemd-resolved's upstream list when the host file names only its stub."""
    path = paths.root_path("/etc/resolv.conf")
    servers = _resolv_conf_nameservers(path)
    upstream = paths.root_path("/run/systemd/resolve/resolv.conf")
    if servers and all(s == SYSTEMD_RESOLVED_STUB for s in servers) and upstream.is_file():
        return upstream
    return path


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def host_stubs(paths: HostPaths) -> tuple[str, ...]:
    """The local stub resolvers the host's own /etc/resolv.conf names (loopback addresses: systemd-resolved's
    127.0.0.53, a dnsmasq, unbound or nscd-style cache on 127.0.0.1 or ::1): every lookup on the node goes
    through them, whatever their upstreams say."""
    servers = _resolv_conf_nameservers(paths.root_path("/etc/resolv.conf"))
    return tuple(dict.fromkeys(server for server in servers if is_loopback(server)))


def stub_service(address: str) -> str:
    """What usually listens at a local stub address, for findings' fixes."""
    if address == SYSTEMD_RESOLVED_STUB:
        return "systemd-resolved"
    return "the node's local DNS cache (dnsmasq, unbound, nscd-style or NodeLocal DNSCache)"


def resolver_from_file(path: Path, search: bool = False) -> ResolverSetup:
    try:
        resolver = dns.resolver.Resolver(filename=str(path))
    except dns.resolver.NoResolverConfiguration as exc:
        return ResolverSetup(None, str(path), (), error=f"no nameserver in {path} ({exc})", search=search)
    options = ResolvOptions()
    with contextlib.suppress(OSError, UnicodeDecodeError):
        options = parse_resolv_options(path.read_text())
    servers = tuple(str(ns) for ns in resolver.nameservers)
    return ResolverSetup(resolver, str(path), servers, search=search, options=options)


def host_resolver(paths: HostPaths, nameservers: Sequence[str] = (), source: str = "") -> ResolverSetup:
    """The host's resolver: `nameservers` when given (`source` names the setting that lists them), else the
    host's resolv.conf under the host root."""
    if nameservers:
        return ResolverSetup(resolver_from_nameservers(nameservers), source, tuple(nameservers))
    return resolver_from_file(host_resolv_conf(paths))


def pod_resolver(resolv_conf: str | Path) -> ResolverSetup:
    """The pod's own resolver (cluster DNS under dnsPolicy ClusterFirstWithHostNet) from its resolv.conf (a path
    in the agent's own filesystem), with its search list."""
    return resolver_from_file(Path(resolv_conf), search=True)


@dataclass(frozen=True)
class DnsOutcome:
    name: str
    addresses: tuple[str, ...]
    duration: float
    # "", "nxdomain", "servfail", "refused", "no_nameserver", "timeout", "no_answer", "error"
    kind: str = ""
    detail: str = ""
    resolved_as: str = ""  # the fully qualified name that answered (after search-list expansion)
    # The nameservers that let a try go unanswered, with the seconds waited for them, in the order asked.
    silent: tuple[tuple[str, float], ...] = ()
    answered_by: str = ""  # the nameserver that gave the answer
    schedule: str = ""  # where each try's wait came from: "resolv.conf options timeout:1"

    @property
    def ok(self) -> bool:
        return not self.kind

    def silent_text(self) -> str:
        """`127.0.0.2 (1.0 s)`, for messages: the nameservers that did not answer and how long each cost."""
        return ", ".join(f"{server} ({seconds:.1f} s)" for server, seconds in self.silent)


DNS_KIND_TEXT = {
    "nxdomain": "NXDOMAIN",
    "servfail": "SERVFAIL",
    "refused": "REFUSED",
    "no_nameserver": "no nameserver",
    "timeout": "timeout",
    "no_answer": "no address record",
    "error": "error",
}


def _nameservers(resolver: dns.resolver.Resolver) -> list[Nameserver]:
    out: list[Nameserver] = []
    for server in resolver.nameservers:
        if isinstance(server, dns.nameserver.Do53Nameserver):
            out.append(Nameserver(server.address, server.port))
        elif isinstance(server, str):
            out.append(Nameserver(server, resolver.port))
    return out


def _schedule(resolver: dns.resolver.Resolver, timeout: float) -> TrySchedule:
    """glibc's tries for a resolv.conf (its timeout and attempts); for named nameservers, `timeout` for every
    try until the lifetime ends."""
    options = getattr(resolver, "resolv_options", None)
    if options is not None:
        return TrySchedule.from_options(options, timeout)
    return TrySchedule(timeout, None, False, f"{timeout:g} s per try")


def _also_aaaa(servers: list[Nameserver], qname: dns.name.Name, schedule: TrySchedule, deadline: float) -> list[str]:
    """A name's AAAA records beside the A records it has, for a caller that tries every address (egress, as
    curl does): one try's wait at most, and nothing when it fails; the A records already answer the name."""
    end = min(deadline, time.monotonic() + schedule.wait(0, len(servers)))
    try:
        answer = ask(servers, qname, dns.rdatatype.AAAA, schedule, end, Tries())
    except LookupTimeout:
        return []
    if answer is None:
        return []
    return [str(rr) for rrset in answer.answer if rrset.rdtype == dns.rdatatype.AAAA for rr in rrset]


def _lookup(
    resolver: dns.resolver.Resolver,
    name: str,
    deadline: float,
    search: bool,
    schedule: TrySchedule,
    tries: Tries,
    both_families: bool = False,
) -> tuple[str, list[str], str]:
    """("", addresses, the name that answered), or (kind, [], "") for a name no candidate resolved: A, then
    AAAA when a candidate has no A record (with `both_families`, AAAA after the A records too); raises
    LookupTimeout."""
    servers = _nameservers(resolver)
    if not servers:
        return "no_nameserver", [], ""
    kind = "nxdomain"
    # The search list, else the `domain` line (the C library's fallback); ndots 1 unless resolv.conf says.
    domains = list(resolver.search) or ([resolver.domain] if resolver.domain != dns.name.root else [])
    for qname in candidates(name, domains, resolver.ndots or 1, search):
        for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            answer = ask(servers, qname, rdtype, schedule, deadline, tries)
            if answer is None:
                kind = "servfail" if "SERVFAIL" in tries.errors.values() else "refused"
                if not all(text in ("SERVFAIL", "REFUSED") for text in tries.errors.values()):
                    kind = "error"
                break
            if answer.rcode() == dns.rcode.NXDOMAIN:
                break
            addresses = [str(rr) for rrset in answer.answer if rrset.rdtype == rdtype for rr in rrset]
            if addresses and both_families and rdtype == dns.rdatatype.A:
                addresses += _also_aaaa(servers, qname, schedule, deadline)
            if addresses:
                return "", addresses, qname.to_text(omit_final_dot=True)
            kind = "no_answer"
    return kind, [], ""


def resolve_name(
    resolver: dns.resolver.Resolver,
    name: str,
    timeout: float,
    lifetime: float,
    search: bool = False,
    both_families: bool = False,
) -> DnsOutcome:
    """A then AAAA for one name, bounded by `lifetime`; errors classified, the nameservers that did not
    answer named. A resolver from a resolv.conf asks as glibc does (`probes.runtime.dnsquery`: its timeout
    and attempts, `timeout` standing in for glibc's 5 s where it sets none); named nameservers get `timeout`
    per try until the lifetime ends.

    With `search`, a relative name is expanded with the resolver's search list as the C library does
    (ndots decides whether the name is first tried as is). With `both_families`, a name with A records gets its
    AAAA records too (after them), as getaddrinfo gives curl both.
    """
    schedule = _schedule(resolver, timeout)
    tries = Tries()
    started = time.monotonic()

    def outcome(kind: str = "", detail: str = "", addresses: tuple[str, ...] = (), resolved_as: str = "") -> DnsOutcome:
        silent = tuple(tries.silent.items())
        return DnsOutcome(
            name, addresses, time.monotonic() - started, kind, detail, resolved_as, silent, tries.answered_by,
            schedule.source,
        )  # fmt: skip

    try:
        kind, addresses, resolved_as = _lookup(
            resolver, name, started + lifetime, search, schedule, tries, both_families
        )
    except LookupTimeout:
        return outcome("timeout", "; ".join(f"{server} did not answer" for server in tries.silent) or "no answer")
    except (ValueError, dns.exception.DNSException) as exc:  # a name dnspython cannot encode
        return outcome("error", f"{type(exc).__name__}: {exc}")
    details = {
        "nxdomain": "the name does not exist",
        "no_answer": "no A or AAAA record",
        "no_nameserver": "no nameserver",
    }
    if kind:
        text = details.get(kind) or "; ".join(f"{server} {error}" for server, error in tries.errors.items())
        return outcome(kind, text)
    return outcome(addresses=tuple(addresses), resolved_as=resolved_as)


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


# --- names the way the host's C library finds them (NSS) ------------------------------------------------

NSS_FILES = "files"  # /etc/hosts
NSS_DNS = "dns"
# No nsswitch.conf, or no hosts line in it: /etc/hosts, then DNS (what every distribution ships).
DEFAULT_HOSTS_ORDER = (NSS_FILES, NSS_DNS)
# A hosts file or nsswitch.conf larger than this is read only this far.
MAX_NAME_FILE_BYTES = 1 << 20
# NSS services and what they consult: systemd-resolved's `resolve` reads /etc/hosts itself, then asks DNS.
_NSS_SERVICES = {"files": (NSS_FILES,), "dns": (NSS_DNS,), "resolve": (NSS_FILES, NSS_DNS)}


def parse_nsswitch_hosts(text: str) -> tuple[str, ...] | None:
    """The `hosts:` line of nsswitch.conf → which of /etc/hosts ("files") and DNS ("dns") it consults, in
    order (mdns, myhostname and other services left out; `[NOTFOUND=return]` actions ignored); None when the
    file has no hosts line."""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        key, sep, rest = line.partition(":")
        if not sep or key.strip() != "hosts":
            continue
        order: list[str] = []
        for word in rest.split():
            for service in _NSS_SERVICES.get(word.lower(), ()):
                if service not in order:
                    order.append(service)
        return tuple(order)
    return None


@dataclass(frozen=True)
class HostNames:
    """How the host's C library finds a name (what chronyd, ntpd or timesyncd get from getaddrinfo): the host's
    /etc/hosts and DNS, in the order of its nsswitch.conf."""

    hosts: dict[str, list[str]]
    order: tuple[str, ...]

    def from_hosts_file(self, name: str) -> list[str]:
        return self.hosts.get(name.lower(), []) if NSS_FILES in self.order else []


def _read_bounded(path: Path) -> str | None:
    try:
        with open(path, "rb") as handle:
            return handle.read(MAX_NAME_FILE_BYTES).decode("utf-8", "replace")
    except OSError:
        return None


def host_names(paths: HostPaths) -> HostNames:
    """The host's /etc/hosts and nsswitch.conf hosts order, read under the host root (missing files: no hosts
    entries, the default order)."""
    nsswitch = _read_bounded(paths.root_path("/etc/nsswitch.conf"))
    order = parse_nsswitch_hosts(nsswitch) if nsswitch is not None else None
    hosts = _read_bounded(paths.root_path("/etc/hosts"))
    return HostNames(parse_hosts_file(hosts) if hosts else {}, DEFAULT_HOSTS_ORDER if order is None else order)


def is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
