"""Kubernetes reconciler: taints, the ready label, conditions and events on the agent's own Node.

Reads the same immutable health snapshot HTTP and metrics read; never runs a probe. What the Node should
carry is computed by `agent.kube_policy.desired_state`; this module applies it:

- Ownership: the agent edits only the taints `<prefix>/<category>`, the label `<prefix>/ready` and the six
  conditions of `CONDITION_TYPES`; it removes those it owns but no longer produces and leaves every other
  taint, label and condition alone.
- Taints are an atomic list: GET the Node, edit the list, PATCH with the Node's `resourceVersion`; a 409
  means another controller wrote in between: read again and redo the edit. The label rides on the same
  PATCH. Conditions: a strategic-merge PATCH of `nodes/status`, merged by `type` by the API server.
- Economy: nothing is read or written while the desired state is unchanged; a change costs at most one
  Node PATCH and one `nodes/status` PATCH (plus its Event, and a budget slot when a blocking taint is
  added or dropped); conditions get a heartbeat (lastHeartbeatTime) every `heartbeat_seconds` (600).
- Budget: a NoSchedule/NoExecute taint needs a slot in the cluster budget (`agent.kube_budget`); when the
  budget is spent the problem is reported (condition reason TaintSuppressedByBudget, metric, event) but
  the taint is not added.
- Safety: dry_run computes and shows what would be written and writes nothing; a restart keeps what the
  previous run left until fresh results decide (see kube_policy's "hold").
- Resilience: API errors back off exponentially with jitter; this thread is the only one that waits.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
import urllib3.exceptions
from kubernetes.client.rest import ApiException

from agent.config import Config, KubernetesConfig
from agent.kube_budget import BudgetConflict, BudgetResult, TaintBudget
from agent.kube_policy import (
    BLOCKING_EFFECTS,
    MESSAGE_LIMIT,
    Desired,
    FindingEvent,
    desired_state,
    ready_label_key,
    taint_key,
)
from agent.state import WARMING_UP, Snapshot
from probes.base import CATEGORIES, Sample

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
TAINT_SUPPRESSED = "TaintSuppressedByBudget"
COMPONENT = "node-health"
WRITE_KINDS = ("node", "node_status", "event", "budget")
ERROR_KINDS = ("unreachable", "timeout", "throttled", "server", "forbidden", "not_found", "conflict", "config", "other")


def load_api_client(config: Config) -> kubernetes.client.ApiClient:
    """kubernetes.kubeconfig if set; else the in-cluster ServiceAccount; else $KUBECONFIG or ~/.kube/config."""
    configuration = kubernetes.client.Configuration()
    explicit = config.kubernetes.kubeconfig
    if not explicit and os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    else:
        path = explicit or os.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())
        kubernetes.config.load_kube_config(config_file=path, client_configuration=configuration)
    return kubernetes.client.ApiClient(configuration)


def agent_namespace(policy: KubernetesConfig) -> str:
    if policy.budget_namespace:
        return policy.budget_namespace
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    with contextlib.suppress(OSError):
        text = (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip()
        if text:
            return text
    return "node-health"


def classify(exc: BaseException) -> str:
    """The error kind of nodehealth_kube_errors_total."""
    if isinstance(exc, ApiException):
        status = exc.status or 0
        if status == 409:
            return "conflict"
        if status == 429:
            return "throttled"
        if status in (401, 403):
            return "forbidden"
        if status == 404:
            return "not_found"
        if status >= 500:
            return "server"
        return "other"
    if isinstance(exc, BudgetConflict):
        return "conflict"
    if isinstance(exc, urllib3.exceptions.NewConnectionError):
        return "unreachable"  # a subclass of ConnectTimeoutError in urllib3 2, yet "connection refused"
    if isinstance(exc, (urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ConnectTimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(exc, urllib3.exceptions.MaxRetryError):
        return classify(exc.reason) if exc.reason is not None else "unreachable"
    if isinstance(exc, (urllib3.exceptions.HTTPError, OSError)):
        return "unreachable"
    if isinstance(exc, kubernetes.config.ConfigException):
        return "config"
    return "other"


def _retry_after(exc: BaseException) -> float:
    headers = getattr(exc, "headers", None)
    if not headers:
        return 0.0
    try:
        return float(headers.get("Retry-After") or 0)
    except (TypeError, ValueError):
        return 0.0


def rfc3339(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _json(response: Any) -> dict[str, Any]:
    try:
        return json.loads(response.data or b"{}")
    finally:
        response.release_conn()


def _taint_id(taint: dict[str, Any]) -> tuple[str, str, str]:
    return (taint.get("key", ""), taint.get("value", "") or "", taint.get("effect", ""))


def _fingerprint(desired: Desired) -> tuple[Any, ...]:
    """What decides a write; messages only ride along (they change with every number a probe measures)."""
    return (
        tuple((t.category, t.action, t.reason, t.effect) for t in desired.taints),
        tuple((c.type, c.action, c.status, c.reason) for c in desired.conditions),
        desired.ready_label,
    )


class KubeAgent:
    def __init__(
        self,
        config: Config,
        node_name: str,
        snapshot: Callable[[], Snapshot],
        api_client: kubernetes.client.ApiClient | None = None,
        *,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self._config = config
        self.node = node_name
        self._snapshot = snapshot
        self._client = api_client
        self._owns_client = api_client is None
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()  # counters and status
        self._pass_lock = threading.Lock()  # one reconcile at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._core_api: kubernetes.client.CoreV1Api | None = None
        self._budget_obj: TaintBudget | None = None

        self._applied: tuple[Any, ...] | None = None
        self._dirty = True
        self._next_heartbeat = 0.0
        self._retry_at = 0.0
        self._failures = 0
        self._slot_held: bool | None = None  # None: not known yet (a previous run may hold one)
        self._suppressed: dict[str, str] = {}
        self._budget_retry_at = 0.0
        self._budget_seen: BudgetResult | None = None
        self._events_seen: set[tuple[str, str, str, str]] = set()
        self._events: deque[tuple[str, str, bool]] = deque(maxlen=100)

        self._writes: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._recent_writes: deque[dict[str, Any]] = deque(maxlen=20)
        self._would_write: list[dict[str, Any]] = []
        self._last_would_logged: list[str] = []
        self._last_error = ""
        self._last_success: float | None = None
        self._last_attempt: float | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kube-reconciler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._owns_client and self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = self._core_api = None

    def reconfigure(self, config: Config) -> None:
        with self._lock:
            self._config = config
            self._dirty = True
            self._budget_obj = None

    def reconcile_once(self) -> None:
        """One pass now, whatever the backoff says (tests; the thread honours the backoff)."""
        self._attempt()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._clock() >= self._retry_at:
                self._attempt()
            self._stop.wait(self._config.kubernetes.poll_seconds)

    def _attempt(self) -> None:
        with self._pass_lock:
            self._last_attempt = self._clock()
            try:
                self._pass()
            except Exception as exc:  # noqa: BLE001 - any API or client failure backs off, never kills the loop
                self._failed(exc)
            else:
                self._failures = 0
                self._retry_at = 0.0
                self._last_success = self._clock()

    def _failed(self, exc: BaseException) -> None:
        kind = classify(exc)
        policy = self._config.kubernetes
        self._failures += 1
        ceiling = min(policy.backoff_max_seconds, policy.backoff_initial_seconds * 2 ** min(self._failures - 1, 30))
        delay = ceiling / 2 + self._rng.uniform(0, ceiling / 2)  # jitter: 1,000 nodes must not retry in step
        delay = max(delay, min(_retry_after(exc), policy.backoff_max_seconds))
        with self._lock:
            self._errors[kind] += 1
            self._dirty = True
            self._retry_at = self._clock() + delay
            self._last_error = f"{kind}: {_short(exc)}"
        if kind == "other":
            log.warning("kubernetes: unexpected error, retrying in %.1fs", delay, exc_info=exc)
        else:
            log.warning("kubernetes: %s; retrying in %.1fs", self._last_error, delay)

    # --- API -----------------------------------------------------------------------------------

    def _core(self) -> kubernetes.client.CoreV1Api:
        if self._core_api is None:
            if self._client is None:
                self._client = load_api_client(self._config)
            self._core_api = kubernetes.client.CoreV1Api(self._client)
        return self._core_api

    def _budget(self, policy: KubernetesConfig) -> TaintBudget:
        if self._budget_obj is None:
            self._budget_obj = TaintBudget(
                self._core,
                self.node,
                agent_namespace(policy),
                policy.budget_configmap,
                policy.key_prefix,
                self._clock,
                policy.request_timeout_seconds,
                lambda what: self._wrote("budget", what),
            )
        return self._budget_obj

    def _get_node(self, policy: KubernetesConfig) -> dict[str, Any]:
        return _json(
            self._core().read_node(self.node, _preload_content=False, _request_timeout=policy.request_timeout_seconds)
        )

    def _wrote(self, kind: str, what: str) -> None:
        with self._lock:
            self._writes[kind] += 1
            self._recent_writes.append({"at": rfc3339(self._clock()), "kind": kind, "what": what})
        log.info("kubernetes: wrote %s: %s", kind, what)

    def _would(self, kind: str, what: str, body: Any) -> None:
        self._would_write.append({"kind": kind, "what": what, "body": body})

    # --- one pass ------------------------------------------------------------------------------

    def _pass(self) -> None:
        config = self._config
        policy = config.kubernetes
        if not policy.enabled:
            return
        now = self._clock()
        desired = desired_state(self._snapshot(), policy)
        self._queue_finding_events(desired.events)
        fingerprint = _fingerprint(desired)
        due = (
            self._dirty
            or fingerprint != self._applied
            or now >= self._next_heartbeat
            or (bool(self._suppressed) and now >= self._budget_retry_at)
        )
        if due:
            self._would_write = []
            heartbeat = now >= self._next_heartbeat
            node = self._get_node(policy)
            node, suppressed = self._apply_taints(node, desired, policy, now)
            self._apply_conditions(node, desired, policy, now, suppressed, heartbeat)
            if heartbeat:
                self._next_heartbeat = now + policy.heartbeat_seconds
            self._suppressed = suppressed
            if suppressed:
                self._budget_retry_at = now + policy.budget_retry_seconds
            self._applied = fingerprint
            self._dirty = False
            self._log_would_writes(policy)
        self._flush_events(policy, now)

    def _log_would_writes(self, policy: KubernetesConfig) -> None:
        if not policy.dry_run:
            return
        lines = [f"{w['kind']}: {w['what']}" for w in self._would_write]
        if lines != self._last_would_logged:
            for line in lines:
                log.info("kubernetes dry-run: would write %s", line)
            self._last_would_logged = lines

    # --- taints, label, budget -----------------------------------------------------------------

    def _apply_taints(
        self, node: dict[str, Any], desired: Desired, policy: KubernetesConfig, now: float
    ) -> tuple[dict[str, Any], dict[str, str]]:
        prefix = policy.key_prefix
        owned = {taint_key(prefix, category): category for category in CATEGORIES}
        label_key = ready_label_key(prefix)
        suppressed: dict[str, str] = {}
        for attempt in range(policy.conflict_retries + 1):
            metadata = node.get("metadata") or {}
            current: list[dict[str, Any]] = list((node.get("spec") or {}).get("taints") or [])
            ours: dict[str, dict[str, Any]] = {}
            for taint in current:
                if taint.get("key") in owned:
                    ours.setdefault(owned[taint["key"]], taint)
            planned: dict[str, dict[str, Any]] = {}
            for intent in desired.taints:
                existing = ours.get(intent.category)
                if intent.action == "set":
                    wanted = {
                        "key": taint_key(prefix, intent.category),
                        "value": intent.reason,
                        "effect": intent.effect,
                    }
                    same = existing is not None and _taint_id(existing) == _taint_id(wanted)
                    planned[intent.category] = existing if same and existing is not None else wanted
                elif intent.action == "hold" and existing is not None:
                    planned[intent.category] = existing

            had_blocking = any(t.get("effect") in BLOCKING_EFFECTS for t in ours.values())
            wants_blocking = [c for c, t in planned.items() if t["effect"] in BLOCKING_EFFECTS]
            suppressed = {}
            if wants_blocking and not had_blocking and self._slot_held is not True:
                result = self._take_slot(policy, planned)
                if not result.granted:
                    for category in wants_blocking:
                        suppressed[category] = planned.pop(category)["value"]
            elif wants_blocking and self._slot_held is not True:
                self._take_slot(policy, planned)  # a node tainted by a previous run registers its slot

            foreign = [t for t in current if t.get("key") not in owned]
            mine = [planned[c] for c in CATEGORIES if c in planned]
            new_taints = foreign + mine
            labels = metadata.get("labels") or {}
            label_value = desired.ready_label if desired.ready_label is not None else labels.get(label_key, "false")

            patch: dict[str, Any] = {}
            taints_changed = {_taint_id(t) for t in current if t.get("key") in owned} != {
                _taint_id(t) for t in mine
            } or len(current) != len(new_taints)
            if taints_changed:
                patch["spec"] = {"taints": new_taints}
            if labels.get(label_key) != label_value:
                patch.setdefault("metadata", {})["labels"] = {label_key: label_value}
            if not patch:
                break
            patch.setdefault("metadata", {})["resourceVersion"] = metadata.get("resourceVersion")
            what = _describe_taint_change(current, new_taints, owned, label_key, labels.get(label_key), label_value)
            if policy.dry_run:
                self._would("node", what, patch)
                node = _apply_locally(node, new_taints, label_key, label_value)
                break
            try:
                node = _json(
                    self._core().patch_node(
                        self.node,
                        patch,
                        _content_type=STRATEGIC_MERGE,
                        _preload_content=False,
                        _request_timeout=policy.request_timeout_seconds,
                    )
                )
            except ApiException as exc:
                if exc.status != 409 or attempt == policy.conflict_retries:
                    raise
                with self._lock:
                    self._errors["conflict"] += 1
                node = self._get_node(policy)  # another controller wrote: redo the edit on its version
                continue
            self._wrote("node", what)
            break

        final_blocking = any(
            t.get("key") in owned and t.get("effect") in BLOCKING_EFFECTS
            for t in (node.get("spec") or {}).get("taints") or []
        )
        if not final_blocking and self._slot_held is not False:
            if policy.dry_run:
                if self._slot_held:
                    self._would("budget", "release this node's slot", None)
            else:
                self._budget(policy).release()
                self._slot_held = False
        return node, suppressed

    def _take_slot(self, policy: KubernetesConfig, planned: dict[str, dict[str, Any]]) -> BudgetResult:
        budget = self._budget(policy)
        taints = ",".join(f"{c}={t['value']}" for c, t in sorted(planned.items()) if t["effect"] in BLOCKING_EFFECTS)
        if policy.dry_run:
            usage = budget.usage(policy.max_unhealthy, policy.budget_node_selector, policy.budget_grace_seconds)
            granted = usage.granted or usage.used < usage.limit
            result = BudgetResult(
                granted, usage.used + (0 if usage.granted else int(granted)), usage.limit, usage.nodes
            )
            if granted and not usage.granted:
                self._would("budget", f"take a slot for {taints}", None)
        else:
            result = budget.acquire(
                policy.max_unhealthy, policy.budget_node_selector, policy.budget_grace_seconds, taints
            )
            self._slot_held = result.granted or self._slot_held
        self._budget_seen = result
        if not result.granted:
            log.warning(
                "kubernetes: taint budget spent (%d of %d nodes hold a slot): not tainting for %s",
                result.used,
                result.limit,
                taints,
            )
        return result

    # --- conditions and events -----------------------------------------------------------------

    def _apply_conditions(
        self,
        node: dict[str, Any],
        desired: Desired,
        policy: KubernetesConfig,
        now: float,
        suppressed: dict[str, str],
        heartbeat: bool,
    ) -> None:
        existing = {c.get("type"): c for c in (node.get("status") or {}).get("conditions") or []}
        stamp = rfc3339(now)
        items: list[dict[str, Any]] = []
        transitions: list[tuple[str, str, str, str, str]] = []
        for intent in desired.conditions:
            old = existing.get(intent.type)
            if intent.action == "absent":
                if old is not None:
                    items.append({"type": intent.type, "$patch": "delete"})
                continue
            if intent.action == "hold":
                if old is not None:
                    continue  # a previous run's condition stands until this run has results
                status, reason, message = "Unknown", WARMING_UP, intent.message
            else:
                status, reason, message = intent.status, intent.reason, intent.message
            if intent.category in suppressed:
                status, reason = "False", TAINT_SUPPRESSED
                seen = self._budget_seen
                spent = f" ({seen.used} of {seen.limit} slots taken)" if seen else ""
                message = _clip(
                    f"not tainted {taint_key(policy.key_prefix, intent.category)}={suppressed[intent.category]}: "
                    f"the cluster taint budget is spent{spent}; {message}"
                )
            changed = old is None or old.get("status") != status or old.get("reason") != reason
            if not changed and not heartbeat:
                continue
            flipped = old is None or old.get("status") != status
            items.append(
                {
                    "type": intent.type,
                    "status": status,
                    "reason": reason,
                    "message": message,
                    "lastHeartbeatTime": stamp,
                    "lastTransitionTime": stamp if flipped else old.get("lastTransitionTime") or stamp,
                }
            )
            if changed and not (old is None and status == "Unknown"):
                before = old.get("status") if old else "absent"
                transitions.append((intent.type, status, reason, message, before))
        if not items:
            return
        body = {"status": {"conditions": items}}
        what = ", ".join(
            f"{i['type']}=" + ("(removed)" if i.get("$patch") else f"{i['status']}/{i['reason']}") for i in items
        )
        if policy.dry_run:
            self._would("node_status", what, body)
            return
        response = self._core().patch_node_status(
            self.node,
            body,
            _content_type=STRATEGIC_MERGE,
            _preload_content=False,
            _request_timeout=policy.request_timeout_seconds,
        )
        _json(response)
        self._wrote("node_status", what)
        for condition_type, status, reason, message, before in transitions:
            self._events.append(
                (reason, _clip(f"{condition_type}: {before} -> {status}: {message}"), status == "False")
            )

    def _queue_finding_events(self, events: tuple[FindingEvent, ...]) -> None:
        keys = set()
        for event in events:
            key = (event.check, event.subject, event.reason, event.message)
            keys.add(key)
            if key not in self._events_seen:
                self._events.append(
                    (event.reason, _clip(f"{event.check} {event.subject}: {event.message}"), event.warning)
                )
        # An event that left the snapshot and comes back is a new occurrence.
        self._events_seen = keys

    def _flush_events(self, policy: KubernetesConfig, now: float) -> None:
        while self._events:
            reason, message, warning = self._events[0]
            if policy.dry_run:
                self._would("event", f"{reason}: {message}", None)
                self._events.popleft()
                continue
            stamp = datetime.datetime.fromtimestamp(now, tz=datetime.timezone.utc)
            body = kubernetes.client.CoreV1Event(
                metadata=kubernetes.client.V1ObjectMeta(
                    name=f"{self.node}.{int(now * 1e6):x}{self._rng.randrange(16**4):04x}",
                    namespace=policy.events_namespace,
                ),
                # uid = node name, as kubelet and node-problem-detector do, so `kubectl describe node` shows it
                involved_object=kubernetes.client.V1ObjectReference(
                    api_version="v1", kind="Node", name=self.node, uid=self.node
                ),
                reason=reason,
                message=message,
                type="Warning" if warning else "Normal",
                source=kubernetes.client.V1EventSource(component=COMPONENT, host=self.node),
                reporting_component=COMPONENT,
                reporting_instance=self.node,
                first_timestamp=stamp,
                last_timestamp=stamp,
                count=1,
            )
            _json(
                self._core().create_namespaced_event(
                    policy.events_namespace,
                    body,
                    _preload_content=False,
                    _request_timeout=policy.request_timeout_seconds,
                )
            )
            self._events.popleft()
            self._wrote("event", f"{reason}: {message}")

    # --- reporting -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        policy = self._config.kubernetes
        with self._lock:
            seen = self._budget_seen
            return {
                "enabled": policy.enabled,
                "dry_run": policy.dry_run,
                "node": self.node,
                "last_attempt": rfc3339(self._last_attempt) if self._last_attempt else None,
                "last_success": rfc3339(self._last_success) if self._last_success else None,
                "writes": {kind: self._writes[kind] for kind in WRITE_KINDS},
                "recent_writes": list(self._recent_writes),
                "would_write": [{"kind": w["kind"], "what": w["what"]} for w in self._would_write]
                if policy.dry_run
                else [],
                "budget": {
                    "max_unhealthy": policy.max_unhealthy,
                    "slot_held": self._slot_held,
                    "used": seen.used if seen else None,
                    "limit": seen.limit if seen else None,
                    "suppressed": dict(self._suppressed),
                },
                "errors": {kind: n for kind, n in self._errors.items() if n},
                "last_error": self._last_error,
                "backoff_seconds": round(max(0.0, self._retry_at - self._clock()), 3) if self._retry_at else 0.0,
            }

    def samples(self) -> list[Sample]:
        prefix = self._config.kubernetes.key_prefix
        out: list[Sample] = []
        with self._lock:
            for kind in WRITE_KINDS:
                out.append(
                    Sample(
                        "nodehealth_kube_writes_total",
                        "Writes the agent made to the Kubernetes API, by kind",
                        float(self._writes[kind]),
                        {"kind": kind},
                        "counter",
                    )
                )
            for kind in ERROR_KINDS:
                out.append(
                    Sample(
                        "nodehealth_kube_errors_total",
                        "Kubernetes API errors, by kind (409 conflicts are retried at once; others back off)",
                        float(self._errors[kind]),
                        {"kind": kind},
                        "counter",
                    )
                )
            for category, reason in sorted(self._suppressed.items()):
                out.append(
                    Sample(
                        "nodehealth_taint_suppressed",
                        "1 while a taint is not added because the cluster taint budget is spent",
                        1.0,
                        {"category": category, "reason": reason, "taint": taint_key(prefix, category)},
                    )
                )
            out.append(
                Sample(
                    "nodehealth_kube_budget_slot_held",
                    "1 while this node holds a slot of the cluster taint budget",
                    1.0 if self._slot_held else 0.0,
                )
            )
            if self._last_success is not None:
                out.append(
                    Sample(
                        "nodehealth_kube_last_success_timestamp_seconds",
                        "When the last reconcile with the Kubernetes API succeeded",
                        self._last_success,
                    )
                )
            out.append(
                Sample(
                    "nodehealth_kube_dry_run_pending_writes",
                    "Writes a dry run would make now",
                    float(len(self._would_write)) if self._config.kubernetes.dry_run else 0.0,
                )
            )
        return out


def _clip(text: str) -> str:
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 1] + "…"


def _short(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        message = ""
        with contextlib.suppress(ValueError, TypeError):
            message = json.loads(exc.body or "{}").get("message", "")
        return f"HTTP {exc.status} {exc.reason or ''} {message}".strip()
    return f"{type(exc).__name__}: {exc}"[:300]


def _describe_taint_change(
    current: list[dict[str, Any]],
    new: list[dict[str, Any]],
    owned: dict[str, str],
    label_key: str,
    old_label: str | None,
    new_label: str,
) -> str:
    def fmt(t: dict[str, Any]) -> str:
        return f"{t['key']}={t.get('value', '')}:{t['effect']}"

    before = {fmt(t) for t in current if t.get("key") in owned}
    after = {fmt(t) for t in new if t.get("key") in owned}
    parts = [f"+taint {t}" for t in sorted(after - before)] + [f"-taint {t}" for t in sorted(before - after)]
    if old_label != new_label:
        parts.append(f"label {label_key}={new_label}")
    return ", ".join(parts) or "taint order"


def _apply_locally(node: dict[str, Any], taints: list[dict[str, Any]], label_key: str, label: str) -> dict[str, Any]:
    """What the Node would look like after a dry-run write (so the rest of the pass reasons on it)."""
    out = dict(node)
    out["spec"] = {**(node.get("spec") or {}), "taints": taints}
    metadata = dict(node.get("metadata") or {})
    metadata["labels"] = {**(metadata.get("labels") or {}), label_key: label}
    out["metadata"] = metadata
    return out
