"""kernel.log: kernel messages from /dev/kmsg matched against node-problem-detector style rules.

The reader opens /dev/kmsg once (O_RDONLY|O_NONBLOCK), starts at the end, and each run drains what is there
without blocking. Only kernel-facility records count: anyone may write a line to /dev/kmsg, and such lines
carry the user facility, so a process cannot raise a "GPU has fallen off the bus" problem by writing one.

Record format (Documentation/ABI/testing/dev-kmsg):
    PRI,SEQ,TS_USEC,FLAGS[,MORE...];MESSAGE\\n
    [ KEY=VALUE\\n]...
PRI is the syslog priority (facility << 3 | level); non-printable bytes of MESSAGE and of the KEY=VALUE
continuation lines are escaped as \\xHH. A read() returns one record; when the reader fell behind and records
were overwritten, read() fails once with EPIPE and the next read returns the oldest record still there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probes.base import Finding, Probe, ProbeContext, ProbeOutput, Sample, Status, register
from probes.kernel.default_rules import DEFAULT_RULES, GPU_FATAL_XIDS  # noqa: F401

if TYPE_CHECKING:
    from probes.kernel.config import KernelLogRule

CHECK = "kernel.log"
KERNEL_FACILITY = 0
# The kernel refuses reads into a buffer smaller than one record (CONSOLE_EXT_LOG_MAX is 8 KiB).
READ_SIZE = 16384

# --- parsing -------------------------------------------------------------------------------------------

_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")


def _unescape(raw: bytes) -> str:
    return _ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), raw).decode("utf-8", "replace")


@dataclass(frozen=True)
class KmsgRecord:
    priority: int  # syslog PRI: facility << 3 | level
    sequence: int
    timestamp_usec: int  # since boot (the kernel's local clock)
    flags: str
    message: str
    properties: dict[str, str] = field(default_factory=dict)  # continuation lines: SUBSYSTEM=pci, DEVICE=+pci:...

    @property
    def facility(self) -> int:
        return self.priority >> 3

    @property
    def level(self) -> int:
        return self.priority & 7

    @property
    def from_kernel(self) -> bool:
        return self.facility == KERNEL_FACILITY


def parse_kmsg_record(data: bytes) -> KmsgRecord | None:
    """One /dev/kmsg record (as one read() returns it) → KmsgRecord; None when it is not in that format."""
    head, sep, rest = data.partition(b";")
    if not sep:
        return None
    fields = head.split(b",")
    if len(fields) < 4:
        return None
    try:
        priority = int(fields[0])
        sequence = int(fields[1])
        timestamp = int(fields[2])
    except ValueError:
        return None
    if priority < 0 or sequence < 0 or timestamp < 0:
        return None
    lines = rest.split(b"\n")
    properties: dict[str, str] = {}
    for line in lines[1:]:
        if not line.startswith(b" "):
            continue
        key, eq, value = line[1:].partition(b"=")
        if eq and key:
            properties[_unescape(key)] = _unescape(value)
    return KmsgRecord(
        priority=priority,
        sequence=sequence,
        timestamp_usec=timestamp,
        flags=fields[3].decode("ascii", "replace"),
        message=_unescape(lines[0]),
        properties=properties,
    )


def split_records(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Split a byte stream into records (a header line plus its ' KEY=VALUE' lines); returns (records, rest).

    /dev/kmsg hands out one record per read(); a regular file or FIFO in the same format gives arbitrary
    chunks, so the reader splits on line starts and keeps an unterminated tail for the next read.
    """
    records: list[bytes] = []
    end = buffer.rfind(b"\n")
    if end < 0:
        return records, buffer
    complete, rest = buffer[: end + 1], buffer[end + 1 :]
    current: list[bytes] = []
    for line in complete.split(b"\n")[:-1]:
        if line.startswith(b" ") and current:
            current.append(line)
            continue
        if current:
            records.append(b"\n".join(current))
        current = [line]
    if current:
        records.append(b"\n".join(current))
    return records, rest


# --- reading -------------------------------------------------------------------------------------------


@dataclass
class ReadResult:
    records: list[KmsgRecord]
    read: int = 0  # records read (all facilities)
    ignored: int = 0  # records of a non-kernel facility, or malformed
    overwritten: int = 0  # EPIPE: the ring buffer overwrote records before we read them
    truncated: bool = False  # stopped at max_records or the deadline with more to read


class KmsgReader:
    """A non-blocking reader of /dev/kmsg (or of a file in its format) that keeps its file open between runs."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._fd: int | None = None
        self._tail = b""

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def open(self) -> None:
        """Open and seek to the end, so only records logged from now on are read. Raises OSError."""
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.close(fd)
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), self.path)
        with contextlib.suppress(OSError):  # a FIFO cannot seek; it has no backlog either
            os.lseek(fd, 0, os.SEEK_END)
        self._fd = fd
        self._tail = b""

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
            self._tail = b""

    def fileno(self) -> int | None:
        return self._fd

    def read_available(self, max_records: int = 20000, deadline: float | None = None) -> ReadResult:
        """Read every record available now without blocking; only kernel-facility records are returned."""
        self.open()
        assert self._fd is not None
        result = ReadResult(records=[])
        while True:
            if result.read >= max_records or (deadline is not None and time.monotonic() >= deadline):
                result.truncated = True
                break
            try:
                chunk = os.read(self._fd, READ_SIZE)
            except BlockingIOError:
                break  # EAGAIN: nothing more for now
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    result.overwritten += 1
                    self._tail = b""
                    continue
                raise
            if not chunk:
                break  # a regular file at its end, or a FIFO with no writer
            raw_records, self._tail = split_records(self._tail + chunk)
            for raw in raw_records:
                result.read += 1
                record = parse_kmsg_record(raw)
                if record is None or not record.from_kernel:
                    result.ignored += 1
                    continue
                result.records.append(record)
        return result


# --- rules ---------------------------------------------------------------------------------------------


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
    values: dict[str, list[str]] = field(default_factory=dict)  # named group → distinct values while active


@dataclass(frozen=True)
class _CompiledRule:
    spec: KernelLogRule
    regex: re.Pattern[str]
    recover: re.Pattern[str] | None


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
    ) -> None:
        self.clock = clock
        self.quiet_period_seconds = quiet_period_seconds
        self.max_line_chars = max_line_chars
        self._rules: list[_CompiledRule] = []
        self._states: dict[str, _RuleState] = {}
        self.configure(rules, quiet_period_seconds)

    def configure(self, rules: Sequence[KernelLogRule], quiet_period_seconds: float) -> None:
        """(Re)load rules; the state of reasons that remain is kept."""
        self.quiet_period_seconds = quiet_period_seconds
        self._rules = [
            _CompiledRule(
                rule, re.compile(rule.pattern), re.compile(rule.recover_pattern) if rule.recover_pattern else None
            )
            for rule in rules
        ]
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

    def observe(self, message: str) -> list[str]:
        """Feed one kernel message; returns the reasons it matched."""
        matched: list[str] = []
        now = self.clock()
        for rule in self._rules:
            spec = rule.spec
            state = self._states[spec.reason]
            self._expire(spec, state, now)
            if rule.recover is not None and rule.recover.search(message):
                self._clear(state)
                continue
            found = rule.regex.search(message)
            if found is None:
                continue
            matched.append(spec.reason)
            state.matches_total += 1
            state.match_times.append(now)
            state.last_line = message[: self.max_line_chars]
            in_window = sum(1 for t in state.match_times if now - t <= spec.window_seconds)
            if not state.active and in_window >= spec.count:
                state.active = True
                state.matches_while_active = 0
                state.values = {}
            if state.active:
                state.last_match_at = now
                state.matches_while_active += 1
                for group, value in found.groupdict().items():
                    if value is None:
                        continue
                    seen = state.values.setdefault(group, [])
                    if value not in seen and len(seen) < 16:
                        seen.append(value)
                    if value in spec.fail_on.get(group, ()):
                        state.fail = True
        return matched

    def observe_all(self, messages: Iterable[str]) -> None:
        for message in messages:
            self.observe(message)

    def _clear(self, state: _RuleState) -> None:
        state.active = False
        state.fail = False
        state.match_times.clear()
        state.matches_while_active = 0
        state.values = {}

    def _quiet_period(self, spec: KernelLogRule) -> float:
        return spec.quiet_period_seconds or self.quiet_period_seconds

    def _expire(self, spec: KernelLogRule, state: _RuleState, now: float) -> None:
        if state.active and state.last_match_at is not None and now - state.last_match_at >= self._quiet_period(spec):
            self._clear(state)

    def findings(self) -> list[Finding]:
        """One finding per reason: the problem while active, else OK. Expires problems past their quiet period."""
        now = self.clock()
        specs: dict[str, KernelLogRule] = {}
        for rule in self._rules:
            specs.setdefault(rule.spec.reason, rule.spec)
        out: list[Finding] = []
        for reason, spec in specs.items():
            state = self._states[reason]
            quiet = self._quiet_period(spec)
            self._expire(spec, state, now)
            in_window = sum(1 for t in state.match_times if now - t <= spec.window_seconds)
            observed: dict[str, Any] = {
                "matches_in_window": in_window,
                "matches_total": state.matches_total,
                "count": spec.count,
                "window_seconds": spec.window_seconds,
            }
            if not state.active:
                message = f"no {reason} problem in the kernel log"
                if in_window:
                    message = (
                        f"{in_window} {reason} line(s) within {spec.window_seconds:g}s, below the {spec.count} "
                        f"that raise it; last: {state.last_line}"
                    )
                out.append(
                    Finding(CHECK, reason, Status.OK, "OK", message, observed=observed, category_override=spec.category)
                )
                continue
            status = Status.FAIL if (spec.type == "permanent" or spec.status == "fail" or state.fail) else Status.WARN
            ago = now - (state.last_match_at or now)
            clears_in = max(0.0, quiet - ago)
            observed.update(
                {
                    "matches_while_active": state.matches_while_active,
                    "last_match_seconds_ago": round(ago, 1),
                    "clears_in_seconds": round(clears_in, 1),
                }
            )
            for group, values in state.values.items():
                observed[group] = values[-1]
                if len(values) > 1:
                    observed[f"{group}_values"] = list(values)
            out.append(
                Finding(
                    CHECK,
                    reason,
                    status,
                    reason,
                    f"kernel log: {state.matches_while_active} {reason} line(s), "
                    f"last {ago:.0f}s ago: {state.last_line}",
                    f"{spec.hint or 'read the kernel log around this line (dmesg -T)'} "
                    f"(clears after {quiet:g}s without a new match)",
                    observed,
                    category_override=spec.category,
                )
            )
        return out


# --- the probe -----------------------------------------------------------------------------------------


def effective_rules(config: Any) -> list[KernelLogRule]:
    return list(config.rules) + list(config.extra_rules)


@register
class KernelLogProbe(Probe):
    name = "kernel.log"
    checks = (CHECK,)
    default_interval = 15.0
    default_timeout = 5.0
    needs = "/dev/kmsg readable (CAP_SYSLOG when kernel.dmesg_restrict=1)"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._reader: KmsgReader | None = None
        self._engine: RuleEngine | None = None
        self._engine_key: tuple[Any, ...] | None = None
        self._clock = clock
        self.records_read_total = 0
        self.records_ignored_total = 0
        self.overwritten_total = 0

    def _path(self, ctx: ProbeContext) -> str:
        configured = ctx.config.kernel_log.path
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

    def _ensure_engine(self, ctx: ProbeContext) -> RuleEngine:
        settings = ctx.config.kernel_log
        rules = effective_rules(settings)
        key = (tuple(rules), settings.quiet_period_seconds, settings.max_line_chars)
        if self._engine is None:
            self._engine = RuleEngine(rules, settings.quiet_period_seconds, self._clock, settings.max_line_chars)
        elif key != self._engine_key:
            self._engine.configure(rules, settings.quiet_period_seconds)
            self._engine.max_line_chars = settings.max_line_chars
        self._engine_key = key
        return self._engine

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.config.kernel_log
        path = self._path(ctx)
        try:
            reader = self._ensure_reader(ctx)
        except OSError as exc:
            return [
                Finding(CHECK, "", Status.SKIP, "KernelLogUnavailable", f"cannot open {path}: {exc.strerror or exc}")
            ]
        engine = self._ensure_engine(ctx)
        try:
            result = reader.read_available(settings.max_records_per_run, deadline=ctx.deadline - 0.2)
        except OSError as exc:
            reader.close()  # reopened (at the end) next run
            return [
                Finding(
                    CHECK,
                    "",
                    Status.UNKNOWN,
                    "KernelLogReadFailed",
                    f"reading {path} failed: {exc.strerror or exc}",
                    "the agent reopens the kernel log on its next run; check its permissions if this persists",
                )
            ]
        self.records_read_total += result.read
        self.records_ignored_total += result.ignored
        self.overwritten_total += result.overwritten
        engine.observe_all(record.message for record in result.records)
        out: ProbeOutput = list(engine.findings())
        for reason in engine.reasons:
            out.append(
                Sample(
                    "nodehealth_kernel_log_matches_total",
                    "Kernel log lines matched per rule reason since the agent started.",
                    engine.matches_total(reason),
                    {"reason": reason},
                    kind="counter",
                )
            )
        out.append(
            Sample(
                "nodehealth_kernel_log_records_read_total",
                "Records read from /dev/kmsg (all facilities).",
                self.records_read_total,
                kind="counter",
            )
        )
        out.append(
            Sample(
                "nodehealth_kernel_log_records_ignored_total",
                "Records read from /dev/kmsg and ignored: not from the kernel facility, or malformed.",
                self.records_ignored_total,
                kind="counter",
            )
        )
        out.append(
            Sample(
                "nodehealth_kernel_log_overwritten_total",
                "Times the kernel ring buffer overwrote records before they were read (EPIPE).",
                self.overwritten_total,
                kind="counter",
            )
        )
        return out
