"""network.dns: do the names jobs need resolve, and how fast.

Two resolvers, never mixed up: the names an operator lists (`network.dns.names`) go to the host's resolver
(`network.dns.nameservers`, else the host's resolv.conf under host.root), as the node's own software would
resolve them; the cluster names (`network.dns.cluster_names`, default kubernetes.default.svc) go only to the
pod's resolver with its search list, and only when the agent runs in a pod. A datacenter resolver does not
serve the cluster domain, so asking it for kubernetes.default.svc.cluster.local would fail on every node.

When the host's resolv.conf names a local stub (systemd-resolved's 127.0.0.53, a dnsmasq or nscd-style cache on
127.0.0.1 or ::1), the stub itself is asked too (subject `stub:ADDRESS`), from the host's network namespace
where it listens: every lookup on the node goes through it, so a dead stub fails the node even while the
upstream nameservers answer the agent. Names whose nameservers are loopback addresses are asked from there too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from probes.base import Check, Finding, Probe, ProbeContext, ProbeOutput, Reason, Sample, Status, register
from probes.network.config import DnsConfig, NetworkConfig
from probes.network.netns import call_in_netns, choose_netns
from probes.network.reasons import DEADLINE_EXCEEDED
from probes.runtime.parallel import check_end, run_parallel, seconds_until, wait_end
from probes.runtime.resolver import (
    DNS_KIND_TEXT,
    DNS_LIFETIME_HEADROOM,
    MIN_LIFETIME,
    SYSTEMD_RESOLVED_STUB,
    DnsOutcome,
    ResolverSetup,
    host_stubs,
    in_kubernetes_pod,
    is_loopback,
    pod_resolver,
    resolve_name,
    resolver_from_nameservers,
    stub_service,
)

DNS = Check("network.dns")

DNS_FAILED = Reason(
    "DnsFailed",
    Status.FAIL,
    "the name did not resolve; the message says how: NXDOMAIN (no such name), SERVFAIL (the server failed), "
    "REFUSED, timeout (no answer from any nameserver), no nameserver (none configured) or no address record; "
    "observed.error holds the kind",
    "per kind: check the spelling and zone (NXDOMAIN), the DNS server's upstreams (SERVFAIL), its ACL "
    "(REFUSED), that UDP/TCP 53 reaches it (timeout), /etc/resolv.conf (no nameserver)",
)
DNS_SLOW = Reason(
    "DnsSlow",
    Status.WARN,
    "the name resolved, but slower than network.dns.slow_seconds; the message names each nameserver that did "
    "not answer and what it cost (the wait resolv.conf's options timeout gives it, as the C library does)",
    "a nameserver that does not answer costs every lookup on the node its timeout before the next is asked: "
    "fix it or take it out of resolv.conf (dig @SERVER NAME); a slow answer with no silent nameserver is the "
    "nameserver's own slowness",
)

DNS_STUB_FAILED = Reason(
    "DnsStubFailed",
    Status.FAIL,
    "the local stub resolver the host's /etc/resolv.conf names (127.0.0.53: systemd-resolved; 127.0.0.1 or "
    "::1: a dnsmasq, unbound or nscd-style cache) does not answer, or answers SERVFAIL or REFUSED: every lookup "
    "on the node (image pulls, the host's software) fails, even while the upstream nameservers answer",
    "restart the service behind the stub (systemctl restart systemd-resolved for 127.0.0.53; the local cache, "
    "e.g. systemctl restart dnsmasq, for 127.0.0.1) and check it: systemctl status, resolvectl status, "
    "dig @STUB NAME",
)
DNS_STUB_UNCHECKED = Reason(
    "DnsStubUnchecked",
    Status.UNKNOWN,
    "the local stub resolver listens in the host's network namespace, which the agent could not enter (no "
    "hostNetwork, no CAP_SYS_ADMIN or no hostPID), so it was not asked",
    "run the agent with hostPID and CAP_SYS_ADMIN (to enter /proc/1/ns/net) or with hostNetwork",
)
# How a stub's lookup is judged: the stub answered (an answer, NXDOMAIN, no record) or it failed.
STUB_ANSWERED = ("", "nxdomain", "no_answer")

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
CLUSTER_HINT = (
    "cluster names resolve through the pod's own resolver: run the DaemonSet with dnsPolicy: "
    "ClusterFirstWithHostNet (a hostNetwork pod under ClusterFirst gets the node's resolver, which does not "
    "serve the cluster domain) and check CoreDNS (kubectl -n kube-system get pods -l k8s-app=kube-dns)"
)


@dataclass(frozen=True)
class Lookup:
    name: str
    setup: ResolverSetup
    resolver: str  # "host", "pod", or "stub" (the host's local stub resolver): which resolver the name is for
    subject: str = ""  # the finding's subject; "": the name
    # Ask from the host's network namespace: a loopback nameserver listens there, not in the agent's pod.
    host_netns: bool = False


def _local(setup: ResolverSetup) -> bool:
    """Every nameserver a loopback address (a resolv.conf naming only a local cache)."""
    return bool(setup.nameservers) and all(is_loopback(server) for server in setup.nameservers)


def stub_lookups(ctx: ProbeContext, settings: DnsConfig, host_setup: ResolverSetup) -> list[Lookup]:
    """The host's local stubs, each asked for the first listed name with the host resolv.conf's tries; none
    when network.dns.nameservers replaces the host's resolv.conf."""
    if settings.nameservers or not settings.names:
        return []
    out = []
    for stub in host_stubs(ctx.host.paths):
        setup = ResolverSetup(
            resolver_from_nameservers([stub]), "/etc/resolv.conf", (stub,), options=host_setup.options
        )
        out.append(Lookup(settings.names[0], setup, "stub", f"stub:{stub}", host_netns=True))
    return out


def lookups(ctx: ProbeContext, settings: DnsConfig) -> list[Lookup]:
    jobs: list[Lookup] = []
    if settings.names:
        host_setup = settings.host_resolver().setup(ctx.host.paths)
        local = not settings.nameservers and _local(host_setup)  # the host's resolv.conf names a local cache
        jobs += [Lookup(name, host_setup, "host", host_netns=local) for name in dict.fromkeys(settings.names)]
        jobs += stub_lookups(ctx, settings, host_setup)
    if settings.cluster_names and in_kubernetes_pod():
        pod_setup = pod_resolver(settings.cluster_resolv_conf)
        cluster_only = [name for name in dict.fromkeys(settings.cluster_names) if name not in settings.names]
        jobs += [Lookup(name, pod_setup, "pod") for name in cluster_only]
    return jobs


def dns_finding(lookup: Lookup, outcome: DnsOutcome, lifetime: float, slow_seconds: float) -> Finding:
    setup = lookup.setup
    observed: dict[str, Any] = {
        "seconds": round(outcome.duration, 4),
        "nameservers": list(setup.nameservers),
        "source": setup.source,
        "resolver": lookup.resolver,
    }
    if outcome.schedule:
        observed["tries"] = outcome.schedule
    if outcome.silent:
        observed["silent_nameservers"] = [server for server, _ in outcome.silent]
    if outcome.ok:
        observed["addresses"] = list(outcome.addresses[:8])
        observed["answered_by"] = outcome.answered_by
        if outcome.resolved_as and outcome.resolved_as != outcome.name:
            observed["resolved_as"] = outcome.resolved_as
        if outcome.duration > slow_seconds:
            return slow_finding(lookup, outcome, slow_seconds, observed)
        shown = ", ".join(outcome.addresses[:3])
        return DNS.ok(outcome.name, f"{outcome.name} → {shown} in {outcome.duration * 1000:.0f} ms", observed)
    observed["error"] = outcome.kind
    if outcome.detail:
        observed["detail"] = outcome.detail
    servers = ", ".join(setup.nameservers) or "none"
    if outcome.kind == "timeout":
        silent = outcome.silent_text() or servers
        message = f"{outcome.name}: timeout, no answer from {silent} ({outcome.schedule}) in {outcome.duration:.1f} s"
        if outcome.duration < lifetime - 0.5:
            message += " (the tries resolv.conf's options allow)"
    elif outcome.kind == "no_nameserver":
        message = f"{outcome.name}: no nameserver: {outcome.detail}"
    elif outcome.kind == "error":
        message = f"{outcome.name}: error from {servers}: {outcome.detail}"
    else:
        message = f"{outcome.name}: {DNS_KIND_TEXT[outcome.kind]} from {servers}"
    if lookup.resolver == "pod":
        message += f" (the pod's resolver, {setup.source})"
        hint = f"{DNS_HINTS[outcome.kind]}; {CLUSTER_HINT}"
    else:
        hint = DNS_HINTS[outcome.kind]
    if lookup.host_netns and outcome.kind not in STUB_ANSWERED:  # the host's resolv.conf names only local caches
        services = ", ".join(f"{stub_service(server)} at {server}" for server in setup.nameservers)
        hint = f"{hint}; the node resolves through {services} only: check that service (see the stub: finding)"
    return DNS.report(DNS_FAILED, outcome.name, message, observed, hint=hint)


def slow_finding(lookup: Lookup, outcome: DnsOutcome, slow_seconds: float, observed: dict[str, Any]) -> Finding:
    """Resolved, slowly: the nameservers that let their tries go unanswered are the usual cause, named."""
    message = f"{outcome.name} resolved in {outcome.duration:.2f} s, above {slow_seconds:g} s"
    if not outcome.silent:
        return DNS.report(DNS_SLOW, outcome.name, f"{message}; every nameserver asked answered", observed)
    message += f": {outcome.silent_text()} did not answer ({outcome.schedule}), {outcome.answered_by} answered"
    first = outcome.silent[0][0]
    hint = (
        f"nameserver {first} does not answer: every lookup on this node waits for it before asking the next; fix "
        f"it or take it out of {lookup.setup.source or 'resolv.conf'} (dig @{first} {outcome.name})"
    )
    return DNS.report(DNS_SLOW, outcome.name, message, observed, hint=hint)


def stub_finding(lookup: Lookup, outcome: DnsOutcome) -> Finding:
    """The host's local stub: ok when it answered (an address, NXDOMAIN or no record: it is alive), else
    DnsStubFailed with a fix naming the service behind it."""
    stub = lookup.setup.nameservers[0]
    service = stub_service(stub)
    observed: dict[str, Any] = {"stub": stub, "service": service, "asked": outcome.name}
    observed["seconds"] = round(outcome.duration, 4)
    if outcome.kind in STUB_ANSWERED:
        said = ", ".join(outcome.addresses[:3]) if outcome.ok else DNS_KIND_TEXT[outcome.kind]
        message = f"local stub resolver {stub} ({service}) answers: {outcome.name} → {said}"
        return DNS.ok(lookup.subject, message, observed)
    observed["error"] = outcome.kind
    how = "does not answer" if outcome.kind == "timeout" else f"answers {DNS_KIND_TEXT[outcome.kind]}"
    message = (
        f"local stub resolver {stub} ({service}), which the host's /etc/resolv.conf names, {how} for "
        f"{outcome.name} in {outcome.duration:.1f} s: every lookup on the node through it fails"
    )
    if outcome.detail:
        observed["detail"] = outcome.detail
    if stub == SYSTEMD_RESOLVED_STUB:
        hint = (
            "systemd-resolved's stub listener does not answer: restart it (systemctl restart systemd-resolved), "
            f"then check systemctl status systemd-resolved, resolvectl status and dig @{stub} {outcome.name}"
        )
    else:
        hint = (
            f"{service} at {stub} does not answer: restart it (e.g. systemctl restart dnsmasq, or the cache this "
            f"node runs) and check dig @{stub} {outcome.name}; or take {stub} out of the host's /etc/resolv.conf"
        )
    return DNS.report(DNS_STUB_FAILED, lookup.subject, message, observed, hint=hint)


def deadline_finding(name: str, message: str) -> Finding:
    return DNS.report(DEADLINE_EXCEEDED, name, f"{name}: {message}", {"error": "deadline"})


def _resolve(lookup: Lookup, timeout: float, lifetime: float) -> DnsOutcome:
    return resolve_name(lookup.setup.new_resolver(), lookup.name, timeout, lifetime, lookup.setup.search)


def resolve_lookup(ctx: ProbeContext, lookup: Lookup, timeout: float, lifetime: float) -> DnsOutcome | Finding:
    """The lookup's outcome, asked from the host's network namespace when it must be (a forked child enters
    it; the agent never does); a DnsStubUnchecked finding when a stub cannot be reached there."""
    netns_path, label = choose_netns(ctx.host, "") if lookup.host_netns else (None, "")
    if netns_path is None:
        if lookup.resolver == "stub" and label.startswith("agent's own"):
            message = f"local stub resolver {lookup.setup.nameservers[0]} not asked: {label}"
            return DNS.report(DNS_STUB_UNCHECKED, lookup.subject, message, {"netns": label})
        return _resolve(lookup, timeout, lifetime)
    try:
        key = f"dns-{lookup.resolver}-{lookup.subject or lookup.name}"
        return call_in_netns(ctx.host, key, netns_path, _resolve, lookup, timeout, lifetime, timeout=lifetime + 1.0)
    except OSError as exc:
        if lookup.resolver == "stub":
            message = f"local stub resolver {lookup.setup.nameservers[0]} not asked: {label}: {exc}"
            return DNS.report(DNS_STUB_UNCHECKED, lookup.subject, message, {"netns": label})
        return DnsOutcome(lookup.name, (), 0.0, "error", f"cannot ask from the host's network namespace: {exc}")


@register
class DnsProbe(Probe):
    name = "network.dns"
    checks = ("network.dns",)
    reasons = (DNS_FAILED, DNS_SLOW, DNS_STUB_FAILED, DNS_STUB_UNCHECKED, DEADLINE_EXCEEDED)
    default_interval = 60.0
    default_timeout = 10.0
    needs = (
        "UDP/TCP port 53 to the nameservers; the host's /etc/resolv.conf; in a pod, the pod's own resolv.conf; "
        "to ask a local stub (127.0.0.53), the host's network namespace (hostNetwork, or hostPID and "
        "CAP_SYS_ADMIN)"
    )

    def applicable(self, ctx: ProbeContext) -> str | None:
        settings = ctx.settings(NetworkConfig).dns
        if settings.names or (settings.cluster_names and in_kubernetes_pod()):
            return None
        return "no names configured in network.dns.names (cluster_names are resolved only in a pod)"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(NetworkConfig).dns
        jobs = lookups(ctx, settings)
        end = check_end(ctx.deadline)

        def job(lookup: Lookup) -> Callable[[], tuple[DnsOutcome | Finding | None, float]]:
            def call() -> tuple[DnsOutcome | Finding | None, float]:
                # Cut when the lookup starts, not when the probe does: a queued lookup gets what is left.
                lifetime = min(settings.lifetime_seconds, seconds_until(end) - DNS_LIFETIME_HEADROOM)
                if lookup.setup.resolver is None:
                    return DnsOutcome(lookup.name, (), 0.0, "no_nameserver", lookup.setup.error), lifetime
                if lifetime < MIN_LIFETIME:
                    return None, lifetime
                return resolve_lookup(ctx, lookup, settings.timeout_seconds, lifetime), lifetime

            return call

        started = time.monotonic()
        results = run_parallel([job(lookup) for lookup in jobs], seconds_until(wait_end(ctx.deadline)))
        out: ProbeOutput = []
        for lookup, result in zip(jobs, results, strict=True):
            subject = lookup.subject or lookup.name
            if result is None:
                waited = time.monotonic() - started
                out.append(deadline_finding(subject, f"the lookup did not finish within {waited:.1f} s"))
                continue
            outcome, lifetime = result
            if outcome is None:
                out.append(deadline_finding(subject, "no time left in the probe's deadline to resolve"))
                continue
            if isinstance(outcome, Finding):
                out.append(outcome)
                continue
            if lookup.resolver == "stub":
                out.append(stub_finding(lookup, outcome))
            else:
                out.append(dns_finding(lookup, outcome, lifetime, settings.slow_seconds))
            out.append(
                Sample(
                    "nodehealth_network_dns_lookup_seconds",
                    "Time to resolve the name (also when the lookup failed).",
                    outcome.duration,
                    {"name": subject},
                )
            )
        return out
