"""Health state: the latest result per (check, subject), hysteresis, fail-closed rules and freshness.

HealthState takes each probe run's results, applies hysteresis, marks results stale, and publishes one
immutable Snapshot (agent/snapshot.py) that HTTP, metrics, the CLI and the Kubernetes agent read through
`current()`. Nothing that reads a snapshot runs a probe.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from agent.ready import evaluate
from agent.reasons import WARMING_UP
from agent.snapshot import (
    CHECK_CHANGE,
    GONE,
    PROBLEM_STATUSES,
    READINESS_CHANGE,
    CheckState,
    ProbeStatus,
    Snapshot,
    Transition,
)
from probes.base import Check, Finding, Sample, Status

# Transitions /status keeps (the snapshot's ring); the log has them all, rate-limited per check (agent/logs.py).
HISTORY_MAX = 50
# Blocking reasons a readiness transition's message names (the rest are counted).
READINESS_REASONS_SHOWN = 3


def judged_now(snapshot: Snapshot, now_mono: float, clock: Callable[[], float] = time.time) -> Snapshot:
    """`snapshot` as it reads at `now_mono`: itself while every result in it is fresh; past its validity an aged view
    (same version, the results past their limit stale, the verdict judged again). The monotonic clock is the
    host's, so the HTTP server's process judges the agent's snapshots by the same rule (agent/http/serving.py)."""
    if now_mono <= snapshot.valid_until:
        return snapshot
    checks = tuple(state.aged(now_mono) for state in snapshot.checks)
    verdict = evaluate(checks, snapshot.required, clock())
    return replace(snapshot, checks=checks, verdict=verdict, valid_until=math.inf, aged=True)


class TransitionSink(Protocol):
    """Where transitions go besides the snapshot (the daemon's log: agent/logs.py HealthLog). Called from the
    publishing thread, under the state's lock: must not block."""

    def transition(self, change: Transition) -> None: ...

    def tick(self) -> None:
        """Called on each refresh (the scheduler's tick): time for what is due (a suppressed-lines summary)."""


@dataclass(frozen=True)
class ProbeSpec:
    """What the state needs to know of a scheduled probe."""

    name: str
    checks: tuple[str, ...]
    interval: float
    timeout: float


@dataclass(frozen=True)
class HealthSettings:
    """How results are judged (the config's `health:` section; `node-health check` judges one run, 1/1)."""

    fail_threshold: int = 2
    recovery_threshold: int = 2
    stale_after_intervals: float = 3.0
    required: tuple[str, ...] = ()  # unknown results of these checks block readiness too


@dataclass
class _Entry:
    """Mutable bookkeeping behind one CheckState."""

    effective: Finding
    probe: str
    observed_at: float = 0.0
    observed_mono: float = 0.0
    since: float = 0.0
    fail_streak: int = 0
    pass_streak: int = 0
    pending: str = ""
    unverified: str = ""  # set while a fail stands on unknown evidence: the unknown result's reason and message


@dataclass
class _ProbeBook:
    spec: ProbeSpec
    status: ProbeStatus
    samples: tuple[Sample, ...] = ()
    samples_mono: float = 0.0


class HealthState:
    def __init__(
        self,
        node: str,
        settings: HealthSettings = HealthSettings(),
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.RLock()
        self._clock = clock
        self._mono = monotonic
        self.node = node
        self.settings = settings
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._probes: dict[str, _ProbeBook] = {}
        self._problem_counts: dict[str, int] = {}
        self._version = 0
        self._listeners: list[Callable[[Snapshot], None]] = []
        self._history: collections.deque[Transition] = collections.deque(maxlen=HISTORY_MAX)
        self._sinks: list[TransitionSink] = []
        self._unsent: list[Transition] = []
        self._snapshot = self._build()

    # --- configuration ---------------------------------------------------------------------------

    def configure(self, probes: Iterable[ProbeSpec], settings: HealthSettings | None = None) -> None:
        """Set the probes in force (results of probes no longer configured disappear: nothing lingers) and,
        when given, the settings results are judged by from now on."""
        with self._lock:
            if settings is not None:
                self.settings = settings
            specs = {spec.name: spec for spec in probes}
            for name in list(self._probes):
                if name not in specs:
                    del self._probes[name]
            for name, spec in specs.items():
                book = self._probes.get(name)
                if book is None:
                    self._probes[name] = _ProbeBook(spec, ProbeStatus(name, spec.interval, spec.timeout))
                else:
                    book.spec = spec
                    book.status = replace(book.status, interval=spec.interval, timeout=spec.timeout)
            owned = {check: name for name, spec in specs.items() for check in spec.checks}
            for key, entry in list(self._entries.items()):
                if owned.get(key[0]) != entry.probe:
                    del self._entries[key]
            for check, name in owned.items():
                if not any(key[0] == check for key in self._entries):
                    self._entries[(check, "")] = self._placeholder(check, name)
            self._publish()

    def _placeholder(self, check: str, probe: str) -> _Entry:
        return _Entry(Check(check).report(WARMING_UP, "", f"{check} has not produced a result yet"), probe)

    # --- results ---------------------------------------------------------------------------------

    def probe_started(self, name: str) -> None:
        with self._lock:
            book = self._probes.get(name)
            if book is not None:
                book.status = replace(book.status, running_since=self._mono())

    def record(
        self,
        probe: str,
        findings: Iterable[Finding],
        samples: Iterable[Sample] = (),
        result: str = "ok",
        duration: float = 0.0,
        still_running: bool = False,
    ) -> None:
        """Take one probe run's results. result: ok, skip, error (exception) or timeout.

        On error or timeout the given findings (one unknown per check) also replace every subject the
        probe reported before: the agent does not know their state any more.
        """
        with self._lock:
            book = self._probes.get(probe)
            if book is None:
                return  # a late result of a probe that was unconfigured meanwhile
            now, mono = self._clock(), self._mono()
            findings = [f for f in findings if f.check in book.spec.checks]
            if result in ("error", "timeout"):
                findings = self._spread_unknown(book.spec, findings)
            fresh_keys = set()
            for finding in findings:
                fresh_keys.add(finding.key)
                self._apply(probe, finding, now, mono)
            # A check the run could not fully judge (an unknown among its findings) keeps its failing subjects:
            # a holder scan that failed must not make an out-of-band holder disappear.
            unverified_checks = {f.check: f for f in findings if f.status == Status.UNKNOWN}
            for key, entry in list(self._entries.items()):
                if entry.probe != probe or key in fresh_keys:
                    continue
                why = unverified_checks.get(key[0])
                if why is not None and entry.effective.status == Status.FAIL:
                    entry.pass_streak = 0
                    entry.unverified = f"{why.reason}: {why.message}"
                    entry.observed_at, entry.observed_mono = now, mono
                    continue
                if entry.effective.status not in (Status.OK, Status.SKIP) and entry.effective.reason != WARMING_UP.code:
                    gone = replace(entry.effective, message="no longer reported: the problem it stood for is over")
                    self._history_add(CHECK_CHANGE, gone, entry.effective.status.value, GONE, now)
                del self._entries[key]
            for check in book.spec.checks:
                if not any(key[0] == check for key in self._entries):
                    self._entries[(check, "")] = self._placeholder(check, probe)
            runs = dict(book.status.runs)
            runs[result] = runs.get(result, 0) + 1
            book.status = replace(
                book.status,
                last_run=now,
                duration_seconds=duration,
                result=result,
                last_success=now if result in ("ok", "skip") else book.status.last_success,
                running_since=book.status.running_since if still_running else None,
                runs=runs,
            )
            if result == "ok":
                book.samples = tuple(samples)
                book.samples_mono = mono
            elif result == "skip":
                book.samples = ()
            self._publish()

    def _spread_unknown(self, spec: ProbeSpec, findings: list[Finding]) -> list[Finding]:
        template = {f.check: f for f in findings}
        out: list[Finding] = []
        covered: set[str] = set()
        for (check, subject), entry in self._entries.items():
            if entry.probe != spec.name or check not in template:
                continue
            base = template[check]
            out.append(replace(base, subject=subject, device=entry.effective.device))
            covered.add(check)
        out.extend(f for check, f in template.items() if check not in covered)
        return out

    def _apply(self, probe: str, finding: Finding, now: float, mono: float) -> None:
        entry = self._entries.get(finding.key)
        if entry is None or entry.effective.reason == WARMING_UP.code:
            # A first result is a change only when it is a problem: a node that starts healthy says so once, in
            # its readiness transition, not once per check.
            if finding.status not in (Status.OK, Status.SKIP):
                before = Status.UNKNOWN.value  # warming up, or a subject not reported before
                self._history_add(CHECK_CHANGE, finding, before, finding.status.value, now)
            entry = _Entry(finding, probe, since=now)
            self._entries[finding.key] = entry
            self._note_transition(None, finding)
        else:
            self._hysteresis(entry, finding, now)
        entry.observed_at, entry.observed_mono = now, mono

    def _hysteresis(self, entry: _Entry, raw: Finding, now: float) -> None:
        """Fail closed: an established fail leaves only on `recovery_threshold` consecutive passing results; an
        unknown result (probe error, timeout, a scan that failed) never replaces it — the fail stands, marked
        unverified — and breaks a recovery streak. Entering fail from ok, warn or unknown takes
        `fail_threshold` consecutive failing results (unknown ones in between neither count nor reset)."""
        current = entry.effective.status
        entry.pending = ""
        if raw.status == Status.UNKNOWN and current == Status.FAIL:
            entry.pass_streak = 0
            entry.unverified = f"{raw.reason}: {raw.message}"
            return
        entry.unverified = ""
        if raw.status == Status.FAIL and current != Status.FAIL:
            entry.fail_streak += 1
            entry.pass_streak = 0
            if entry.fail_streak < self.settings.fail_threshold:
                entry.pending = f"fail {entry.fail_streak}/{self.settings.fail_threshold}"
                return
        elif raw.status in (Status.OK, Status.WARN) and current == Status.FAIL:
            entry.pass_streak += 1
            entry.fail_streak = 0
            if entry.pass_streak < self.settings.recovery_threshold:
                entry.pending = f"{raw.status.value} {entry.pass_streak}/{self.settings.recovery_threshold}"
                return
        elif raw.status == Status.UNKNOWN:
            if entry.fail_streak:
                entry.pending = f"fail {entry.fail_streak}/{self.settings.fail_threshold}"
        else:
            entry.fail_streak = 0
        if raw.status != Status.UNKNOWN:
            entry.fail_streak = entry.pass_streak = 0
        previous = entry.effective
        entry.effective = raw
        if raw.status != previous.status:
            entry.since = now
            self._history_add(CHECK_CHANGE, raw, previous.status.value, raw.status.value, now)
        self._note_transition(previous, raw)

    def _history_add(self, kind: str, finding: Finding, before: str, after: str, now: float) -> None:
        change = Transition(now, kind, finding.check, finding.subject, before, after, finding.reason, finding.message)
        self._history.append(change)
        self._unsent.append(change)

    def add_sink(self, sink: TransitionSink) -> None:
        """Send every transition from now on to `sink` too (the daemon's health log)."""
        with self._lock:
            self._sinks.append(sink)

    def _note_transition(self, previous: Finding | None, new: Finding) -> None:
        if new.status not in PROBLEM_STATUSES:
            return
        if previous is not None and previous.status in PROBLEM_STATUSES and previous.reason == new.reason:
            return
        self._problem_counts[new.reason] = self._problem_counts.get(new.reason, 0) + 1

    # --- snapshots -------------------------------------------------------------------------------

    @property
    def snapshot(self) -> Snapshot:
        """The snapshot as last published; readers use current()."""
        return self._snapshot

    def current(self) -> Snapshot:
        """The snapshot with freshness judged now: the one way readers get it, so a wedged scheduler that
        stops publishing cannot leave an old 'ready' standing. Past the published snapshot's validity it is
        an aged view (same version, the results past their limit stale, the verdict judged again)."""
        return judged_now(self._snapshot, self._mono(), self._clock)

    def subscribe(self, listener: Callable[[Snapshot], None]) -> None:
        """Called (from the publishing thread) with each new snapshot; must not block."""
        with self._lock:
            self._listeners.append(listener)

    def refresh(self) -> bool:
        """Re-judge freshness (called periodically); publish when the verdict changed. True if published."""
        with self._lock:
            for sink in self._sinks:
                try:
                    sink.tick()
                except Exception:  # noqa: BLE001 - a sink must never break the state
                    pass
            candidate = self._build(bump=False)
            old = self._snapshot
            if (candidate.ready, candidate.stale_keys) == (old.ready, old.stale_keys):
                return False
            self._publish()
            return True

    def _readiness_change(self, old: Snapshot, new: Snapshot) -> None:
        # Before the first configure there are no checks, and no checks is vacuously "ready": not a state the node
        # was ever in.
        if (old.ready and bool(old.checks)) == new.ready:
            return
        reasons = new.verdict.reasons
        shown = "; ".join(
            f"{f.check} {f.subject} {f.reason}: {f.message}".replace("  ", " ")
            for f in reasons[:READINESS_REASONS_SHOWN]
        )
        more = f"; and {len(reasons) - READINESS_REASONS_SHOWN} more" if len(reasons) > READINESS_REASONS_SHOWN else ""
        before, after = ("ready", "not ready") if old.ready else ("not ready", "ready")
        change = Transition(
            new.generated_at,
            READINESS_CHANGE,
            "",
            "",
            before,
            after,
            reasons[0].reason if reasons else "",
            shown + more,
        )
        self._history.append(change)
        self._unsent.append(change)

    def _publish(self) -> None:
        old = self._snapshot
        snapshot = self._build()
        self._readiness_change(old, snapshot)
        self._snapshot = replace(snapshot, transitions=tuple(self._history))
        unsent, self._unsent = self._unsent, []
        for change in unsent:
            for sink in self._sinks:
                try:
                    sink.transition(change)
                except Exception:  # noqa: BLE001 - a sink must never break the state
                    pass
        for listener in list(self._listeners):
            try:
                listener(self._snapshot)
            except Exception:  # noqa: BLE001 - a listener must never break the state
                pass

    def _build(self, bump: bool = True) -> Snapshot:
        if bump:
            self._version += 1
        now, mono = self._clock(), self._mono()
        states: list[CheckState] = []
        for key in sorted(self._entries):
            entry = self._entries[key]
            book = self._probes.get(entry.probe)
            limit = expires = math.inf
            if book is not None and entry.observed_mono:
                limit = self.settings.stale_after_intervals * book.spec.interval + book.spec.timeout
                expires = entry.observed_mono + limit
            state = CheckState(
                entry.effective,
                entry.probe,
                entry.observed_at,
                entry.since,
                False,
                entry.pending,
                expires,
                limit,
                entry.unverified,
            )
            states.append(state.aged(mono))
        samples: list[Sample] = []
        for book in self._probes.values():
            limit = self.settings.stale_after_intervals * book.spec.interval + book.spec.timeout
            if book.samples and mono - book.samples_mono <= limit:
                samples.extend(book.samples)
        verdict = evaluate(states, self.settings.required, now)
        fresh_expiries = [state.expires_mono for state in states if not state.stale]
        return Snapshot(
            node=self.node,
            version=self._version,
            generated_at=now,
            checks=tuple(states),
            probes=tuple(book.status for _, book in sorted(self._probes.items())),
            samples=tuple(samples),
            required=self.settings.required,
            problem_counts=dict(self._problem_counts),
            verdict=verdict,
            valid_until=min(fresh_expiries, default=math.inf),
            oldest_observed=min((s.observed_at for s in states if s.observed_at), default=now),
        )
