"""The immutable Snapshot HealthState publishes, and what its readers ask of it.

HTTP, metrics, `node-health check` and the Kubernetes agent read snapshots and nothing else; none of them
runs a probe or takes the state's lock. Each gets its snapshot from one place, `HealthState.current()` (the
`SnapshotSource`), which re-judges freshness at the moment of reading.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from agent.reasons import STALE, WARMING_UP
from agent.timestamps import rfc3339
from probes.base import CATEGORIES, Finding, Sample, Status

# Statuses that are a problem while they last (metrics' nodehealth_problem, node-problem-detector's counters).
PROBLEM_STATUSES = (Status.FAIL, Status.WARN)


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
        out["observed_at"] = rfc3339(self.observed_at, milliseconds=True) if self.observed_at else None
        out["since"] = rfc3339(self.since, milliseconds=True) if self.since else None
        if self.stale:
            out["stale"] = True
        if self.pending:
            out["pending"] = self.pending
        if self.unverified:
            out["unverified"] = self.unverified
        return out


def stale_finding(finding: Finding, age: float, limit: float) -> Finding:
    return replace(
        finding,
        status=STALE.status,
        reason=STALE.code,
        message=f"last result is {age:.0f}s old (limit {limit:.0f}s); was {finding.reason}",
        hint=STALE.hint,
    )


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
            "last_run": rfc3339(self.last_run, milliseconds=True) if self.last_run else None,
            "duration_seconds": None if self.duration_seconds is None else round(self.duration_seconds, 4),
            "result": self.result,
            "interval_seconds": self.interval,
            "timeout_seconds": self.timeout,
            "running": self.running_since is not None,
        }


# The kinds of Transition: a check's effective status changed, or the node's readiness did.
CHECK_CHANGE, READINESS_CHANGE = "check", "readiness"
# `to` of a check change whose subject is no longer reported (a holder that went away, a mount dropped from the
# config while it failed): the problem it stood for is over.
GONE = "gone"


@dataclass(frozen=True)
class Transition:
    """One entry of the health history: when a check's effective status changed (with the reason it changed to)
    or the node's readiness did (with what blocks it). Texts come from findings, escaped where they were made."""

    at: float  # wall clock
    kind: str  # CHECK_CHANGE or READINESS_CHANGE
    check: str  # "" for readiness
    subject: str
    before: str  # a status ("ok", "fail", ...), or "ready" / "not ready"
    after: str  # a status or GONE, or "ready" / "not ready"
    reason: str  # the reason code changed to; for readiness the first reason that blocks ("" when ready)
    message: str  # the finding's message; for readiness what blocks, in short

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": rfc3339(self.at, milliseconds=True),
            "kind": self.kind,
            "check": self.check,
            "subject": self.subject,
            "from": self.before,
            "to": self.after,
            "reason": self.reason,
            "message": self.message,
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
    valid_until: float = math.inf  # monotonic: past this, some result has gone stale since publication
    oldest_observed: float = 0.0  # wall clock of the oldest result (age_seconds of /ready)
    # True for a view re-judged at reading time because results went stale since the snapshot was published
    # (a wedged scheduler publishes nothing): same version, other content.
    aged: bool = False
    # The last changes of checks and readiness, oldest first (a bounded ring: agent/state.py HISTORY_MAX).
    transitions: tuple[Transition, ...] = ()

    @property
    def ready(self) -> bool:
        return self.verdict.ready

    @property
    def findings(self) -> tuple[Finding, ...]:
        return tuple(state.finding for state in self.checks)

    @property
    def warming_up(self) -> bool:
        return any(state.finding.reason == WARMING_UP.code for state in self.checks)

    @property
    def stale_keys(self) -> tuple[tuple[str, str], ...]:
        return tuple(state.finding.key for state in self.checks if state.stale)

    @property
    def cache_key(self) -> Hashable:
        """Identifies what this snapshot says: its version, and for an aged view which results have gone
        stale since it was published. Answers rendered from a snapshot are cached under this key."""
        return (self.version, self.stale_keys if self.aged else ())

    def categories(self) -> dict[str, tuple[CheckState, ...]]:
        """Check states per category of the one table (probes.base.CATEGORIES)."""
        grouped: dict[str, list[CheckState]] = {category: [] for category in CATEGORIES}
        for state in self.checks:
            grouped[state.finding.category].append(state)
        return {category: tuple(states) for category, states in grouped.items()}

    def to_document(self, history: bool = False) -> dict[str, Any]:
        """The JSON document of `check --json` and `GET /status` (docs/http.md); /status adds the history
        (`transitions`, oldest first; docs/observability.md)."""
        document: dict[str, Any] = {
            "node": self.node,
            "ready": self.ready,
            "generated_at": rfc3339(self.generated_at, milliseconds=True),
            "reasons": [reason_dict(f) for f in self.verdict.reasons],
            "findings": [state.to_dict() for state in self.checks],
            "probes": [probe.to_dict() for probe in self.probes],
        }
        if history:
            document["transitions"] = [change.to_dict() for change in self.transitions]
        return document


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


# The one way readers get a snapshot: HealthState.current (freshness judged at the moment of reading).
SnapshotSource = Callable[[], Snapshot]
