"""Shared pieces of the Kubernetes tests: a settable clock, health states built the real way, agents."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable
from typing import Any

import kubernetes.client
import pytest

from agent.config import parse_config
from agent.kube import KubeAgent
from agent.reasons import STALE, WARMING_UP
from agent.snapshot import CheckState, Snapshot, Verdict
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes.base import Event, Finding, Status
from support.kube_double import ApiDouble

PREFIX = "node-health"
BUDGET_NS = "node-health"
BLOCKING = ("NoSchedule", "NoExecute")
YEAR = 365 * 24 * 3600.0

# Fleet records (the budgets' `fleet` annotation) that are garbage: each must be counted again, never trusted.
GARBAGE_FLEETS = [
    '{"nodes": 1e999}',  # json.loads: infinity (int() of it raised OverflowError, and the agent never tainted)
    '{"nodes": 4, "selector": "", "counted_at": NaN}',  # never due again: a bogus count lifted the budget
    '{"nodes": 4, "selector": "", "counted_at": 1e999, "verified_at": 0}',
    '{"nodes": 4, "selector": "", "verified_at": -Infinity}',
    '{"nodes": -4, "selector": ""}',
    '{"nodes": 4000000000, "selector": ""}',  # a limit of 10% of that would taint the whole fleet
    '{"nodes": 2.5, "selector": ""}',
    '{"nodes": "4", "selector": ""}',
    '{"nodes": true, "selector": ""}',
    '{"nodes": 4, "selector": 7}',
    "[4]",
    '{"nodes": [[[[[[[[[[[[[[[[[[[[4]]]]]]]]]]]]]]]]]]]]}',
    "not json at all",
]

# probe name → its checks
DEFAULT_PROBES = {"storage": ("storage.mounts",), "npu": ("npu.health",), "time": ("time.sync",)}


class Clock:
    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def health_state(
    node: str,
    clock: Clock,
    probes: dict[str, tuple[str, ...]] | None = None,
    fail_threshold: int = 1,
    recovery_threshold: int = 1,
    interval: float = 30.0,
) -> HealthState:
    state = HealthState(
        node,
        HealthSettings(fail_threshold=fail_threshold, recovery_threshold=recovery_threshold),
        clock=clock,
        monotonic=clock,
    )
    configure(state, probes or DEFAULT_PROBES, interval)
    return state


def configure(state: HealthState, probes: dict[str, tuple[str, ...]], interval: float = 30.0) -> None:
    state.configure([ProbeSpec(name, checks, interval, 5.0) for name, checks in probes.items()])


def record(
    state: HealthState,
    probe: str,
    check: str,
    status: str,
    reason: str = "",
    event: Event | None = None,
    **observed: Any,
) -> None:
    status_value = Status(status)
    reason = reason or ("OK" if status_value == Status.OK else "Broken")
    hint = "" if status_value == Status.OK else "fix it"
    finding = Finding(check, "", status_value, reason, f"{check} is {status}", hint, observed, event=event)
    state.record(probe, [finding])


def all_ok(state: HealthState, probes: dict[str, tuple[str, ...]] | None = None) -> None:
    for probe, checks in (probes or DEFAULT_PROBES).items():
        state.record(probe, [Finding(check, "", Status.OK, "OK", f"{check} fine") for check in checks])


def finding(check: str, status: str = "ok", reason: str = "", message: str = "", **extra: Any) -> Finding:
    status_value = Status(status)
    reason = reason or ("OK" if status_value == Status.OK else "Broken")
    return Finding(check, extra.pop("subject", ""), status_value, reason, message or f"{check} is {status}", **extra)


def snapshot_of(*findings: Finding, node: str = "n1") -> Snapshot:
    """A snapshot built by hand: the verdict's reasons are the failing and unknown findings, as /ready says."""
    states = tuple(CheckState(f, f.check.split(".")[0], 1.0, 1.0, stale=f.reason == STALE.code) for f in findings)
    reasons = tuple(f for f in findings if f.status in (Status.FAIL, Status.UNKNOWN))
    return Snapshot(
        node=node,
        version=1,
        generated_at=1.0,
        checks=states,
        probes=(),
        samples=(),
        required=(),
        problem_counts={},
        verdict=Verdict(not reasons, reasons, 0.0),
    )


def warming(check: str) -> Finding:
    return Finding(check, "", Status.UNKNOWN, WARMING_UP.code, "no result yet")


def node_object(
    name: str = "n1",
    taints: list[dict[str, Any]] | None = None,
    labels: dict[str, str] | None = None,
    conditions: list[dict[str, Any]] | None = None,
    version: str = "7",
) -> dict[str, Any]:
    """A Node as the API returns it, for the pure planner."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "resourceVersion": version, "labels": dict(labels or {})},
        "spec": {"taints": list(taints or [])},
        "status": {"conditions": list(conditions or [])},
    }


def kube_config(**kube: Any) -> Any:
    settings: dict[str, Any] = {"budget_namespace": BUDGET_NS}
    settings.update(kube)
    return parse_config({"kubernetes": settings})


def make_agent(
    double: ApiDouble,
    state: HealthState,
    clock: Clock,
    seed: int = 0,
    client: kubernetes.client.ApiClient | None = None,
    monotonic: Clock | None = None,
    **kube: Any,
) -> KubeAgent:
    """An agent on the double; agents of a simulated fleet share one `client` (one connection pool). Its timers
    run on `monotonic`, by default the same simulated clock as its wall clock."""
    return KubeAgent(
        kube_config(**kube),
        state.node,
        lambda: state.snapshot,
        client or double.client(),
        clock=clock,
        monotonic=monotonic or clock,
        rng=random.Random(seed),
    )


def passes_over_garbage(agents: list[KubeAgent], clock: Clock, caplog: pytest.LogCaptureFixture) -> int:
    """Every agent reconciles twice, a second apart, each pass succeeding; how many warnings said a budget's fleet
    record was garbage meanwhile (once per agent at most: logged once per garbage record, not on every pass)."""
    with caplog.at_level(logging.WARNING, logger="agent.kube"):
        for _ in range(2):
            for agent in agents:
                agent.reconcile_once()
            clock.advance(1)
    assert all(not a.last_error for a in agents), [a.last_error for a in agents]
    logged = [r for r in caplog.records if "fleet record is garbage" in r.getMessage()]
    assert len(logged) <= len(agents), "logged once (per agent), not on every pass"
    return len(logged)


def our_taints(node: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {
        t["key"].split("/", 1)[1]: (t.get("value", ""), t["effect"])
        for t in (node.get("spec") or {}).get("taints") or []
        if t["key"].startswith(PREFIX + "/")
    }


def foreign_taints(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for t in (node.get("spec") or {}).get("taints") or [] if not t["key"].startswith(PREFIX + "/")]


def conditions(node: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (node.get("status") or {}).get("conditions") or []}


def labels(node: dict[str, Any]) -> dict[str, str]:
    return dict(node["metadata"].get("labels") or {})


def slots(double: ApiDouble, name: str = "node-health-budget") -> dict[str, str] | None:
    """The budget's slots (node → record); None when there is no ConfigMap."""
    configmap = double.configmap(BUDGET_NS, name)
    if configmap is None:
        return None
    return dict(configmap.get("data") or {})


def budget_configmap(data: dict[str, str], fleet: dict[str, object] | None = None) -> dict[str, object]:
    """A budget ConfigMap as agents write it: slots in data, the fleet record in an annotation."""
    annotations = {f"{PREFIX}/slots": str(len(data))}
    if fleet is not None:
        annotations[f"{PREFIX}/fleet"] = json.dumps(fleet)
    return {"metadata": {"name": "node-health-budget", "annotations": annotations}, "data": data}


def fleet_record(double: ApiDouble) -> dict[str, object]:
    configmap = double.configmap(BUDGET_NS, "node-health-budget") or {}
    return dict(json.loads(configmap["metadata"]["annotations"][f"{PREFIX}/fleet"]))


def blocking_tainted(nodes: Iterable[dict[str, Any]]) -> list[str]:
    return [
        n["metadata"]["name"]
        for n in nodes
        if any(
            t["key"].startswith(PREFIX + "/") and t["effect"] in BLOCKING
            for t in (n.get("spec") or {}).get("taints") or []
        )
    ]
