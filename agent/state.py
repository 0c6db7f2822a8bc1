"""Health state and verdict.

HealthState keeps the latest result per (check, subject), applies hysteresis, marks results stale, and
publishes one immutable Snapshot that HTTP, metrics and the Kubernetes reconciler all read. Nothing that
reads a snapshot runs a probe.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from probes.base import (
    CATEGORIES,
    OBSERVED_HBM_FREE_MIB,
    OBSERVED_HOST_MEM_AVAILABLE_MIB,
    OBSERVED_HUGEPAGES_FREE,
    Finding,
    Reason,
    Sample,
    Status,
    category_of,
)

# Reasons the agent itself gives (not a probe): they block readiness whether the check is required or not,
# because they say the agent cannot vouch for the node.
WARMING_UP = "WarmingUp"
STALE = "Stale"
PROBE_TIMEOUT = "ProbeTimeout"
PROBE_ERROR = "ProbeError"
PARSE_ERROR = "ParseError"
HBM_BELOW_REQUEST = "HbmBelowRequest"
HOST_MEM_BELOW_REQUEST = "HostMemoryBelowRequest"
ALWAYS_BLOCKING = frozenset({WARMING_UP, STALE})

# The reasons the agent itself gives, documented beside the probes' own (node-health probes --reasons).
AGENT_REASONS: tuple[Reason, ...] = (
    Reason(
        WARMING_UP,
        Status.UNKNOWN,
        "the check has not produced a result since the agent started; never ready meanwhile",
        "wait one probe interval; /status shows when each probe last ran",
    ),
    Reason(
        STALE,
        Status.UNKNOWN,
        "the last result is older than health.stale_after_intervals intervals: the probe is not running on schedule",
        "see /healthz, /status and the agent log; a probe stuck on a hung filesystem or tool shows there",
    ),
    Reason(
        PROBE_TIMEOUT,
        Status.UNKNOWN,
        "the probe overran its deadline (a hung tool or filesystem); it is not restarted while it runs",
        "see the agent log for the probe; check the host command or mount it was using",
    ),
    Reason(
        PROBE_ERROR,
        Status.UNKNOWN,
        "the probe raised an exception; the message names it",
        "see the agent log (logging.level: debug shows the traceback) and report it",
    ),
    Reason(
        HBM_BELOW_REQUEST,
        Status.FAIL,
        "/ready?min_hbm_free_mib=N: a considered device has less free device memory than the job asked for",
        "another process holds device memory: see the device's holders (npu.holders, gpu.holders), or ask for less",
    ),
    Reason(
        HOST_MEM_BELOW_REQUEST,
        Status.FAIL,
        "/ready?min_host_mem_mib=N or min_hugepages=N: the host has less available memory or fewer free hugepages "
        "than the job asked for; unknown when host.memory has no current value to compare (never ready then)",
        "stop leftovers of earlier jobs (ps aux --sort=-rss | head), or ask for less; when unknown, see the host "
        "probe in /status",
        also=(Status.UNKNOWN,),
    ),
)

CONDITION_TYPES = {
    "npu": "NPUHealthy",
    "gpu": "GPUHealthy",
    "storage": "StorageHealthy",
    "network": "NetworkHealthy",
    "time": "ClockSynced",
    "host": "HostHealthy",
}

PROBLEM_STATUSES = (Status.FAIL, Status.WARN)


@dataclass(frozen=True)
class ProbeSpec:
    """What the state needs to know of a scheduled probe."""

    name: str
    checks: tuple[str, ...]
    interval: float
    timeout: float


@dataclass(frozen=True)
class CheckState:
    finding: Finding  # effective: after hysteresis and freshness
    probe: str
    observed_at: float  # wall clock of the last result, 0 when never
    since: float  # wall clock of the last change of the effective status
    stale: bool = False
    pending: str = ""  # e.g. "fail 1/2": a transition waiting for its threshold
    expires_mono: float = math.inf  # monotonic time after which this result is stale
    stale_limit: float = math.inf
    # A fail that stands although the latest run could not verify it (probe error, timeout, failed scan).
    unverified: str = ""

    def aged(self, now_mono: float) -> CheckState:
        """This state as it stands at `now_mono`: stale once past its expiry."""
        if self.stale or now_mono <= self.expires_mono:
            return self
        age = now_mono - self.expires_mono + self.stale_limit
        return replace(self, finding=stale_finding(self.finding, age, self.stale_limit), stale=True)

    def to_dict(self) -> dict[str, Any]:
        out = self.finding.to_dict()
        out["probe"] = self.probe
        out["observed_at"] = _rfc3339(self.observed_at) if self.observed_at else None
        out["since"] = _rfc3339(self.since) if self.since else None
        if self.stale:
            out["stale"] = True
        if self.pending:
            out["pending"] = self.pending
        if self.unverified:
            out["unverified"] = self.unverified
        return out


@dataclass(frozen=True)
class ProbeStatus:
    name: str
    interval: float
    timeout: float
    last_run: float | None = None  # wall clock of the last completed (or timed-out) run
    duration_seconds: float | None = None
    result: str = "never"  # ok, error, timeout, skip, never
    last_success: float | None = None
    running_since: float | None = None  # monotonic, while a run is in flight
    runs: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "last_run": _rfc3339(self.last_run) if self.last_run else None,
            "duration_seconds": None if self.duration_seconds is None else round(self.duration_seconds, 4),
            "result": self.result,
            "interval_seconds": self.interval,
            "timeout_seconds": self.timeout,
            "running": self.running_since is not None,
        }


@dataclass(frozen=True)
class Verdict:
    ready: bool
    reasons: tuple[Finding, ...]
    age_seconds: float


@dataclass(frozen=True)
class Snapshot:
    node: str
    version: int
    generated_at: float
    checks: tuple[CheckState, ...]
    probes: tuple[ProbeStatus, ...]
    samples: tuple[Sample, ...]
    required: tuple[str, ...]
    problem_counts: Mapping[str, int]
    verdict: Verdict
    valid_until: float = math.inf  # monotonic: past this, some result has gone stale; see current()
    oldest_observed: float = 0.0  # wall clock of the oldest result (age_seconds of /ready)

    def current(self, now_mono: float | None = None) -> Snapshot:
        """The snapshot with freshness judged now. Readers call this, so a wedged scheduler that stops
        publishing cannot leave an old 'ready' standing."""
        now_mono = time.monotonic() if now_mono is None else now_mono
        if now_mono <= self.valid_until:
            return self
        checks = tuple(state.aged(now_mono) for state in self.checks)
        verdict = evaluate(checks, self.required, None, None, None, time.time())
        return replace(self, checks=checks, verdict=verdict, valid_until=math.inf)

    @property
    def ready(self) -> bool:
        return self.verdict.ready

    @property
    def findings(self) -> tuple[Finding, ...]:
        return tuple(state.finding for state in self.checks)

    @property
    def warming_up(self) -> bool:
        return any(state.finding.reason == WARMING_UP for state in self.checks)

    def evaluate(
        self,
        checks: Collection[str] | None = None,
        devices: Collection[int] | None = None,
        min_hbm_free_mib: float | None = None,
        now: float | None = None,
        *,
        min_host_mem_mib: float | None = None,
        min_hugepages: float | None = None,
    ) -> Verdict:
        return evaluate(
            self.checks,
            self.required,
            checks,
            devices,
            min_hbm_free_mib,
            now or time.time(),
            min_host_mem_mib=min_host_mem_mib,
            min_hugepages=min_hugepages,
        )

    def categories(self) -> dict[str, tuple[CheckState, ...]]:
        """Check states per category of the one table (probes.base.CATEGORIES)."""
        grouped: dict[str, list[CheckState]] = {category: [] for category in CATEGORIES}
        for state in self.checks:
            grouped[state.finding.category].append(state)
        return {category: tuple(states) for category, states in grouped.items()}

    def to_document(self) -> dict[str, Any]:
        """The JSON document of `check --json` and `GET /status` (docs/http.md)."""
        return {
            "node": self.node,
            "ready": self.ready,
            "generated_at": _rfc3339(self.generated_at),
            "reasons": [reason_dict(f) for f in self.verdict.reasons],
            "findings": [state.to_dict() for state in self.checks],
            "probes": [probe.to_dict() for probe in self.probes],
        }


def reason_dict(finding: Finding) -> dict[str, Any]:
    out: dict[str, Any] = {
        "check": finding.check,
        "subject": finding.subject,
        "status": finding.status.value,
        "reason": finding.reason,
        "message": finding.message,
        "hint": finding.hint,
    }
    if finding.device is not None:
        out["device"] = finding.device
    return out


def matches_any(check: str, selectors: Collection[str]) -> bool:
    """`npu` selects npu.*, `storage.locks` selects itself; a category selects its checks (pcie → host)."""
    for selector in selectors:
        if check == selector or check.startswith(selector + "."):
            return True
        if selector in CATEGORIES and category_of(check) == selector:
            return True
    return False


def evaluate(
    states: Iterable[CheckState],
    required: Collection[str],
    checks: Collection[str] | None,
    devices: Collection[int] | None,
    min_hbm_free_mib: float | None,
    now: float,
    *,
    min_host_mem_mib: float | None = None,
    min_hugepages: float | None = None,
) -> Verdict:
    reasons: list[Finding] = []
    oldest = now
    states = tuple(states)
    for state in states:
        finding = state.finding
        if checks is not None and not matches_any(finding.check, checks):
            continue
        if devices is not None and finding.device is not None and finding.device not in devices:
            continue
        if state.observed_at:
            oldest = min(oldest, state.observed_at)
        if blocks(finding, required):
            reasons.append(finding)
        if min_hbm_free_mib is not None and finding.device is not None and finding.status != Status.SKIP:
            free = finding.observed.get(OBSERVED_HBM_FREE_MIB)
            if isinstance(free, (int, float)) and free < min_hbm_free_mib:
                reasons.append(
                    Finding(
                        finding.check,
                        finding.subject,
                        Status.FAIL,
                        HBM_BELOW_REQUEST,
                        f"{finding.subject}: {free:g} MiB free, the job asked for {min_hbm_free_mib:g} MiB",
                        "another process holds device memory: check the device's processes, or ask for less",
                        {OBSERVED_HBM_FREE_MIB: free},
                        device=finding.device,
                    )
                )
    if min_host_mem_mib:
        reasons.extend(host_memory_shortfall(states, "", OBSERVED_HOST_MEM_AVAILABLE_MIB, min_host_mem_mib))
    if min_hugepages:
        reasons.extend(host_memory_shortfall(states, "hugepages", OBSERVED_HUGEPAGES_FREE, min_hugepages))
    return Verdict(not reasons, tuple(reasons), round(max(0.0, now - oldest), 3))


def host_memory_shortfall(states: Iterable[CheckState], subject: str, key: str, wanted: float) -> list[Finding]:
    """/ready?min_host_mem_mib= (subject "") and min_hugepages= (subject "hugepages"), judged against the current
    host.memory result whatever checks= and devices= select: a job asked for this explicitly. A value that is not
    current (never reported, stale, a failed run) fails closed as unknown."""
    what, unit = ("available host memory", " MiB") if key == OBSERVED_HOST_MEM_AVAILABLE_MIB else ("free hugepages", "")
    parameter = "min_host_mem_mib" if key == OBSERVED_HOST_MEM_AVAILABLE_MIB else "min_hugepages"
    state = next((s for s in states if s.finding.key == ("host.memory", subject)), None)
    value = None if state is None else state.finding.observed.get(key)
    if state is None or state.stale or state.finding.status in (Status.UNKNOWN, Status.SKIP):
        value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        why = "no host.memory result" if state is None else f"host.memory is {state.finding.reason}"
        message = f"{what} not known ({why}), cannot vouch for {parameter}={wanted:g}"
        hint = "see the host probe in /status" + ("" if subject == "" else "; the host may reserve no hugepages")
        return [Finding("host.memory", subject, Status.UNKNOWN, HOST_MEM_BELOW_REQUEST, message, hint)]
    if value >= wanted:
        return []
    message = f"{value:g}{unit} {what}, the job asked for {wanted:g}{unit}"
    hint = "stop leftovers of earlier jobs (ps aux --sort=-rss | head), or ask for less"
    return [Finding("host.memory", subject, Status.FAIL, HOST_MEM_BELOW_REQUEST, message, hint, {key: value})]


def blocks(finding: Finding, required: Collection[str]) -> bool:
    if finding.status == Status.FAIL:
        return True
    if finding.status == Status.UNKNOWN:
        return finding.reason in ALWAYS_BLOCKING or finding.required or matches_any(finding.check, required)
    return False


def stale_finding(finding: Finding, age: float, limit: float) -> Finding:
    return replace(
        finding,
        status=Status.UNKNOWN,
        reason=STALE,
        message=f"last result is {age:.0f}s old (limit {limit:.0f}s); was {finding.reason}",
        hint="the probe is not running on schedule: see /status and /healthz",
    )


def _rfc3339(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


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
        fail_threshold: int = 2,
        recovery_threshold: int = 2,
        stale_after_intervals: float = 3.0,
        required: Iterable[str] = (),
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.RLock()
        self._clock = clock
        self._mono = monotonic
        self.node = node
        self.fail_threshold = fail_threshold
        self.recovery_threshold = recovery_threshold
        self.stale_after_intervals = stale_after_intervals
        self.required = tuple(required)
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._probes: dict[str, _ProbeBook] = {}
        self._problem_counts: dict[str, int] = {}
        self._version = 0
        self._listeners: list[Callable[[Snapshot], None]] = []
        self._snapshot = self._build()

    # --- configuration ---------------------------------------------------------------------------

    def configure(
        self,
        probes: Iterable[ProbeSpec],
        fail_threshold: int | None = None,
        recovery_threshold: int | None = None,
        stale_after_intervals: float | None = None,
        required: Iterable[str] | None = None,
    ) -> None:
        """Set the probes in force: results of probes no longer configured disappear (nothing lingers)."""
        with self._lock:
            if fail_threshold is not None:
                self.fail_threshold = fail_threshold
            if recovery_threshold is not None:
                self.recovery_threshold = recovery_threshold
            if stale_after_intervals is not None:
                self.stale_after_intervals = stale_after_intervals
            if required is not None:
                self.required = tuple(required)
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
        finding = Finding(
            check,
            "",
            Status.UNKNOWN,
            WARMING_UP,
            f"{check} has not produced a result yet",
            "wait for the first probe run (see /status for probe timing)",
        )
        return _Entry(finding, probe)

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
        if entry is None or entry.effective.reason == WARMING_UP:
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
            if entry.fail_streak < self.fail_threshold:
                entry.pending = f"fail {entry.fail_streak}/{self.fail_threshold}"
                return
        elif raw.status in (Status.OK, Status.WARN) and current == Status.FAIL:
            entry.pass_streak += 1
            entry.fail_streak = 0
            if entry.pass_streak < self.recovery_threshold:
                entry.pending = f"{raw.status.value} {entry.pass_streak}/{self.recovery_threshold}"
                return
        elif raw.status == Status.UNKNOWN:
            if entry.fail_streak:
                entry.pending = f"fail {entry.fail_streak}/{self.fail_threshold}"
        else:
            entry.fail_streak = 0
        if raw.status != Status.UNKNOWN:
            entry.fail_streak = entry.pass_streak = 0
        previous = entry.effective
        entry.effective = raw
        if raw.status != previous.status:
            entry.since = now
        self._note_transition(previous, raw)

    def _note_transition(self, previous: Finding | None, new: Finding) -> None:
        if new.status not in PROBLEM_STATUSES:
            return
        if previous is not None and previous.status in PROBLEM_STATUSES and previous.reason == new.reason:
            return
        self._problem_counts[new.reason] = self._problem_counts.get(new.reason, 0) + 1

    # --- snapshots -------------------------------------------------------------------------------

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def subscribe(self, listener: Callable[[Snapshot], None]) -> None:
        """Called (from the publishing thread) with each new snapshot; must not block."""
        with self._lock:
            self._listeners.append(listener)

    def refresh(self) -> bool:
        """Re-judge freshness (called periodically); publish when the verdict changed. True if published."""
        with self._lock:
            candidate = self._build(bump=False)
            old = self._snapshot
            if (candidate.ready, _stale_keys(candidate)) == (old.ready, _stale_keys(old)):
                return False
            self._publish()
            return True

    def _publish(self) -> None:
        self._snapshot = self._build()
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
                limit = self.stale_after_intervals * book.spec.interval + book.spec.timeout
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
            limit = self.stale_after_intervals * book.spec.interval + book.spec.timeout
            if book.samples and mono - book.samples_mono <= limit:
                samples.extend(book.samples)
        verdict = evaluate(states, self.required, None, None, None, now)
        fresh_expiries = [state.expires_mono for state in states if not state.stale]
        return Snapshot(
            node=self.node,
            version=self._version,
            generated_at=now,
            checks=tuple(states),
            probes=tuple(book.status for _, book in sorted(self._probes.items())),
            samples=tuple(samples),
            required=self.required,
            problem_counts=dict(self._problem_counts),
            verdict=verdict,
            valid_until=min(fresh_expiries, default=math.inf),
            oldest_observed=min((s.observed_at for s in states if s.observed_at), default=now),
        )


def _stale_keys(snapshot: Snapshot) -> tuple[tuple[str, str], ...]:
    return tuple(state.finding.key for state in snapshot.checks if state.stale)
