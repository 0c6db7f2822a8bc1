"""What the reconciler shows: its part of `/status` and its metrics."""

from __future__ import annotations

from collections import Counter, deque
from typing import Any, Protocol

from agent.config import KubernetesConfig
from agent.kube.client import ERROR_KINDS
from agent.kube.node.events import EventQueue
from agent.kube.node.policy import taint_key
from agent.timestamps import rfc3339
from probes.base import Sample

WRITE_KINDS = ("node", "node_status", "event", "budget", "device_rule", "public_fault", "device_budget")


class Reporting(Protocol):
    """What the reconciler shows (agent.kube.reconciler.KubeAgent)."""

    node: str
    events: EventQueue
    writes: Counter[str]
    errors: Counter[str]
    recent_writes: deque[dict[str, Any]]
    would_write: list[dict[str, Any]]
    last_error: str
    last_success: float | None
    last_attempt: float | None

    @property
    def suppressed(self) -> dict[str, str]: ...

    @property
    def slot_held(self) -> bool | None: ...

    @property
    def backoff_seconds(self) -> float: ...


def status_document(agent: Reporting, policy: KubernetesConfig, budget: dict[str, Any]) -> dict[str, Any]:
    return {
        "enabled": policy.enabled,
        "dry_run": policy.dry_run,
        "node": agent.node,
        "last_attempt": rfc3339(agent.last_attempt) if agent.last_attempt else None,
        "last_success": rfc3339(agent.last_success) if agent.last_success else None,
        "writes": {kind: agent.writes[kind] for kind in WRITE_KINDS},
        "recent_writes": list(agent.recent_writes),
        "would_write": [{"kind": w["kind"], "what": w["what"]} for w in agent.would_write] if policy.dry_run else [],
        "budget": budget,
        "errors": {kind: n for kind, n in agent.errors.items() if n},
        "last_error": agent.last_error,
        "backoff_seconds": agent.backoff_seconds,
        "events": {
            "queued": len(agent.events),
            "dropped": agent.events.dropped,
            "errors": {kind: n for kind, n in agent.events.errors.items() if n},
            "last_error": agent.events.last_error,
        },
    }


def _counters(agent: Reporting) -> list[Sample]:
    out = [
        Sample(
            "nodehealth_kube_writes_total",
            "Writes the agent made to the Kubernetes API, by kind",
            float(agent.writes[kind]),
            {"kind": kind},
            "counter",
        )
        for kind in WRITE_KINDS
    ]
    out += [
        Sample(
            "nodehealth_kube_errors_total",
            "Kubernetes API errors that failed a reconcile pass, by kind (409 conflicts are retried at once)",
            float(agent.errors[kind]),
            {"kind": kind},
            "counter",
        )
        for kind in ERROR_KINDS
    ]
    return out + [
        Sample(
            "nodehealth_kube_event_errors_total",
            "Events the API refused or did not answer, by kind; they never fail a reconcile pass",
            float(agent.events.errors[kind]),
            {"kind": kind},
            "counter",
        )
        for kind in ERROR_KINDS
    ]


def status_samples(agent: Reporting, policy: KubernetesConfig) -> list[Sample]:
    out = _counters(agent)
    out += [
        Sample(
            "nodehealth_taint_suppressed",
            "1 while a taint is not added because the cluster taint budget is spent",
            1.0,
            {"category": category, "reason": reason, "taint": taint_key(policy.key_prefix, category)},
        )
        for category, reason in sorted(agent.suppressed.items())
    ]
    out.append(
        Sample(
            "nodehealth_kube_budget_slot_held",
            "1 while this node holds a slot of the cluster taint budget",
            1.0 if agent.slot_held else 0.0,
        )
    )
    if agent.last_success is not None:
        out.append(
            Sample(
                "nodehealth_kube_last_success_timestamp_seconds",
                "When the last reconcile with the Kubernetes API succeeded",
                agent.last_success,
            )
        )
    out.append(
        Sample(
            "nodehealth_kube_dry_run_pending_writes",
            "Writes a dry run would make now",
            float(len(agent.would_write)) if policy.dry_run else 0.0,
        )
    )
    return out
