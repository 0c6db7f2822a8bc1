"""kernel.log: kernel messages from /dev/kmsg (kmsg.py) matched against node-problem-detector style rules
(rules.py, default_rules.py).

Each run drains what the kernel logged since the last one, without blocking, and reports one finding per rule
reason: the problem while it is active, OK otherwise. The reasons it may emit are its own two plus those of
the rules in force: the default rules' are declared, configured rules' are allowed at run time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from probes.base import CATEGORIES, Probe, ProbeContext, ProbeOutput, Reason, Sample, Status, register
from probes.kernel.config import KernelLogConfig, KernelLogRule
from probes.kernel.default_rules import DEFAULT_RULES
from probes.kernel.kmsg import KmsgReader, ReadResult
from probes.kernel.rules import CHECK, LOG, RuleEngine, effective_rules, rule_reasons

KERNEL_LOG_UNAVAILABLE = Reason(
    "KernelLogUnavailable",
    Status.SKIP,
    "the kernel log (kernel_log.path; by default kmsg under host.dev) is missing or cannot be opened",
    "in a pod, /dev/kmsg needs CAP_SYSLOG when kernel.dmesg_restrict=1; check kernel_log.path",
)
KERNEL_LOG_READ_FAILED = Reason(
    "KernelLogReadFailed",
    Status.UNKNOWN,
    "reading the kernel log failed with something other than EAGAIN or EPIPE",
    "the agent reopens the kernel log on its next run; check its permissions if this persists",
)
DEFAULT_RULE_REASONS: tuple[Reason, ...] = rule_reasons([KernelLogRule.model_validate(r) for r in DEFAULT_RULES])


def _counters(engine: RuleEngine, read: int, ignored: int, overwritten: int, dropped: int) -> list[Sample]:
    out = [
        Sample(
            "nodehealth_kernel_log_matches_total",
            "Kernel log lines matched per rule reason since the agent started.",
            engine.matches_total(reason),
            {"reason": reason},
            kind="counter",
        )
        for reason in engine.reasons
    ]
    out.extend(
        Sample(
            "nodehealth_kernel_log_match_timeouts_total",
            "Matches of a reason's rules given up at kernel_log.match_timeout_seconds (taken as no match).",
            engine.match_timeouts(reason),
            {"reason": reason},
            kind="counter",
        )
        for reason in engine.reasons
    )
    out.append(
        Sample(
            "nodehealth_kernel_log_user_task_records_total",
            "Kernel records about a user task (a crash, an audit record) that carry its chosen text: never matched.",
            engine.user_task_records_total,
            kind="counter",
        )
    )
    out.append(
        Sample(
            "nodehealth_kernel_log_records_dropped_total",
            "Kernel records read but never matched: matching fell behind by more than max_records_per_run.",
            dropped,
            kind="counter",
        )
    )
    out.append(
        Sample(
            "nodehealth_kernel_log_records_read_total",
            "Records read from /dev/kmsg (all facilities).",
            read,
            kind="counter",
        )
    )
    out.append(
        Sample(
            "nodehealth_kernel_log_records_ignored_total",
            "Records read from /dev/kmsg and ignored: not from the kernel facility, or malformed.",
            ignored,
            kind="counter",
        )
    )
    out.append(
        Sample(
            "nodehealth_kernel_log_overwritten_total",
            "Times the kernel ring buffer overwrote records before they were read (EPIPE).",
            overwritten,
            kind="counter",
        )
    )
    return out


@register
class KernelLogProbe(Probe):
    name = "kernel.log"
    checks = (CHECK,)
    categories = tuple(CATEGORIES)  # a rule names its own category (default rules: gpu, npu, storage, interconnect)
    reasons = (KERNEL_LOG_UNAVAILABLE, KERNEL_LOG_READ_FAILED, *DEFAULT_RULE_REASONS)
    default_interval = 15.0
    default_timeout = 5.0
    needs = "/dev/kmsg readable (CAP_SYSLOG when kernel.dmesg_restrict=1)"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._reader: KmsgReader | None = None
        self._engine: RuleEngine | None = None
        self._engine_key: tuple[Any, ...] | None = None
        self._clock = clock
        self._backlog: list[str] = []  # read, not matched yet: the last run reached its deadline
        self.records_read_total = 0
        self.records_ignored_total = 0
        self.overwritten_total = 0
        self.records_dropped_total = 0

    def allowed_reasons(self, ctx: ProbeContext) -> Mapping[str, Reason]:
        """The declared reasons, with those of the rules configured now (kernel_log.rules, extra_rules)."""
        allowed = dict(super().allowed_reasons(ctx))
        allowed.update({reason.code: reason for reason in rule_reasons(effective_rules(ctx.settings(KernelLogConfig)))})
        return allowed

    def _path(self, ctx: ProbeContext) -> str:
        configured = ctx.settings(KernelLogConfig).path
        return str(configured) if configured else str(ctx.host.dev_path("kmsg"))

    def _ensure_reader(self, ctx: ProbeContext) -> KmsgReader:
        path = self._path(ctx)
        if self._reader is None or self._reader.path != path:
            if self._reader is not None:
                self._reader.close()
            self._reader = KmsgReader(path)
        self._reader.open()
        return self._reader

    def applicable(self, ctx: ProbeContext) -> str | None:
        path = self._path(ctx)
        try:
            self._ensure_reader(ctx)
        except FileNotFoundError:
            return f"{path} does not exist"
        except OSError as exc:
            return f"cannot open {path}: {exc.strerror or exc} (needs CAP_SYSLOG when kernel.dmesg_restrict=1)"
        return None

    def _ensure_engine(self, settings: KernelLogConfig) -> RuleEngine:
        rules = effective_rules(settings)
        key = (tuple(rules), settings.quiet_period_seconds, settings.max_line_chars, settings.match_timeout_seconds)
        if self._engine is None:
            self._engine = RuleEngine(
                rules,
                settings.quiet_period_seconds,
                self._clock,
                settings.max_line_chars,
                settings.match_timeout_seconds,
            )
        elif key != self._engine_key:
            self._engine.configure(rules, settings.quiet_period_seconds)
            self._engine.max_line_chars = settings.max_line_chars
            self._engine.match_timeout = settings.match_timeout_seconds
        self._engine_key = key
        return self._engine

    def _count(self, result: ReadResult) -> None:
        self.records_read_total += result.read
        self.records_ignored_total += result.ignored
        self.overwritten_total += result.overwritten

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(KernelLogConfig)
        path = self._path(ctx)
        try:
            reader = self._ensure_reader(ctx)
        except OSError as exc:
            return [LOG.report(KERNEL_LOG_UNAVAILABLE, "", f"cannot open {path}: {exc.strerror or exc}")]
        engine = self._ensure_engine(settings)
        try:
            result = reader.read_available(settings.max_records_per_run, deadline=ctx.deadline - 0.2)
        except OSError as exc:
            reader.close()  # reopened (at the end) next run
            return [LOG.report(KERNEL_LOG_READ_FAILED, "", f"reading {path} failed: {exc.strerror or exc}")]
        self._count(result)
        pending = self._backlog + [record.message for record in result.records]
        if len(pending) > settings.max_records_per_run:
            self.records_dropped_total += len(pending) - settings.max_records_per_run
            pending = pending[-settings.max_records_per_run :]
        self._backlog = engine.observe_all(pending, deadline=ctx.deadline - 0.2)
        out: ProbeOutput = list(engine.findings())
        out.extend(
            _counters(
                engine,
                self.records_read_total,
                self.records_ignored_total,
                self.overwritten_total,
                self.records_dropped_total,
            )
        )
        return out
