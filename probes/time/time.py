"""time.sync: is the kernel clock disciplined, and how far is it from the NTP servers.

Server names are resolved as the host's time daemon resolves them, through the C library: the host's
/etc/hosts and DNS in the order of its nsswitch.conf (probes/runtime/resolver.py `host_names`).

Two separate questions, two kinds of findings:
- subject `kernel`: the kernel's discipline state (adjtimex). Unsynchronised is ClockUnsynced with the
  status the operator chose (time.unsynced_status), whatever the servers say: nothing keeps the clock right.
- one subject per NTP server (time.ntp_servers, else the servers of the host's chrony, ntpd or timesyncd):
  the offset, ok below warn_offset_seconds, ClockSkew warn up to fail_offset_seconds, ClockSkew fail from
  there; servers that disagree with each other are NtpServersDisagree (probes/time/offsets.py).
chronyd's tracking data, when it answers, is added to the kernel finding.
"""

from __future__ import annotations

from typing import Any

from probes.base import PARSE_ERROR, Check, Finding, Probe, ProbeContext, ProbeOutput, Reason, Sample, Status, register
from probes.runtime.parallel import run_parallel
from probes.runtime.resolver import HostNames, ResolverSetup, host_names, is_ip_address
from probes.time.chrony import chrony_tracking
from probes.time.config import TimeConfig
from probes.time.kernel_clock import KernelClock, read_kernel_clock
from probes.time.ntp_sources import NtpSources, ntp_sources
from probes.time.offsets import Kind, Verdict, judge_offsets
from probes.time.sntp import NameSources, ServerResult, query_server

SYNC = Check("time.sync")

CLOCK_UNSYNCED = Reason(
    "ClockUnsynced",
    Status.WARN,
    "the kernel clock is not disciplined (STA_UNSYNC / TIME_ERROR): nothing keeps it right; the status is "
    "time.unsynced_status (warn by default); observed has maxerror_seconds, esterror_seconds, state, status, "
    "and chrony when chronyd answers",
    "start or fix the time daemon on the node (systemctl status chronyd / systemd-timesyncd / ntpd; "
    "chronyc tracking, chronyc sources) so the kernel clock is disciplined",
    also=(Status.FAIL,),
)
CLOCK_SKEW = Reason(
    "ClockSkew",
    Status.WARN,
    "the offset to an NTP server reaches warn_offset_seconds (warn) or fail_offset_seconds (fail)",
    "the node's clock is off: check chronyc tracking and chronyc sources, make sure NTP (UDP 123) to the "
    "servers is allowed, then step the clock (chronyc makestep)",
    also=(Status.FAIL,),
)
NTP_SERVERS_DISAGREE = Reason(
    "NtpServersDisagree",
    Status.WARN,
    "the NTP servers disagree with each other by fail_offset_seconds or more: this server is off the majority "
    "(or there is no majority), so its offset does not judge the node",
    "compare the servers (chronyc sources -v, ntpdate -q SERVER) and fix or remove the wrong one; a server "
    "that is itself unsynchronised or stepped is the usual cause",
)
NTP_NO_ANSWER = Reason(
    "NtpNoAnswer",
    Status.UNKNOWN,
    "the server gave no usable answer: timeout, refused, name not resolved (in neither the host's /etc/hosts "
    "nor DNS), kiss-of-death (stratum 0, e.g. RATE, DENY), stratum 16, leap indicator 3, or an origin timestamp "
    "that does not echo our request. Unknown when no server answered (then it blocks /ready unless "
    "time.required is false: nothing vouches for the clock), warn when another server did",
    "check the server is reachable over UDP 123 from this node and is itself synchronised; replace a server "
    "that sends kiss-of-death",
    also=(Status.WARN,),
)
HINT_UNRESOLVED = (
    "the host's time daemon cannot resolve {name} either: add it to the host's /etc/hosts (air-gapped clusters "
    "often name their NTP servers only there) or to DNS, or configure its address (time.ntp_servers, or the "
    "daemon's config)"
)
HINT_DEAD_MEMBER = (
    "{address}, one of the addresses {name} resolves to, gives no usable answer (decommissioned, or UDP 123 "
    "blocked): take it out of {name}'s DNS records (or the hosts file), or fix it; chrony replaces a dead pool "
    "member, but every other client of the name may pick it"
)
ADJTIMEX_FAILED = Reason(
    "AdjtimexFailed",
    Status.UNKNOWN,
    "adjtimex(2) itself failed (e.g. blocked by a seccomp profile)",
    "a seccomp profile may block adjtimex: run the agent with the RuntimeDefault seccomp profile",
)
CHRONY_PARSE_HINT = "report the chronyc version and output; the kernel and SNTP checks still apply"

# Seconds kept after the NTP queries for chronyc and adjtimex.
QUERY_MARGIN = 0.3


def kernel_finding(
    clock: KernelClock,
    sources: NtpSources,
    answered: dict[str, float],
    unsynced_status: str,
    chrony: dict[str, Any] | None = None,
) -> Finding:
    """The kernel's discipline state; the offsets are the servers' findings, only mentioned here."""
    observed = clock.observed()
    if chrony is not None:
        observed["chrony"] = chrony
    observed["ntp_servers_from"] = sources.origin or "none"
    if sources.files:
        observed["ntp_config_files"] = sources.files
    if sources.unreadable:
        observed["ntp_config_unreadable"] = sources.unreadable
    if not clock.unsynced:
        message = (
            f"kernel clock synchronised (max error {clock.maxerror_us / 1000:.1f} ms, "
            f"estimated error {clock.esterror_us / 1000:.1f} ms)"
        )
        return SYNC.ok("kernel", message, observed)
    message = f"kernel clock not synchronised ({clock.unsynced_why}, max error {clock.maxerror_us / 1e6:g} s)"
    if answered:
        closest = min(answered, key=lambda server: abs(answered[server]))
        message += f"; closest NTP server {closest} puts it {abs(answered[closest]):.3f} s off"
    elif sources.servers:
        message += "; no NTP server answered to measure its offset"
    else:
        message += "; no NTP server in time.ntp_servers or in the host's chrony, ntpd or timesyncd config"
    return SYNC.report(CLOCK_UNSYNCED, "kernel", message, observed, status=Status(unsynced_status))


def server_observed(result: ServerResult) -> dict[str, Any]:
    observed: dict[str, Any] = {"source": result.server.source}
    if result.server.directive:
        observed["directive"] = result.server.directive
    if result.members > 1:  # one of a name's addresses: the name, and how many of its members judge the clock
        observed.update({"name": result.server.entry, "members": result.members})
        observed["max_sources"] = result.server.max_sources
    if result.address:
        observed["address"] = result.address
    if result.resolved_from:
        observed["resolved_from"] = result.resolved_from
    answer = result.answer
    if answer is not None:
        observed.update(
            {
                "offset_seconds": round(answer.offset, 6),
                "delay_seconds": round(answer.delay, 6),
                "stratum": answer.stratum,
                "reference_id": answer.reference_id,
            }
        )
    else:
        observed["error"] = result.error
    return observed


def server_finding(result: ServerResult, verdict: Verdict | None, others_answered: bool, required: bool) -> Finding:
    """One server's (or pool member's) finding. No usable answer is unknown (and `required`: it blocks
    readiness) when no server answered, a warning when another one did (the clock is judged by those)."""
    subject = result.subject
    observed = server_observed(result)
    answer = result.answer
    if answer is None or verdict is None:
        message = f"no usable answer from NTP server {subject}: {result.error}"
        hint = HINT_UNRESOLVED.format(name=result.server.host) if result.unresolved else None
        if result.members > 1:
            hint = HINT_DEAD_MEMBER.format(address=result.address, name=result.server.host)
        if others_answered:
            message += "; the clock is judged by the servers that answered"
            return SYNC.report(NTP_NO_ANSWER, subject, message, observed, hint=hint, status=Status.WARN)
        return SYNC.report(NTP_NO_ANSWER, subject, message, observed, hint=hint, required=required)
    magnitude = abs(answer.offset)
    direction = "behind" if answer.offset > 0 else "ahead of"
    text = f"clock {magnitude:.3f} s {direction} {subject} (stratum {answer.stratum})"
    if verdict.kind is Kind.DISAGREE:
        return SYNC.report(NTP_SERVERS_DISAGREE, subject, f"{text}, but {subject} is {verdict.note}", observed)
    if verdict.kind is Kind.SKEW:
        return SYNC.report(CLOCK_SKEW, subject, text, observed, status=verdict.status)
    return SYNC.ok(subject, f"clock within {magnitude * 1000:.1f} ms of {subject} (stratum {answer.stratum})", observed)


def server_samples(result: ServerResult) -> list[Sample]:
    if result.answer is None:
        return []
    labels = {"server": result.subject}
    return [
        Sample(
            "nodehealth_time_offset_seconds",
            "Offset of the local clock from the NTP server (positive: local clock behind).",
            result.answer.offset,
            labels,
        ),
        Sample("nodehealth_time_ntp_delay_seconds", "Round-trip delay to the NTP server.", result.answer.delay, labels),
    ]


def kernel_samples(clock: KernelClock) -> list[Sample]:
    return [
        Sample(
            "nodehealth_time_synced",
            "1 when the kernel clock is synchronised (no STA_UNSYNC).",
            0.0 if clock.unsynced else 1.0,
        ),
        Sample(
            "nodehealth_time_max_error_seconds",
            "Kernel clock maximum error (adjtimex maxerror).",
            clock.maxerror_us / 1e6,
        ),
        Sample(
            "nodehealth_time_estimated_error_seconds",
            "Kernel clock estimated error (adjtimex esterror).",
            clock.esterror_us / 1e6,
        ),
    ]


@register
class TimeProbe(Probe):
    name = "time"
    checks = ("time.sync",)
    reasons = (CLOCK_UNSYNCED, CLOCK_SKEW, NTP_SERVERS_DISAGREE, NTP_NO_ANSWER, ADJTIMEX_FAILED, PARSE_ERROR)
    default_interval = 60.0
    default_timeout = 8.0
    needs = (
        "adjtimex(2) (unprivileged); UDP 123 to the NTP servers; the host's chrony/ntpd/timesyncd config under "
        "host.root when time.ntp_servers is empty; chronyc (optional)"
    )

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(TimeConfig)
        sources = ntp_sources(list(settings.ntp_servers), ctx.host.paths)
        results = self._query(ctx, sources)
        answered = {r.subject: r.answer.offset for r in results if r.answer is not None}
        verdicts = judge_offsets(answered, settings.warn_offset_seconds, settings.fail_offset_seconds)
        # Servers are configured, yet none gave a usable answer: nothing vouches for the clock (time.required).
        required = settings.required and not answered
        out: ProbeOutput = []
        for result in results:
            out.append(server_finding(result, verdicts.get(result.subject), bool(answered), required))
            out.extend(server_samples(result))
        chrony, chrony_error = chrony_tracking(ctx)
        if chrony_error:
            message = f"cannot read chronyc tracking output: {chrony_error}"
            out.append(SYNC.report(PARSE_ERROR, "chrony", message, hint=CHRONY_PARSE_HINT))
        try:
            clock = read_kernel_clock()
        except OSError as exc:
            out.append(SYNC.report(ADJTIMEX_FAILED, "kernel", f"adjtimex(2) failed: {exc.strerror}"))
            return out
        out.append(kernel_finding(clock, sources, answered, settings.unsynced_status, chrony))
        out.extend(kernel_samples(clock))
        return out

    def _query(self, ctx: ProbeContext, sources: NtpSources) -> list[ServerResult]:
        """Every server in parallel, each bounded by ntp_timeout_seconds cut to what the run has left."""
        settings = ctx.settings(TimeConfig)
        host_resolver = ctx.host_resolver  # the node's own resolver, set by the agent from network.dns
        resolver: list[ResolverSetup] = []

        def dns_setup() -> ResolverSetup:
            if not resolver:
                resolver.append(host_resolver.setup(ctx.host.paths))
            return resolver[0]

        named = [server for server in sources.servers if not is_ip_address(server.host)]
        names = host_names(ctx.host.paths) if named else HostNames({}, ())
        if any(not names.from_hosts_file(server.host) for server in named):
            dns_setup()  # once, before the threads
        lookup = NameSources(names, dns_setup, host_resolver.try_seconds)
        budget = max(0.1, min(settings.ntp_timeout_seconds, ctx.remaining() - QUERY_MARGIN))
        jobs = [(lambda server=server: query_server(server, budget, lookup)) for server in sources.servers]
        results = run_parallel(jobs, min(budget + 0.5, ctx.remaining() - QUERY_MARGIN / 3))
        return [
            member
            for server, result in zip(sources.servers, results, strict=True)
            for member in (result or [ServerResult(server, None, "the query did not finish in time")])
        ]
