"""Scheduler: each probe on its own interval with jitter and a deadline, in its own worker thread.

A probe that overruns its deadline is reported unknown / ProbeTimeout and is not started again while its
thread still runs (a thread cannot be killed; starting another would pile them up). An exception becomes
unknown / ProbeError. Nothing one probe does reaches another probe, the state lock or the HTTP server.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from agent.config import Config
from agent.reasons import PROBE_ERROR, PROBE_TIMEOUT
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes.base import (
    NOT_APPLICABLE,
    PARSE_ERROR,
    Check,
    Finding,
    Probe,
    ProbeContext,
    ProbeParseError,
    Reason,
    Sample,
)
from probes.network.config import NetworkConfig
from probes.runtime.host import Host
from probes.runtime.podresources.pods import KubeletAccess, PodDirectory

log = logging.getLogger(__name__)

TICK_SECONDS = 0.25


@dataclass
class _Slot:
    probe: Probe
    spec: ProbeSpec
    jitter: float
    next_due: float = 0.0
    thread: threading.Thread | None = None
    started_mono: float = 0.0
    run_id: int = 0
    reported_timeout_at: float = 0.0  # monotonic of the last ProbeTimeout report for the current run


def probe_spec(probe: Probe, config: Config) -> ProbeSpec:
    probe.configure(config)  # a probe whose checks come from the config (site checks) takes them now
    schedule = config.schedule(probe.name)
    return ProbeSpec(
        probe.name,
        tuple(probe.checks),
        schedule.interval_seconds or probe.default_interval,
        schedule.timeout_seconds or probe.default_timeout,
    )


def health_settings(config: Config, one_shot: bool = False) -> HealthSettings:
    """The settings results are judged by. A one-shot run (`node-health check`) has one result per check to
    judge, so it enters and leaves fail on that one: thresholds 1/1 whatever the config says."""
    health = config.health
    return HealthSettings(
        fail_threshold=1 if one_shot else health.fail_threshold,
        recovery_threshold=1 if one_shot else health.recovery_threshold,
        stale_after_intervals=health.stale_after_intervals,
        required=tuple(health.required_checks),
    )


def enabled_probes(probes: dict[str, Probe], config: Config) -> dict[str, Probe]:
    return {name: probe for name, probe in probes.items() if config.schedule(name).enabled}


def split_output(probe: Probe, output: object) -> tuple[list[Finding], list[Sample]]:
    """Validate what a probe returned; anything but findings and samples of its own checks is garbage."""
    if not isinstance(output, (list, tuple)):
        raise TypeError(f"probe {probe.name} returned {type(output).__name__}, not a list of findings")
    findings: list[Finding] = []
    samples: list[Sample] = []
    for item in output:
        if isinstance(item, Finding):
            if item.check not in probe.checks:
                raise TypeError(f"probe {probe.name} returned a finding for {item.check!r}, not one of its checks")
            findings.append(item)
        elif isinstance(item, Sample):
            samples.append(item)
        else:
            raise TypeError(f"probe {probe.name} returned {type(item).__name__} among its findings")
    return findings, samples


def unknown_findings(probe: Probe, reason: Reason, message: str) -> list[Finding]:
    """One finding per check of the probe, with the reason's declared status and fix."""
    return [Check(check).report(reason, "", message) for check in probe.checks]


def probe_context(host: Host, config: Config, timeout: float, pods: PodDirectory | None = None) -> ProbeContext:
    """One run's context: what a probe needs of the agent's settings, as the context's typed fields."""
    return ProbeContext(
        host,
        config,
        timeout,
        node_name=config.resolved_node_name,
        redact_cmdlines=config.redact_cmdlines,
        host_resolver=config.section(NetworkConfig).dns.host_resolver(),
        kubelet=KubeletAccess(
            config.kubernetes.pod_resources_socket, config.kubernetes.pod_resources_timeout_seconds, pods
        ),
    )


def execute(
    probe: Probe, host: Host, config: Config, timeout: float, pods: PodDirectory | None = None
) -> tuple[str, list[Finding], list[Sample]]:
    """Run one probe once in the calling thread: (result, findings, samples). Never raises. `pods`: the node's
    pods as the agent's Kubernetes side lists them, when it runs."""
    ctx = probe_context(host, config, timeout, pods)
    try:
        skip_reason = probe.applicable(ctx)
        if skip_reason:
            skipped = [Finding(c, "", NOT_APPLICABLE.status, NOT_APPLICABLE.code, skip_reason) for c in probe.checks]
            return "skip", skipped, []
        findings, samples = split_output(probe, probe.run(ctx))
        return "ok", findings, samples
    except ProbeParseError as exc:
        log.warning("probe %s: parse error: %s", probe.name, exc)
        msg = f"could not parse tool output: {exc}"
        return "error", unknown_findings(probe, PARSE_ERROR, msg), []
    except Exception as exc:
        log.warning("probe %s raised %s: %s", probe.name, type(exc).__name__, exc, exc_info=log.isEnabledFor(10))
        msg = f"probe {probe.name} failed: {type(exc).__name__}: {exc}"
        return "error", unknown_findings(probe, PROBE_ERROR, msg), []


class Scheduler:
    def __init__(
        self,
        probes: dict[str, Probe],
        config: Config,
        host: Host,
        state: HealthState,
        on_run: Callable[[str, str, float], None] | None = None,
        rng: random.Random | None = None,
        one_shot: bool = False,
        pods: PodDirectory | None = None,
    ) -> None:
        """`one_shot`: for run_all_once (`node-health check`), judged by health_settings(config, one_shot=True)."""
        self._probes = probes
        self._one_shot = one_shot
        self.pods = pods  # set by the agent once its Kubernetes side runs
        self._host = host
        self._state = state
        self._on_run = on_run
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._slots: dict[str, _Slot] = {}
        self._config = config
        self.last_tick = time.monotonic()
        self._apply_config(config)

    # --- configuration ---------------------------------------------------------------------------

    def reconfigure(self, config: Config, host: Host | None = None) -> None:
        with self._lock:
            if host is not None:
                self._host = host
            self._apply_config(config)
        self._wake.set()

    def _apply_config(self, config: Config) -> None:
        self._config = config
        wanted = enabled_probes(self._probes, config)
        now = time.monotonic()
        for name in list(self._slots):
            if name not in wanted:
                del self._slots[name]  # a running thread finishes on its own; its result is dropped
        for name, probe in wanted.items():
            spec = probe_spec(probe, config)
            jitter = config.schedule(name).jitter_fraction
            slot = self._slots.get(name)
            if slot is None:
                # First runs start at once (spread over a second) so warm-up is short.
                self._slots[name] = _Slot(probe, spec, jitter, next_due=now + self._rng.uniform(0, 1.0))
            else:
                # A probe's settings may have changed with the config: run each again soon (spread over
                # two seconds) so the change shows in its results now, not one full interval later.
                slot.next_due = min(slot.next_due, now + self._rng.uniform(0, 2.0))
                slot.spec, slot.jitter = spec, jitter
        # The one path by which the config's health settings reach the state.
        self._state.configure([slot.spec for slot in self._slots.values()], health_settings(config, self._one_shot))

    # --- loop ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def alive(self, max_tick_age: float = 10.0) -> bool:
        return self._thread is not None and self._thread.is_alive() and time.monotonic() - self.last_tick < max_tick_age

    def stuck_probes(self, older_than: float) -> dict[str, float]:
        """Probes whose current run has lasted longer than `older_than` seconds: name → seconds."""
        now = time.monotonic()
        with self._lock:
            return {
                name: now - slot.started_mono
                for name, slot in self._slots.items()
                if slot.thread is not None and now - slot.started_mono > older_than
            }

    def running_threads(self) -> int:
        with self._lock:
            return sum(1 for slot in self._slots.values() if slot.thread is not None)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.last_tick = time.monotonic()
            try:
                with self._lock:
                    self._tick(time.monotonic())
                self._state.refresh()
            except Exception:
                log.exception("scheduler tick failed")
            self._wake.wait(TICK_SECONDS)
            self._wake.clear()

    def _tick(self, now: float) -> None:
        for name, slot in self._slots.items():
            if slot.thread is not None:
                self._watch_running(name, slot, now)
                continue
            if now >= slot.next_due:
                self._launch(name, slot, now)

    def _watch_running(self, name: str, slot: _Slot, now: float) -> None:
        elapsed = now - slot.started_mono
        if elapsed <= slot.spec.timeout:
            return
        # Report the overrun once at the deadline, then once per interval while the run is still stuck,
        # so the result stays fresh (unknown / ProbeTimeout) instead of turning stale.
        if slot.reported_timeout_at and now - slot.reported_timeout_at < slot.spec.interval:
            return
        slot.reported_timeout_at = now
        message = f"probe {name} still running after {elapsed:.1f}s (timeout {slot.spec.timeout:g}s)"
        log.warning(message)
        findings = unknown_findings(slot.probe, PROBE_TIMEOUT, message)
        self._state.record(name, findings, result="timeout", duration=elapsed, still_running=True)
        if self._on_run:
            self._on_run(name, "timeout", elapsed)

    def _launch(self, name: str, slot: _Slot, now: float) -> None:
        slot.run_id += 1
        slot.started_mono = now
        slot.reported_timeout_at = 0.0
        slot.next_due = now + slot.spec.interval * (1 + self._rng.uniform(0, slot.jitter))
        run_id = slot.run_id
        config = self._config
        slot.thread = threading.Thread(
            target=self._worker, args=(name, slot, run_id, config), name=f"probe-{name}", daemon=True
        )
        self._state.probe_started(name)
        slot.thread.start()

    def _worker(self, name: str, slot: _Slot, run_id: int, config: Config) -> None:
        started = time.monotonic()
        result, findings, samples = execute(slot.probe, self._host, config, slot.spec.timeout, self.pods)
        duration = time.monotonic() - started
        with self._lock:
            slot.thread = None
            current = self._slots.get(name) is slot and slot.run_id == run_id
            timed_out = bool(slot.reported_timeout_at)
            if timed_out:
                # Too late: the overrun was reported; run again soon rather than waiting a full interval.
                slot.next_due = min(slot.next_due, time.monotonic() + 1.0)
        if not current:
            return
        if timed_out:
            log.info("probe %s finished after %.1fs, past its deadline; result dropped", name, duration)
            return
        self._state.record(name, findings, samples, result=result, duration=duration)
        if self._on_run:
            self._on_run(name, result, duration)
        self._wake.set()

    # --- one-shot --------------------------------------------------------------------------------

    def run_all_once(self) -> None:
        """Run every enabled probe once in parallel and wait for each up to its deadline (for `check`)."""
        with self._lock:
            now = time.monotonic()
            for name, slot in self._slots.items():
                self._launch(name, slot, now)
            # The threads as launched: a worker clears slot.thread before it records its result, so waiting on
            # slot.thread could return (or never wait) while a finished probe's result is not recorded yet.
            launched = [(name, slot, slot.thread) for name, slot in self._slots.items()]
        for name, slot, thread in launched:
            if thread is None:
                continue
            thread.join(max(0.0, slot.started_mono + slot.spec.timeout - time.monotonic()))
            with self._lock:
                running = slot.thread is thread
                if running:
                    self._watch_running(name, slot, max(time.monotonic(), slot.started_mono + slot.spec.timeout + 1e-3))
            if not running:
                thread.join()  # done with its probe: only recording the result is left


def build_state(config: Config) -> HealthState:
    """The node's state; its settings come with the probes from the Scheduler (health_settings)."""
    return HealthState(config.resolved_node_name)


def instantiate(classes: dict[str, type[Probe]]) -> dict[str, Probe]:
    return {name: cls() for name, cls in classes.items()}
