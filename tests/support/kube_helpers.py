"""Shared pieces of the Kubernetes tests: a settable clock, health states built the real way, agents."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from agent.config import parse_config
from agent.kube import KubeAgent
from agent.state import HealthState, ProbeSpec
from probes.base import Event, Finding, Status
from support.kube_double import ApiDouble

PREFIX = "node-health"
BUDGET_NS = "node-health"
BLOCKING = ("NoSchedule", "NoExecute")

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
        fail_threshold=fail_threshold,
        recovery_threshold=recovery_threshold,
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


def kube_config(**kube: Any) -> Any:
    settings: dict[str, Any] = {"budget_namespace": BUDGET_NS}
    settings.update(kube)
    return parse_config({"kubernetes": settings})


def make_agent(double: ApiDouble, state: HealthState, clock: Clock, seed: int = 0, **kube: Any) -> KubeAgent:
    return KubeAgent(
        kube_config(**kube),
        state.node,
        lambda: state.snapshot,
        double.client(),
        clock=clock,
        rng=random.Random(seed),
    )


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


def blocking_tainted(nodes: Iterable[dict[str, Any]]) -> list[str]:
    return [
        n["metadata"]["name"]
        for n in nodes
        if any(
            t["key"].startswith(PREFIX + "/") and t["effect"] in BLOCKING
            for t in (n.get("spec") or {}).get("taints") or []
        )
    ]
