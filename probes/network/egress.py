"""network.egress: can this node reach the hosts its jobs need (mirrors, registries, object stores), and fast.

Targets run in parallel, one thread each; each target's deadline is its timeout_seconds cut to what the
probe run has left when it starts, so a list of unreachable targets still ends in one specific finding per
target (EgressTimeout at the phase that hung) inside the probe's deadline. A target that passes but takes
longer than its slow_ms is a warning: a mirror answering in seconds slows every job that pulls from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from probes.base import Check, Finding, Probe, ProbeContext, ProbeOutput, Reason, Sample, Status, register
from probes.network.config import EgressTarget, NetworkConfig
from probes.network.connect import shown_address
from probes.network.egress_check import EgressResult, NameLookup, check_egress
from probes.network.egress_errors import EGRESS_FAILURES
from probes.network.reasons import DEADLINE_EXCEEDED
from probes.runtime.parallel import check_end, run_parallel, seconds_until, wait_end
from probes.runtime.resolver import ResolverSetup

EGRESS = Check("network.egress")

EGRESS_SLOW = Reason(
    "EgressSlow",
    Status.WARN,
    "the target answered, but the whole check (DNS, connect, proxy, TLS, HTTP) took longer than its slow_ms "
    "(network.egress_slow_ms by default); observed.phases says where the time went",
    "a slow mirror or proxy slows every job that pulls from it: check the server's load, the proxy, or use a "
    "closer mirror; raise slow_ms if this latency is expected",
)


def base_observed(result: EgressResult) -> dict[str, Any]:
    target = result.target
    observed: dict[str, Any] = {
        "host": target.host,
        "port": target.port,
        "duration_seconds": round(result.duration, 4),
        "deadline_seconds": round(result.deadline_seconds, 3),
    }
    if result.address:
        observed["address"] = result.address
    if result.connect_seconds is not None:
        observed["connect_seconds"] = round(result.connect_seconds, 4)
    if result.phases:
        observed["phases"] = {phase: round(seconds, 4) for phase, seconds in result.phases.items()}
    if result.proxy is not None:
        observed["proxy"] = result.proxy.shown  # never the credentials
    if result.lost:
        observed["failed"] = result.lost
    if result.tls_version:
        observed["tls_version"] = result.tls_version
    if result.http_status is not None:
        observed["http_status"] = result.http_status
    return observed


def egress_finding(result: EgressResult, slow_ms: float) -> Finding:
    subject = result.target.subject
    observed = base_observed(result)
    if result.error is not None:
        observed.update(result.error.observed)
        return EGRESS.report(result.error.reason, subject, f"{subject}: {result.error.message}", observed)
    steps = ["connect"] + (["TLS " + result.tls_version] if result.tls_version else [])
    if result.http_status is not None:
        steps.append(f"HTTP {result.http_status}")
    took = f"{subject}: {', '.join(steps)} in {result.duration * 1000:.0f} ms"
    if result.lost:  # a dual-stack name whose first address is dead: the one that answered, and the others
        lost = "; ".join(f"{shown_address(address)} {how}" for address, how in result.lost.items())
        took += f" (through {shown_address(result.address)}; {lost})"
    if result.duration * 1000 > slow_ms:
        observed["slow_ms"] = slow_ms
        slowest = max(result.phases.items(), key=lambda item: item[1], default=None)
        where = f"; slowest phase {slowest[0]} ({slowest[1] * 1000:.0f} ms)" if slowest else ""
        return EGRESS.report(EGRESS_SLOW, subject, f"{took}, slower than slow_ms {slow_ms:g}{where}", observed)
    return EGRESS.ok(subject, took, observed)


def egress_samples(result: EgressResult) -> list[Sample]:
    labels = {"target": result.target.subject}
    out = []
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
    return out


@register
class EgressProbe(Probe):
    name = "network.egress"
    checks = ("network.egress",)
    reasons = (*EGRESS_FAILURES, EGRESS_SLOW, DEADLINE_EXCEEDED)
    default_interval = 120.0
    default_timeout = 15.0
    needs = "outbound TCP to the configured targets (network.egress); the host's /etc/hosts and resolv.conf"
    skip_when_empty = ("egress",)

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(NetworkConfig)
        targets = settings.egress

        resolver = settings.dns.host_resolver()

        def dns_setup() -> ResolverSetup:
            return resolver.setup(ctx.host.paths)

        names = NameLookup(ctx.host.root_path("/etc/hosts"), dns_setup, resolver.try_seconds)
        end = check_end(ctx.deadline)

        def job(target: EgressTarget) -> Callable[[], EgressResult]:
            ca_file = ctx.host.root_path(target.ca_file) if target.ca_file else None
            return lambda: check_egress(target, end, names, ca_file)

        results = run_parallel([job(target) for target in targets], seconds_until(wait_end(ctx.deadline)))
        out: ProbeOutput = []
        for target, result in zip(targets, results, strict=True):
            if result is None:
                message = f"{target.subject}: the check did not finish within the probe's deadline"
                out.append(EGRESS.report(DEADLINE_EXCEEDED, target.subject, message, {"host": target.host}))
                continue
            slow_ms = target.slow_ms if target.slow_ms is not None else settings.egress_slow_ms
            out.append(egress_finding(result, slow_ms))
            out.extend(egress_samples(result))
        return out
