"""The kernel.log rule engine: node-problem-detector style rules over kernel messages.

A rule raises its reason after `count` matches within `window_seconds` and the problem clears after a quiet
period without a match (or at once on the rule's recover_pattern). Every reason a rule can raise is a
declared Reason of the probe (`rule_reasons`), built from the rules in force.

Matching is bounded: a rule sees at most `max_line_chars` of a message, and each match runs with a time limit
in the `regex` module, which releases the GIL while it matches, so a pattern that backtracks without end on a
crafted line costs its limit and never freezes the agent's other threads (Python's `re` holds the GIL and
cannot be interrupted). Records about a user task are never matched (`is_user_task_record`), and the task name
(comm) inside the records that lead with or embed one is replaced before any rule reads them
(`neutralise_task_names`).
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import regex

from probes.base import Check, Finding, Reason, Status
from probes.kernel.config import KernelLogConfig, KernelLogRule

CHECK = "kernel.log"
LOG = Check(CHECK)
DEFAULT_HINT = "read the kernel log around this line (dmesg -T)"

# Records the kernel writes about a user task, whose text that task chooses: its name (the first 15 bytes of
# the file it runs, or anything it sets with prctl) and, after " in ", the whole name of the file it crashed
# in. From the format strings of arch/x86/mm/fault.c (show_signal_msg), arch/x86/kernel/traps.c,
# arch/arm64/kernel/traps.c (arm64_show_signal), kernel/signal.c (print_fatal_signal) and kernel/audit.c (audit
# records printed to the log when no audit daemon runs). No rule sees them: any pod could raise or clear a fault.
USER_TASK_RECORD = re.compile(
    r"^traps: "  # traps: NAME[pid] trap invalid opcode / general protection fault ... in FILE[...]
    r"|^audit: "  # audit: type=1701 ... comm="NAME" exe="PATH"
    r"|^potentially unexpected fatal signal "
    r"|\[\d+\]: segfault at "  # NAME[pid]: segfault at ADDR ... in FILE[...]
    r"|\[\d+\]:? (?:unhandled |general protection |trap )"  # arm64, and older x86 spellings
    r"|\[[0-9a-f]+(?:,[0-9a-f]+)?\+[0-9a-f]+\]"  # print_vma_addr: " in FILE[offset,base+size]"
)


# A task's name (comm) is at most 15 bytes; the kernel escapes a byte that is not printable ASCII as \xHH, so it
# is logged in at most 60 characters, the window each shape below gives it.
_COMM = r"(?P<comm>.{1,60})"
# Records whose text leads with or embeds a task's name, from their format strings; the name is replaced by
# TASK_NAME before any rule (or recover pattern) reads the record, so a name spelled like a driver's fault line
# (`XFS (x): error`, set with prctl(PR_SET_NAME)) never matches through it. The name is matched greedily up to
# the kernel's own text after it: the last such text within the window is the real one, whatever the name
# spells. A record that leads with a name is known by the kernel's text after it, and that text is longer than
# 15 bytes, so no name can spell it: a driver's fault line that embeds a name early (NVRM's `name=%s`) is never
# taken for one. The record stays readable (`? invoked oom-killer: ...`), and the rules about the record itself
# (OomKill, HungTask) still match it.
TASK_NAME_RECORDS = tuple(
    re.compile(pattern)
    for pattern in (
        # mm/oom_kill.c dump_header: "%s invoked oom-killer: gfp_mask=%#x(%pGg), order=%d, oom_score_adj=%hd"
        rf"^{_COMM} invoked oom-killer: ",
        # mm/page_alloc.c warn_alloc: "%s: %pV, mode:...", %pV "page allocation failure: order:%u" or mm/vmalloc.c
        # "vmalloc error: size %lu, ..."
        rf"^{_COMM}: (?:page allocation failure: order:|vmalloc error: size )",
        # pr_warn_once/pr_info task lines: "%s (%d): drop_caches: %d" (fs/drop_caches.c), "%s (%d): /proc/%d/oom_adj
        # is deprecated" (fs/proc/base.c), "%s (%d): Using mlock ulimits for SHM_HUGETLB is deprecated"
        # (mm/hugetlb), "%s (%d) used greatest stack depth: %lu bytes left" (kernel/exit.c), and arm64's "\"%s\"
        # (%ld) uses deprecated %s instruction at 0x%llx" (armv8_deprecated.c)
        rf'^"?{_COMM}"? \(\d+\)(?:: drop_caches: \d|: /proc/\d+/oom_adj is deprecated'
        r"|: Using mlock ulimits for SHM_HUGETLB is deprecated| used greatest stack depth: \d"
        r"| uses deprecated .{1,40} instruction)",
        # kernel/hung_task.c: "INFO: task %s:%d blocked for more than %ld seconds."
        rf"^INFO: task {_COMM}:\d+ blocked for more than ",
        # mm/oom_kill.c __oom_kill_process: "%s: Killed process %d (%s) total-vm:...", and the reaper's line
        rf"^(?:Out of memory|Memory cgroup out of memory)(?: \([^)]*\))?: Kill(?:ed)? process \d+ \({_COMM}\) ",
        rf"^oom_reaper: reaped process \d+ \({_COMM}\), ",
        # mm/oom_kill.c dump_oom_victim: "oom-kill:constraint=...,task=%s,pid=%d,uid=%d" (cgroup paths before it)
        r"^oom-kill:(?P<comm>.*)$",
        # mm/oom_kill.c dump_task rows: "[  pid  ]   uid  tgid total_vm      rss ... oom_score_adj name"
        rf"^\[ *\d+\](?: +-?\d+)+ {_COMM}$",
        # lib/dump_stack.c: "CPU: %d UID: %u PID: %d Comm: %.20s %s%s %s %.*s"
        rf"^CPU: \d+ (?:UID: \d+ )?PID: \d+ Comm: {_COMM} (?:Not tainted|Tainted)",
        # kernel/watchdog.c: "BUG: soft lockup - CPU#%d stuck for %us! [%s:%d]"
        rf"^(?:watchdog: )?BUG: soft lockup - CPU#\d+ stuck for \d+s! \[{_COMM}:\d+\]$",
    )
)
TASK_NAME = "?"


def neutralise_task_names(message: str) -> tuple[str, bool]:
    """`message` with the task name of a record that leads with or embeds one replaced by TASK_NAME (see
    TASK_NAME_RECORDS), and whether it was one."""
    for shape in TASK_NAME_RECORDS:
        found = shape.search(message)
        if found is not None:
            start, end = found.span("comm")
            return message[:start] + TASK_NAME + message[end:], True
    return message, False


def is_user_task_record(message: str) -> bool:
    """Whether the kernel wrote this record about a user task, with text the task chose (see USER_TASK_RECORD)."""
    return USER_TASK_RECORD.search(message) is not None


def effective_rules(settings: KernelLogConfig) -> list[KernelLogRule]:
    """The rules in force: `rules` (the defaults unless replaced) plus `extra_rules`."""
    return list(settings.rules) + list(settings.extra_rules)


def _base_status(spec: KernelLogRule) -> Status:
    return Status.FAIL if spec.type == "permanent" or spec.status == "fail" else Status.WARN


def rule_reasons(rules: Sequence[KernelLogRule]) -> tuple[Reason, ...]:
    """One Reason per rule reason: the first rule of a reason sets its status, meaning and hint (as the engine
    does); a `fail_on` on any rule of that reason adds fail."""
    by_reason: dict[str, list[KernelLogRule]] = {}
    for rule in rules:
        by_reason.setdefault(rule.reason, []).append(rule)
    out = []
    for code, specs in by_reason.items():
        first = specs[0]
        status = _base_status(first)
        also = (Status.FAIL,) if status == Status.WARN and any(spec.fail_on for spec in specs) else ()
        meaning = first.meaning or (
            f"{first.count} kernel message(s) matching {first.pattern!r} within {first.window_seconds:g}s"
        )
        out.append(Reason(code, status, meaning, first.hint or DEFAULT_HINT, also))
    return tuple(out)


@dataclass
class _RuleState:
    """What the engine remembers of one reason between runs."""

    match_times: deque[float]
    active: bool = False
    fail: bool = False  # a fail_on value was seen while active
    last_match_at: float | None = None
    last_line: str = ""
    matches_total: int = 0
    matches_while_active: int = 0
    match_timeouts: int = 0  # matches of this reason's rules cut by the time limit
    values: dict[str, list[str]] = field(default_factory=dict)  # named group → distinct values while active

    def clear(self) -> None:
        self.active = False
        self.fail = False
        self.match_times.clear()
        self.matches_while_active = 0
        self.values = {}

    def in_window(self, now: float, window: float) -> int:
        return sum(1 for t in self.match_times if now - t <= window)

    def note_groups(self, found: regex.Match[str], fail_on: dict[str, list[str]]) -> None:
        for group, value in found.groupdict().items():
            if value is None:
                continue
            seen = self.values.setdefault(group, [])
            if value not in seen and len(seen) < 16:
                seen.append(value)
            if value in fail_on.get(group, ()):
                self.fail = True


@dataclass(frozen=True)
class _CompiledRule:
    spec: KernelLogRule
    compiled: regex.Pattern[str]
    recover: regex.Pattern[str] | None


class RuleEngine:
    """Matches messages against rules; raises a problem after `count` matches within `window_seconds` and
    clears it after a quiet period without a match (or at once on the rule's recover_pattern).

    Pure logic with an injectable clock, so window and quiet-period timing is testable without sleeping.
    """

    def __init__(
        self,
        rules: Sequence[KernelLogRule],
        quiet_period_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        max_line_chars: int = 240,
        match_timeout: float = 0.05,
    ) -> None:
        self.clock = clock
        self.quiet_period_seconds = quiet_period_seconds
        self.max_line_chars = max_line_chars
        self.match_timeout = match_timeout
        self.user_task_records_total = 0
        self._rules: list[_CompiledRule] = []
        self._states: dict[str, _RuleState] = {}
        self._reasons: dict[str, Reason] = {}
        self.configure(rules, quiet_period_seconds)

    def configure(self, rules: Sequence[KernelLogRule], quiet_period_seconds: float) -> None:
        """(Re)load rules; the state of reasons that remain is kept."""
        self.quiet_period_seconds = quiet_period_seconds
        self._rules = [
            _CompiledRule(
                rule, regex.compile(rule.pattern), regex.compile(rule.recover_pattern) if rule.recover_pattern else None
            )
            for rule in rules
        ]
        self._reasons = {reason.code: reason for reason in rule_reasons(rules)}
        wanted: dict[str, int] = {}
        for rule in rules:
            wanted[rule.reason] = max(wanted.get(rule.reason, 1), rule.count)
        for reason in list(self._states):
            if reason not in wanted:
                del self._states[reason]
        for reason, count in wanted.items():
            state = self._states.get(reason)
            if state is None:
                self._states[reason] = _RuleState(match_times=deque(maxlen=count))
            elif state.match_times.maxlen != count:
                state.match_times = deque(state.match_times, maxlen=count)

    @property
    def reasons(self) -> list[str]:
        return list(self._states)

    def matches_total(self, reason: str) -> int:
        return self._states[reason].matches_total

    def match_timeouts(self, reason: str) -> int:
        return self._states[reason].match_timeouts

    def _search(self, pattern: regex.Pattern[str], line: str, state: _RuleState) -> regex.Match[str] | None:
        try:
            return pattern.search(line, timeout=self.match_timeout)
        except TimeoutError:
            state.match_timeouts += 1  # taken as no match: a crafted line must not raise a fault either
            return None

    def observe(self, message: str) -> list[str]:
        """Feed one kernel message; returns the reasons it matched."""
        if is_user_task_record(message):
            self.user_task_records_total += 1
            return []
        message, _ = neutralise_task_names(message)
        line = message[: self.max_line_chars]
        matched: list[str] = []
        now = self.clock()
        for rule in self._rules:
            spec = rule.spec
            state = self._states[spec.reason]
            self._expire(spec, state, now)
            if rule.recover is not None and self._search(rule.recover, line, state) is not None:
                state.clear()
                continue
            found = self._search(rule.compiled, line, state)
            if found is None:
                continue
            matched.append(spec.reason)
            state.matches_total += 1
            state.match_times.append(now)
            state.last_line = line
            if not state.active and state.in_window(now, spec.window_seconds) >= spec.count:
                state.active = True
                state.matches_while_active = 0
                state.values = {}
            if state.active:
                state.last_match_at = now
                state.matches_while_active += 1
                state.note_groups(found, spec.fail_on)
        return matched

    def observe_all(self, messages: Iterable[str], deadline: float | None = None) -> list[str]:
        """Feed messages in order until `deadline` (time.monotonic()); returns those not fed."""
        pending = list(messages)
        for index, message in enumerate(pending):
            if deadline is not None and time.monotonic() >= deadline:
                return pending[index:]
            self.observe(message)
        return []

    def _quiet_period(self, spec: KernelLogRule) -> float:
        return spec.quiet_period_seconds or self.quiet_period_seconds

    def _expire(self, spec: KernelLogRule, state: _RuleState, now: float) -> None:
        if state.active and state.last_match_at is not None and now - state.last_match_at >= self._quiet_period(spec):
            state.clear()

    def findings(self) -> list[Finding]:
        """One finding per reason: the problem while active, else OK. Expires problems past their quiet period."""
        now = self.clock()
        specs: dict[str, KernelLogRule] = {}
        for rule in self._rules:
            specs.setdefault(rule.spec.reason, rule.spec)
        out: list[Finding] = []
        for reason, spec in specs.items():
            state = self._states[reason]
            self._expire(spec, state, now)
            in_window = state.in_window(now, spec.window_seconds)
            observed: dict[str, Any] = {
                "matches_in_window": in_window,
                "matches_total": state.matches_total,
                "count": spec.count,
                "window_seconds": spec.window_seconds,
            }
            if state.match_timeouts:
                observed["match_timeouts"] = state.match_timeouts
            if state.active:
                out.append(self._problem(spec, state, observed, now))
                continue
            message = f"no {reason} problem in the kernel log"
            if in_window:
                message = (
                    f"{in_window} {reason} line(s) within {spec.window_seconds:g}s, below the {spec.count} "
                    f"that raise it; last: {state.last_line}"
                )
            out.append(LOG.ok(reason, message, observed, category=spec.category))
        return out

    def _problem(self, spec: KernelLogRule, state: _RuleState, observed: dict[str, Any], now: float) -> Finding:
        quiet = self._quiet_period(spec)
        status = Status.FAIL if state.fail else _base_status(spec)
        ago = now - (state.last_match_at or now)
        observed.update(
            {
                "matches_while_active": state.matches_while_active,
                "last_match_seconds_ago": round(ago, 1),
                "clears_in_seconds": round(max(0.0, quiet - ago), 1),
            }
        )
        for group, values in state.values.items():
            observed[group] = values[-1]
            if len(values) > 1:
                observed[f"{group}_values"] = list(values)
        return LOG.report(
            self._reasons[spec.reason],
            spec.reason,
            f"kernel log: {state.matches_while_active} {spec.reason} line(s), last {ago:.0f}s ago: {state.last_line}",
            observed,
            hint=f"{spec.hint or DEFAULT_HINT} (clears after {quiet:g}s without a new match)",
            status=status,
            category=spec.category,
        )
