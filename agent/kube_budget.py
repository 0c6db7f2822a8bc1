"""The cluster taint budget: at most `max_unhealthy` nodes carry a NoSchedule/NoExecute node-health taint.

Slots live in one ConfigMap, one data key per node holding a slot (`{"acquired_at": epoch, "taints": ...}`).
Every change is a compare-and-swap on the ConfigMap's resourceVersion (PUT with it; 409 → read again), so
100 agents failing at the same instant (a DNS outage) take at most the budget between them. Slots of nodes
that are gone, or that no longer carry a blocking taint once a grace period has passed (an agent that died
between taking a slot and tainting), are pruned by whoever writes next. Nodes that carry a blocking taint
without a slot (a ConfigMap deleted by hand) count as holders too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kubernetes.client
from kubernetes.client.rest import ApiException

from agent.kube_policy import BLOCKING_EFFECTS


class BudgetConflict(Exception):
    """The ConfigMap kept changing under us: every compare-and-swap attempt lost."""


@dataclass(frozen=True)
class BudgetResult:
    granted: bool
    used: int  # slots held after this call (ours included when granted)
    limit: int
    nodes: int
    wrote: bool = False


def budget_limit(max_unhealthy: str, nodes: int) -> int:
    """A count, or a percentage of nodes rounded up (10% of 5 nodes is 1, as for a DaemonSet's maxUnavailable)."""
    text = max_unhealthy.strip()
    if text.endswith("%"):
        return math.ceil(nodes * float(text[:-1]) / 100.0 - 1e-9)
    return int(float(text))


class TaintBudget:
    def __init__(
        self,
        api: Callable[[], kubernetes.client.CoreV1Api],
        node: str,
        namespace: str,
        name: str,
        taint_prefix: str,
        clock: Callable[[], float],
        request_timeout: float,
        on_write: Callable[[str], None],
    ) -> None:
        self._api = api
        self.node = node
        self.namespace = namespace
        self.name = name
        self.taint_prefix = taint_prefix
        self._clock = clock
        self._timeout = request_timeout
        self._on_write = on_write
        self.attempts = 10

    # --- API helpers ---------------------------------------------------------------------------

    def _read(self) -> tuple[dict[str, str], str | None]:
        try:
            response = self._api().read_namespaced_config_map(
                self.name, self.namespace, _preload_content=False, _request_timeout=self._timeout
            )
        except ApiException as exc:
            if exc.status == 404:
                return {}, None
            raise
        body = _json(response)
        return dict(body.get("data") or {}), body["metadata"]["resourceVersion"]

    def _write(self, data: dict[str, str], resource_version: str | None, what: str) -> bool:
        """CAS; False when somebody else wrote first."""
        body = kubernetes.client.V1ConfigMap(
            api_version="v1",
            kind="ConfigMap",
            metadata=kubernetes.client.V1ObjectMeta(
                name=self.name,
                namespace=self.namespace,
                resource_version=resource_version,
                labels={"app.kubernetes.io/name": "node-health", "app.kubernetes.io/component": "taint-budget"},
            ),
            data=dict(sorted(data.items())),
        )
        try:
            if resource_version is None:
                self._api().create_namespaced_config_map(
                    self.namespace, body, _preload_content=False, _request_timeout=self._timeout
                )
            else:
                self._api().replace_namespaced_config_map(
                    self.name, self.namespace, body, _preload_content=False, _request_timeout=self._timeout
                )
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        self._on_write(what)
        return True

    def _nodes(self, selector: str) -> dict[str, bool]:
        """Node name → whether it carries a blocking taint of ours."""
        response = self._api().list_node(
            label_selector=selector or None, _preload_content=False, _request_timeout=self._timeout
        )
        out = {}
        for item in _json(response).get("items") or []:
            taints = (item.get("spec") or {}).get("taints") or []
            out[item["metadata"]["name"]] = any(
                t.get("key", "").startswith(self.taint_prefix + "/") and t.get("effect") in BLOCKING_EFFECTS
                for t in taints
            )
        return out

    # --- operations ----------------------------------------------------------------------------

    def acquire(self, max_unhealthy: str, selector: str, grace_seconds: float, taints: str) -> BudgetResult:
        """Take (or confirm) this node's slot. A node already carrying a blocking taint always gets one."""
        for _ in range(self.attempts):
            data, version = self._read()
            nodes = self._nodes(selector)
            limit = budget_limit(max_unhealthy, len(nodes))
            if self.node in data:
                return BudgetResult(True, len(self._holders(data, nodes, grace_seconds)), limit, len(nodes))
            kept = self._prune(data, nodes, grace_seconds)
            holders = self._holders(kept, nodes, grace_seconds)
            if self.node not in holders and len(holders) >= limit:
                if kept != data and self._write(kept, version, f"pruned {sorted(set(data) - set(kept))}"):
                    return BudgetResult(False, len(holders), limit, len(nodes), wrote=True)
                if kept != data:
                    continue
                return BudgetResult(False, len(holders), limit, len(nodes))
            kept[self.node] = json.dumps({"acquired_at": round(self._clock(), 3), "taints": taints}, sort_keys=True)
            if self._write(kept, version, f"took a slot ({len(holders) + 1} of {limit}) for {taints}"):
                return BudgetResult(True, len(holders | {self.node}), limit, len(nodes), wrote=True)
        raise BudgetConflict(f"configmap {self.namespace}/{self.name}: {self.attempts} compare-and-swap attempts lost")

    def release(self) -> bool:
        """Give the slot back; True when a write happened."""
        for _ in range(self.attempts):
            data, version = self._read()
            if self.node not in data or version is None:
                return False
            del data[self.node]
            if self._write(data, version, "released this node's slot"):
                return True
        raise BudgetConflict(f"configmap {self.namespace}/{self.name}: {self.attempts} compare-and-swap attempts lost")

    def usage(self, max_unhealthy: str, selector: str, grace_seconds: float) -> BudgetResult:
        data, _ = self._read()
        nodes = self._nodes(selector)
        holders = self._holders(data, nodes, grace_seconds)
        return BudgetResult(self.node in data, len(holders), budget_limit(max_unhealthy, len(nodes)), len(nodes))

    def _prune(self, data: dict[str, str], nodes: dict[str, bool], grace_seconds: float) -> dict[str, str]:
        now = self._clock()
        kept = {}
        for node, raw in data.items():
            if node not in nodes:
                continue  # the node is gone (or left the pool the budget counts)
            if not nodes[node] and now - _acquired_at(raw) > grace_seconds:
                continue  # no longer tainted: the slot came back
            kept[node] = raw
        return kept

    def _holders(self, data: dict[str, str], nodes: dict[str, bool], grace_seconds: float) -> set[str]:
        return set(self._prune(data, nodes, grace_seconds)) | {n for n, tainted in nodes.items() if tainted}


def _acquired_at(raw: str) -> float:
    try:
        value = json.loads(raw).get("acquired_at", 0.0)
        return float(value)
    except (ValueError, AttributeError, TypeError):
        return 0.0


def _json(response: Any) -> dict[str, Any]:
    try:
        return json.loads(response.data or b"{}")
    finally:
        response.release_conn()
