"""The reconciler thread: applies plans (`agent.kube.node.plan`) to the agent's own Node.

Reads the same immutable health snapshot HTTP and metrics read; never runs a probe.

- Taints are an atomic list: GET the Node, plan, PATCH with the Node's `resourceVersion`; a 409 means another
  controller wrote in between: read again and plan again. The labels ride on the same PATCH. Conditions: a
  strategic-merge PATCH of `nodes/status`, merged by `type` by the API server.
- Economy: nothing is read or written while the desired state is unchanged; a change costs at most one
  Node PATCH and one `nodes/status` PATCH (plus its Event, and a budget slot when a blocking taint is added
  or dropped); conditions get a heartbeat (lastHeartbeatTime) every `heartbeat_seconds` (600). A node
  waiting for a budget slot asks with one GET of the budget ConfigMap, on a jittered exponential schedule.
- Safety: dry_run computes and shows what would be written and writes nothing; a restart keeps what the
  previous run left until fresh results decide (see policy's "hold").
- Resilience: API errors back off exponentially with jitter; Events have their own queue and backoff
  (`agent.kube.node.events`), so an Event the API refuses never holds back a taint.
- Clocks: every retry, heartbeat and backoff (the device isolator's too) runs on the monotonic clock
  (`monotonic`), which no clock step moves; the wall clock (`clock`) only stamps what is written out (conditions,
  events, budget records).
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import kubernetes.client

from agent.config import Config, KubernetesConfig
from agent.kube.client import (
    Backoff,
    KubeApi,
    classify,
    is_status,
    load_api_client,
    retry_after,
    short_error,
)
from agent.kube.devices.isolator import DeviceIsolator, Hooks
from agent.kube.devices.report import device_samples, device_status
from agent.kube.node.events import EventQueue
from agent.kube.node.plan import Plan, plan_desired
from agent.kube.node.policy import Desired, desired_state
from agent.kube.node.report import status_document, status_samples
from agent.kube.node.seat import BudgetSeat
from agent.kube.pods import NodePods
from agent.snapshot import Snapshot
from agent.timestamps import rfc3339

log = logging.getLogger("agent.kube")


class KubeAgent:
    def __init__(
        self,
        config: Config,
        node_name: str,
        snapshot: Callable[[], Snapshot],
        api_client: kubernetes.client.ApiClient | None = None,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self._config = config
        self.node = node_name
        self._snapshot = snapshot
        self._client = api_client
        self._owns_client = api_client is None
        self._clock = clock
        self._monotonic = monotonic
        self._rng = rng or random.Random()
        self._lock = threading.Lock()  # counters and status
        self._pass_lock = threading.Lock()  # one reconcile at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._api_obj: KubeApi | None = None
        policy = config.kubernetes

        self._applied: tuple[Any, ...] | None = None
        self._dirty = True
        self._next_heartbeat = 0.0
        self._retry_at = 0.0
        self._backoff = Backoff(policy.backoff_initial_seconds, policy.backoff_max_seconds, self._rng)
        self.seat = BudgetSeat(
            node_name, self._api, clock, monotonic, self._rng, lambda what: self._wrote("budget", what), policy
        )
        self.events = EventQueue(
            node_name,
            clock,
            monotonic,
            self._rng,
            lambda what: self._wrote("event", what),
            policy.backoff_initial_seconds,
            policy.backoff_max_seconds,
        )

        hooks = Hooks(self._wrote, lambda r, m, w: self.events.add(r, m, w))
        self._devices = DeviceIsolator(node_name, self._api, clock, monotonic, self._rng, hooks)

        self.writes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.recent_writes: deque[dict[str, Any]] = deque(maxlen=20)
        # The node's pods for the npu and gpu checks against the device plugin's ledger (its own thread).
        self.pods = NodePods(
            self._api, node_name, schedulers=lambda: tuple(self._config.kubernetes.ascend_real_schedulers)
        )
        self.would_write: list[dict[str, Any]] = []
        self._last_would_logged: list[str] = []
        self.last_error = ""
        self.last_success: float | None = None
        self.last_attempt: float | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    @property
    def config(self) -> Config:
        return self._config

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kube-reconciler", daemon=True)
        self._thread.start()
        self.pods.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.pods.stop(min(timeout, 2.0))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._owns_client and self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
            self._api_obj = None
            self.seat.forget_client()

    def reconfigure(self, config: Config) -> None:
        with self._lock:
            self._config = config
            self._dirty = True
            self._api_obj = None
            policy = config.kubernetes
            self._backoff = Backoff(policy.backoff_initial_seconds, policy.backoff_max_seconds, self._rng)
            self.seat.reconfigure(policy)
        self._devices.reconfigure()

    def reconcile_once(self) -> None:
        """One pass now, whatever the backoff says (tests; the thread honours the backoff)."""
        self._attempt()

    def step(self) -> None:
        """What the thread does each poll: a pass unless the API backoff says wait."""
        if self._monotonic() >= self._retry_at:
            self._attempt()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.step()
            self._stop.wait(self._config.kubernetes.poll_seconds)

    def _attempt(self) -> None:
        with self._pass_lock:
            self.last_attempt = self._clock()
            try:
                self._pass()
            except Exception as exc:  # noqa: BLE001 - any API or client failure backs off, never kills the loop
                self._failed(exc)
            else:
                self._backoff.reset()
                self._retry_at = 0.0
                self.last_success = self._clock()

    def _failed(self, exc: BaseException) -> None:
        kind = classify(exc)
        delay = self._backoff.next_delay(retry_after(exc))
        with self._lock:
            self.errors[kind] += 1
            self._dirty = True
            self._retry_at = self._monotonic() + delay
            self.last_error = f"{kind}: {short_error(exc)}"
        if kind == "other":
            log.warning("kubernetes: unexpected error, retrying in %.1fs", delay, exc_info=exc)
        else:
            log.warning("kubernetes: %s; retrying in %.1fs", self.last_error, delay)

    # --- API -----------------------------------------------------------------------------------

    def _load_client(self) -> kubernetes.client.ApiClient:
        if self._client is None:
            self._client = load_api_client(self._config)
        return self._client

    def _api(self) -> KubeApi:
        if self._api_obj is None:
            self._api_obj = KubeApi(self._load_client, self._config.kubernetes.request_timeout_seconds)
        return self._api_obj

    def _wrote(self, kind: str, what: str) -> None:
        with self._lock:
            self.writes[kind] += 1
            self.recent_writes.append({"at": rfc3339(self._clock()), "kind": kind, "what": what})
        log.info("kubernetes: wrote %s: %s", kind, what)

    def _would(self, kind: str, what: str, body: Any) -> None:
        self.would_write.append({"kind": kind, "what": what, "body": body})

    # --- one pass ------------------------------------------------------------------------------

    def _pass(self) -> None:
        policy = self._config.kubernetes
        if not policy.enabled:
            return
        now, tick = self._clock(), self._monotonic()
        snapshot = self._snapshot()
        # Devices isolated on the device (a DeviceTaintRule, a public fault) leave the node's taints.
        desired = self._devices.prepare(snapshot, desired_state(snapshot, policy), policy, tick)
        self.events.add_findings(desired.events)
        fingerprint = desired.fingerprint()
        changed = self._dirty or fingerprint != self._applied
        heartbeat = tick >= self._next_heartbeat
        budget_due = self.seat.due(tick)
        # A node waiting for a slot asks the budget first: one GET, and reads the Node only when granted.
        granted = budget_due and not (changed or heartbeat) and self.seat.granted(policy, self._would)
        if changed or heartbeat or granted:
            self._reconcile(desired, policy, now, heartbeat)
            self._applied = fingerprint
            self._dirty = False
            if heartbeat:
                self._next_heartbeat = tick + policy.heartbeat_seconds
        self._devices.finish(policy, tick)  # rules and faults no longer wanted go once the Node carries the rest
        self._log_would_writes(policy)
        if policy.dry_run:
            for event in self.events.pending():
                self._would("event", f"{event.reason}: {event.message}", None)
            self.events.clear()
        else:
            self.events.flush(self._api(), policy.events_namespace)

    def _reconcile(self, desired: Desired, policy: KubernetesConfig, now: float, heartbeat: bool) -> None:
        self.would_write = []
        api = self._api()
        node = api.get_node(self.node)
        plan = Plan()
        for attempt in range(policy.conflict_retries + 1):
            plan = plan_desired(desired, node, policy, now=now, slot=self.seat.view(), heartbeat=heartbeat)
            if plan.slot_request:
                view = self.seat.ask(policy, plan.blocking_taints, plan.slot_request == "register", self._would)
                plan = plan_desired(desired, node, policy, now=now, slot=view, heartbeat=heartbeat)
            if plan.node_patch is None:
                break
            if policy.dry_run:
                self._would("node", plan.node_change, plan.node_patch)
                break
            try:
                node = api.patch_node(self.node, plan.node_patch)
            except Exception as exc:
                if not is_status(exc, 409) or attempt == policy.conflict_retries:
                    raise
                with self._lock:
                    self.errors["conflict"] += 1
                node = api.get_node(self.node)  # another controller wrote: plan again on its version
                continue
            self._wrote("node", plan.node_change)
            break
        self.seat.withheld(plan)
        self._write_conditions(plan, policy)
        # Last: the conditions tell what happened even when the ConfigMap fails.
        self.seat.release(plan, policy, self._would)

    def _write_conditions(self, plan: Plan, policy: KubernetesConfig) -> None:
        if plan.status_patch is None:
            return
        if policy.dry_run:
            self._would("node_status", plan.status_change, plan.status_patch)
            return
        self._api().patch_node_status(self.node, plan.status_patch)
        self._wrote("node_status", plan.status_change)
        for event in plan.events:
            self.events.add(event.reason, event.message, event.warning)

    # --- reporting -----------------------------------------------------------------------------

    def _log_would_writes(self, policy: KubernetesConfig) -> None:
        if not policy.dry_run:
            return
        lines = [f"{w['kind']}: {w['what']}" for w in self.would_write]
        if lines != self._last_would_logged:
            for line in lines:
                log.info("kubernetes dry-run: would write %s", line)
            self._last_would_logged = lines

    def status(self) -> dict[str, Any]:
        with self._lock:
            policy = self._config.kubernetes
            document = status_document(self, policy, self.seat.status(policy.max_unhealthy))
        document["node_pods"] = self.pods.status()
        document["devices"] = device_status(self._devices.view())
        return document

    def samples(self) -> list[Any]:
        with self._lock:
            samples = status_samples(self, self._config.kubernetes)
        return samples + device_samples(self._devices.view())

    @property
    def suppressed(self) -> dict[str, str]:
        return self.seat.suppressed

    @property
    def slot_held(self) -> bool | None:
        return self.seat.held

    @property
    def backoff_seconds(self) -> float:
        return round(max(0.0, self._retry_at - self._monotonic()), 3) if self._retry_at else 0.0
