"""network.dns: do the names jobs need resolve, and how fast.

Two resolvers, never mixed up: the names an operator lists (`network.dns.names`) go to the host's resolver
(`network.dns.nameservers`, else the host's resolv.conf under host.root), as the node's own software would
resolve them; the cluster names (`network.dns.cluster_names`, default kubernetes.default.svc) go only to the
pod's resolver with its search list, and only when the agent runs in a pod. A datacenter resolver does not
serve the cluster domain, so asking it for kubernetes.default.svc.cluster.local would fail on every node.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from probes.base import Check, Finding, Probe, ProbeContext, ProbeOutput, Reason, Sample, Status, register
from probes.network.config import DnsConfig, NetworkConfig
from probes.network.reasons import DEADLINE_EXCEEDED
from probes.runtime.parallel import check_end, run_parallel, seconds_until, wait_end
from probes.runtime.resolver import (
    DNS_KIND_TEXT,
    DNS_LIFETIME_HEADROOM,
    MIN_LIFETIME,
    DnsOutcome,
    ResolverSetup,
    in_kubernetes_pod,
    pod_resolver,
    resolve_name,
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
    resolver: str  # "host" or "pod": which resolver the name belongs to


def lookups(ctx: ProbeContext, settings: DnsConfig) -> list[Lookup]:
    jobs: list[Lookup] = []
    if settings.names:
        host_setup = settings.host_resolver().setup(ctx.host.paths)
        jobs += [Lookup(name, host_setup, "host") for name in dict.fromkeys(settings.names)]
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


def deadline_finding(name: str, message: str) -> Finding:
    return DNS.report(DEADLINE_EXCEEDED, name, f"{name}: {message}", {"error": "deadline"})


@register
class DnsProbe(Probe):
    name = "network.dns"
    checks = ("network.dns",)
    reasons = (DNS_FAILED, DNS_SLOW, DEADLINE_EXCEEDED)
    default_interval = 60.0
    default_timeout = 10.0
    needs = "UDP/TCP port 53 to the nameservers; the host's /etc/resolv.conf; in a pod, the pod's own resolv.conf"

    def applicable(self, ctx: ProbeContext) -> str | None:
        settings = ctx.settings(NetworkConfig).dns
        if settings.names or (settings.cluster_names and in_kubernetes_pod()):
            return None
        return "no names configured in network.dns.names (cluster_names are resolved only in a pod)"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(NetworkConfig).dns
        jobs = lookups(ctx, settings)
        end = check_end(ctx.deadline)

        def job(lookup: Lookup) -> Callable[[], tuple[DnsOutcome | None, float]]:
            def call() -> tuple[DnsOutcome | None, float]:
                # Cut when the lookup starts, not when the probe does: a queued lookup gets what is left.
                lifetime = min(settings.lifetime_seconds, seconds_until(end) - DNS_LIFETIME_HEADROOM)
                if lookup.setup.resolver is None:
                    return DnsOutcome(lookup.name, (), 0.0, "no_nameserver", lookup.setup.error), lifetime
                if lifetime < MIN_LIFETIME:
                    return None, lifetime
                resolver = lookup.setup.new_resolver()
                outcome = resolve_name(resolver, lookup.name, settings.timeout_seconds, lifetime, lookup.setup.search)
                return outcome, lifetime

            return call

        started = time.monotonic()
        results = run_parallel([job(lookup) for lookup in jobs], seconds_until(wait_end(ctx.deadline)))
        out: ProbeOutput = []
        for lookup, result in zip(jobs, results, strict=True):
            if result is None:
                waited = time.monotonic() - started
                out.append(deadline_finding(lookup.name, f"the lookup did not finish within {waited:.1f} s"))
                continue
            outcome, lifetime = result
            if outcome is None:
                out.append(deadline_finding(lookup.name, "no time left in the probe's deadline to resolve"))
                continue
            out.append(dns_finding(lookup, outcome, lifetime, settings.slow_seconds))
            out.append(
                Sample(
                    "nodehealth_network_dns_lookup_seconds",
                    "Time to resolve the name (also when the lookup failed).",
                    outcome.duration,
                    {"name": lookup.name},
                )
            )
        return out
