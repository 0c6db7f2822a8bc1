"""Prometheus exposition of the current snapshot. collect() only reads: it never runs a probe.

The exposition is rendered once per snapshot (and at most once per `max_age` for the agent's own process
metrics), not once per request: /metrics is reachable by every pod, and a render costs milliseconds of the
HTTP loop that also answers /ready.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.process_collector import ProcessCollector

from agent.snapshot import PROBLEM_STATUSES, Snapshot, SnapshotSource
from probes.base import CATEGORIES, Sample

SampleSource = Callable[[], Iterable[Sample]]

RUN_RESULTS = ("ok", "error", "timeout")
CACHE_MAX_AGE_SECONDS = 1.0


class SnapshotCollector:
    def __init__(self, snapshot: SnapshotSource, sources: Iterable[SampleSource] = ()) -> None:
        self._snapshot = snapshot
        self._sources = list(sources)

    def add_source(self, source: SampleSource) -> None:
        self._sources.append(source)

    def describe(self) -> list[Metric]:
        return []  # avoid a collect() at registration time

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield from core_metrics(snap)
        samples: list[Sample] = list(snap.samples)
        for source in self._sources:
            try:
                samples.extend(source())
            except Exception:  # noqa: BLE001 - a broken source must not break /metrics
                continue
        yield from sample_families(samples)


def core_metrics(snap: Snapshot) -> Iterator[Metric]:
    ready = GaugeMetricFamily("nodehealth_ready", "1 when the node is ready for jobs, 0 otherwise.")
    ready.add_metric([], 1.0 if snap.ready else 0.0)
    yield ready

    status = GaugeMetricFamily(
        "nodehealth_check_status",
        "Effective check status: 0 ok, 1 warn, 2 fail, 3 unknown, 4 skip.",
        labels=["check", "subject"],
    )
    problem = GaugeMetricFamily(
        "nodehealth_problem",
        "1 while a problem is active (the series goes away when it clears).",
        labels=["check", "subject", "reason"],
    )
    npd_gauge = GaugeMetricFamily(
        "problem_gauge",
        "node-problem-detector compatible: 1 while a problem of this type and reason is active.",
        labels=["type", "reason"],
    )
    active: set[tuple[str, str]] = set()
    for state in snap.checks:
        finding = state.finding
        status.add_metric([finding.check, finding.subject], finding.status.metric_value)
        if finding.status in PROBLEM_STATUSES:
            problem.add_metric([finding.check, finding.subject, finding.reason], 1.0)
            active.add((CATEGORIES[finding.category].condition_type, finding.reason))
    for type_, reason in sorted(active):
        npd_gauge.add_metric([type_, reason], 1.0)
    yield status
    yield problem
    yield npd_gauge

    # node-problem-detector exports this counter as `problem_counter`, without the `_total` suffix that
    # prometheus_client appends to counters; untyped keeps the exact name existing NPD dashboards query.
    npd_counter = UnknownMetricFamily(
        "problem_counter",
        "node-problem-detector compatible: times a problem with this reason began.",
        labels=["reason"],
    )
    for reason, count in sorted(snap.problem_counts.items()):
        npd_counter.add_metric([reason], count)
    yield npd_counter

    duration = GaugeMetricFamily(
        "nodehealth_probe_duration_seconds", "Duration of the last run of each probe.", labels=["probe"]
    )
    last_success = GaugeMetricFamily(
        "nodehealth_probe_last_success_timestamp_seconds",
        "Unix time of the last run of each probe that completed (ok or skip).",
        labels=["probe"],
    )
    runs = CounterMetricFamily("nodehealth_probe_runs_total", "Probe runs by result.", labels=["probe", "result"])
    for probe in snap.probes:
        if probe.duration_seconds is not None:
            duration.add_metric([probe.name], probe.duration_seconds)
        if probe.last_success is not None:
            last_success.add_metric([probe.name], probe.last_success)
        counts = dict.fromkeys(RUN_RESULTS, 0)
        for result, count in probe.runs.items():
            key = "ok" if result == "skip" else result
            counts[key] = counts.get(key, 0) + count
        for result, count in counts.items():
            runs.add_metric([probe.name, result], count)
    yield duration
    yield last_success
    yield runs


def sample_families(samples: Iterable[Sample]) -> Iterator[Metric]:
    """Group probe samples by metric name; label sets may differ between samples of one name."""
    families: dict[str, tuple[Sample, list[Sample]]] = {}
    for sample in samples:
        entry = families.get(sample.name)
        if entry is None:
            families[sample.name] = (sample, [sample])
        elif entry[0].kind == sample.kind:
            entry[1].append(sample)
    for name, (first, members) in sorted(families.items()):
        label_names = sorted({key for member in members for key in member.labels})
        family: Metric
        if first.kind == "counter":
            family = CounterMetricFamily(name, first.help, labels=label_names)
        else:
            family = GaugeMetricFamily(name, first.help, labels=label_names)
        seen: set[tuple[str, ...]] = set()
        for member in members:
            values = tuple(str(member.labels.get(key, "")) for key in label_names)
            if values in seen:
                continue
            seen.add(values)
            family.add_metric(list(values), float(member.value))
        yield family


class MetricsRenderer:
    """Owns the registry: the snapshot collector plus the agent's own process metrics."""

    def __init__(
        self,
        snapshot: SnapshotSource,
        sources: Iterable[SampleSource] = (),
        max_age: float = CACHE_MAX_AGE_SECONDS,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = SnapshotCollector(snapshot, sources)
        self.registry.register(self.collector)
        self.registry.register(ProcessCollector(namespace="nodehealth_agent", registry=None))
        self._snapshot = snapshot
        self.max_age = max_age
        self._cache: tuple[Hashable, float, bytes] | None = None
        self.renders = 0

    def render(self) -> bytes:
        """The exposition, re-rendered only for a new snapshot or after max_age seconds."""
        key = self._snapshot().cache_key
        now = time.monotonic()
        cached = self._cache
        if cached is not None and cached[0] == key and now - cached[1] < self.max_age:
            return cached[2]
        body = generate_latest(self.registry)
        self.renders += 1
        self._cache = (key, now, body)
        return body
