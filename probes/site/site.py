"""The site probe: the config's `site_checks:`, each command on its own interval, all of a run in parallel.

Each due command runs through the host's command runner (`ctx.host.run`: its own process group, stdout and stderr
read under the check's byte cap, the group killed at the check's deadline), in a thread of its own, so a command
that hangs costs its own check its deadline and delays no other one. Exit 0 is ok, 1 warn, 2 fail; any other
status, a signal, the deadline, an output past the cap or a command that cannot start is unknown, with a reason
saying which. The first line of the output (stdout, else stderr) is the message; the Finding escapes it, so no
control character reaches a terminal, the log or /status. A check not due this run reports its last result.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, ClassVar

from probes.base import Check, Finding, Probe, ProbeContext, ProbeOutput, Reason, register
from probes.runtime.commands import CommandResult
from probes.runtime.parallel import run_parallel, seconds_until, wait_end
from probes.site.config import MAX_DEADLINE_SECONDS, MIN_INTERVAL_SECONDS, SiteCheck, SiteChecksConfig
from probes.site.reasons import (
    SITE_FAIL,
    SITE_KILLED,
    SITE_NOT_RUNNABLE,
    SITE_OUTPUT_CAPPED,
    SITE_REASONS,
    SITE_TIMEOUT,
    SITE_UNKNOWN_EXIT,
    SITE_WARN,
)
from probes.text import clip

MESSAGE_CHARS = 300  # of the output's first line
PREFIX = "site."
# A check is due this early before its interval is over, so that a tick a little early (jitter) does not put it
# off by a whole tick; small, so that no schedule (probes.site.interval_seconds) runs it more often than the
# minimum interval allows.
DUE_SLACK_SECONDS = 1.0


def check_name(site: SiteCheck) -> str:
    return PREFIX + site.name


def first_line(result: CommandResult) -> str:
    for text in (result.stdout, result.stderr):
        line = text.lstrip("\n").split("\n", 1)[0].strip()
        if line:
            return clip(line, MESSAGE_CHARS)
    return ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def judge(site: SiteCheck, result: CommandResult) -> Finding:
    """The finding of one run of a site check's command."""
    check = Check(check_name(site), category=site.category)
    line = first_line(result)
    observed: dict[str, Any] = {"exit_code": result.returncode, "duration_seconds": round(result.duration, 3)}
    said = f": {line}" if line else ""
    reason: Reason
    if result.timed_out:
        reason, message = SITE_TIMEOUT, f"no exit within its deadline of {site.timeout_seconds:g}s (killed){said}"
    elif result.truncated:
        reason, message = SITE_OUTPUT_CAPPED, f"wrote more than {site.output_cap_bytes} bytes (killed){said}"
    elif result.not_found or result.permission_denied or result.returncode is None:
        reason, message = SITE_NOT_RUNNABLE, f"cannot run {site.command[0]}: {first_line(result) or 'not started'}"
    elif result.returncode < 0:
        reason, message = SITE_KILLED, f"killed by {_signal_name(-result.returncode)}{said}"
    elif result.returncode == 0:
        return check.ok("", line or "exit 0", observed)
    elif result.returncode == 1:
        reason, message = SITE_WARN, line or "exit 1"
    elif result.returncode == 2:
        reason, message = SITE_FAIL, line or "exit 2"
    else:
        reason, message = SITE_UNKNOWN_EXIT, f"exit {result.returncode} (0 ok, 1 warn, 2 fail){said}"
    hint = site.fix or reason.hint
    return check.report(reason, "", message, observed, hint=hint, required=site.required)


@register
class SiteProbe(Probe):
    name = "site"
    checks: ClassVar[tuple[str, ...]] = ()  # the config's: configure() sets them on the instance
    checks_from_config = True
    reasons = SITE_REASONS
    default_interval = MIN_INTERVAL_SECONDS  # the tick: each check runs on its own interval_seconds
    default_timeout = MAX_DEADLINE_SECONDS + 5  # the longest deadline a check may have, and time to report it
    needs = "the commands the config's site_checks name, on the host (an nsenter prefix reaches its namespaces)"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, SiteCheck, Finding]] = {}

    def configure(self, config: Any) -> None:
        sites = getattr(config, "site_checks", None)
        listed = sites.root if isinstance(sites, SiteChecksConfig) else []
        self.checks = tuple(check_name(site) for site in listed)  # type: ignore[misc]  # per instance: the config's

    def applicable(self, ctx: ProbeContext) -> str | None:
        return None if ctx.settings(SiteChecksConfig).root else "nothing configured in site_checks"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        sites = ctx.settings(SiteChecksConfig).root
        now = time.monotonic()
        with self._lock:
            last = {name: entry for name, entry in self._last.items() if name in {s.name for s in sites}}
        due = [
            site
            for site in sites
            if site.name not in last
            or last[site.name][1] != site  # changed with the config: run it again now
            or now - last[site.name][0] >= site.interval_seconds - DUE_SLACK_SECONDS
        ]
        jobs = [self._job(ctx, site) for site in due]
        results = run_parallel(jobs, seconds_until(wait_end(ctx.deadline)))
        for site, finding in zip(due, results, strict=True):
            if finding is None:  # cannot happen within the probe's deadline; never report a guess
                finding = judge(site, _timed_out(site))
            last[site.name] = (now, site, finding)
        with self._lock:
            self._last = last
        return [last[site.name][2] for site in sites]

    @staticmethod
    def _job(ctx: ProbeContext, site: SiteCheck) -> Any:
        def job() -> Finding:
            result = ctx.host.run(site.command, site.timeout_seconds, max_output_bytes=site.output_cap_bytes)
            return judge(site, result)

        return job


def _timed_out(site: SiteCheck) -> CommandResult:
    return CommandResult(tuple(site.command), None, "", "", site.timeout_seconds, timed_out=True)
