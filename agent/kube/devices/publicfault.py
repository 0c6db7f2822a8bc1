"""MindCluster ClusterD public faults: per-chip NPU problems in the agent's own ConfigMap, which ClusterD reads.

One ConfigMap per node, `<prefix>-publicfault-<node>` in `kubernetes.mindcluster.public_fault.namespace`, labelled
`mc-consumer-publicfault: "true"` (what ClusterD watches) and as the agent's, with the node's name. Its key
`PublicFault` holds one message in ClusterD's format:

    {"id", "timestamp" (ms), "version": "1.0", "resource": <sender>, "faults": [{"faultId", "faultType": "NPU",
     "faultCode", "faultTime" (ms), "assertion": "occur" | "recover", "influence": [{"nodeName",
     "deviceIds": [<physical id>]}], "description"}]}

One fault per chip and fault code. A fault keeps its faultId and faultTime from `occur` to `recover` (ClusterD
matches them). Deleting the ConfigMap does not clear a fault, and a watcher may see only the latest version of
it, so a recovered fault stays in the message, as `recover`, until the same chip has the same code again; at most
100 faults (ClusterD's limit), the oldest recoveries going first. Every write is a compare-and-swap on the
ConfigMap's resourceVersion. The annotation `<prefix>/isolated` lists the agent's device names with an `occur`
(what the device budget counts).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.kube.client import KubeApi, is_status

CONSUMER_LABEL = "mc-consumer-publicfault"
DATA_KEY = "PublicFault"
LABELS = {
    CONSUMER_LABEL: "true",
    "app.kubernetes.io/name": "node-health",
    "app.kubernetes.io/component": "public-fault",
}
MAX_FAULTS = 100
DESCRIPTION_LIMIT = 512
FaultKey = tuple[int, str]  # (physical id, fault code)


@dataclass(frozen=True)
class ActiveFault:
    """A chip problem that should be an `occur`: the device's name in the agent and what to say."""

    device: str
    physical_id: int
    code: str
    description: str


def configmap_name(prefix: str, node: str) -> str:
    name = f"{prefix}-publicfault-{node}"
    if len(name) <= 253:
        return name
    return f"{prefix}-publicfault-{hashlib.sha256(node.encode()).hexdigest()[:32]}"


def own_selector(prefix: str, node_label: str | None = None) -> str:
    base = ",".join(f"{k}={v}" for k, v in LABELS.items())
    return f"{base},{prefix}/node={node_label}" if node_label is not None else f"{base},{prefix}/node"


def _node_tag(node: str) -> str:
    return hashlib.sha256(node.encode()).hexdigest()[:12]


def parse_faults(configmap: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The faults of a stored message (what is not one of ours in the expected shape is dropped)."""
    text = ((configmap or {}).get("data") or {}).get(DATA_KEY)
    try:
        faults = json.loads(text).get("faults") if isinstance(text, str) else None
    except (ValueError, AttributeError):
        return []
    return [
        f
        for f in faults or []
        if isinstance(f, dict)
        and isinstance(f.get("faultId"), str)
        and isinstance(f.get("faultCode"), str)
        and isinstance(f.get("faultTime"), int)
        and f.get("assertion") in ("occur", "recover")
        and _physical_id(f) is not None
    ]


def _physical_id(fault: Mapping[str, Any]) -> int | None:
    influence = fault.get("influence")
    if not isinstance(influence, list) or not influence or not isinstance(influence[0], dict):
        return None
    ids = influence[0].get("deviceIds")
    return ids[0] if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], int) else None


def fault_key(fault: Mapping[str, Any]) -> FaultKey:
    return (_physical_id(fault) or 0, str(fault["faultCode"]))


def plan_faults(
    existing: list[dict[str, Any]],
    active: Mapping[FaultKey, ActiveFault],
    keep: set[FaultKey],
    node: str,
    now_ms: int,
) -> list[dict[str, Any]]:
    """The next message's faults: an `occur` for each active one (new ones get a faultId and faultTime), and every
    other `occur` not in `keep` turned into a `recover`; recoveries stay until the same key occurs again."""
    out: dict[FaultKey, dict[str, Any]] = {}
    for fault in existing:
        key = fault_key(fault)
        if key in active and fault["assertion"] == "occur":
            out[key] = fault  # its description stays as first written: a number measured is no change
        elif key in active:
            continue  # recovered before, now back: a new fault instance below
        elif fault["assertion"] == "occur" and key in keep:
            out[key] = fault
        else:
            out[key] = {**fault, "assertion": "recover"}
    for key, wanted in active.items():
        if key not in out:
            out[key] = {
                "faultId": f"nh.{_node_tag(node)}.{wanted.physical_id}.{wanted.code}.{now_ms}",
                "faultType": "NPU",
                "faultCode": wanted.code,
                "faultTime": now_ms,
                "assertion": "occur",
                "influence": [{"nodeName": node, "deviceIds": [wanted.physical_id]}],
                "description": wanted.description[:DESCRIPTION_LIMIT],
            }
    faults = sorted(out.values(), key=lambda f: (f["assertion"] != "occur", -f["faultTime"], f["faultId"]))
    return faults[:MAX_FAULTS]


class PublicFaults:
    """This node's public-fault ConfigMap: read once, then written only when its faults change."""

    def __init__(
        self,
        api: KubeApi,
        node: str,
        node_label: str,
        namespace: str,
        sender: str,
        prefix: str,
        clock: Callable[[], float],
    ) -> None:
        self.api = api
        self.node = node
        self.node_label = node_label
        self.namespace = namespace
        self.sender = sender
        self.prefix = prefix
        self.name = configmap_name(prefix, node)
        self._clock = clock
        self._stored: dict[str, Any] | None = None
        self._loaded = False
        self._sequence = 0

    def load(self) -> None:
        if not self._loaded:
            self._stored = self.api.get_configmap(self.namespace, self.name)
            self._loaded = True

    def faults(self) -> list[dict[str, Any]]:
        self.load()
        return parse_faults(self._stored)

    def isolated_devices(self) -> list[str]:
        """The agent's names of the chips with an `occur` (the `<prefix>/isolated` annotation)."""
        self.load()
        annotations = ((self._stored or {}).get("metadata") or {}).get("annotations") or {}
        return [name for name in str(annotations.get(f"{self.prefix}/isolated", "")).split(",") if name]

    def occurring(self) -> dict[FaultKey, dict[str, Any]]:
        return {fault_key(f): f for f in self.faults() if f["assertion"] == "occur"}

    def write(self, active: Mapping[FaultKey, ActiveFault], keep: set[FaultKey], devices: set[str]) -> str:
        """Make the message say this (devices: the agent's names of the chips with an `occur`, for the budget);
        '' when nothing had to change, else what was written. Raises on API errors (a 409 is read again and
        redone, three times)."""
        for _ in range(3):
            now_ms = int(self._clock() * 1000)
            current = self.faults()
            faults = plan_faults(current, active, keep, self.node, now_ms)
            if faults == current:
                return ""
            body = self._body(faults, now_ms, sorted(devices))
            try:
                if self._stored is None:
                    self._stored = self.api.create_configmap(self.namespace, body)
                else:
                    body["metadata"]["resourceVersion"] = self._stored["metadata"]["resourceVersion"]
                    self._stored = self.api.replace_configmap(self.namespace, self.name, body)
            except Exception as exc:
                if not is_status(exc, 409):
                    raise
                self._loaded = False  # somebody else wrote: read it again
                continue
            occur = sum(1 for f in faults if f["assertion"] == "occur")
            return f"{self.namespace}/{self.name}: {occur} occurring, {len(faults) - occur} recovered"
        raise RuntimeError(f"configmap {self.namespace}/{self.name}: 3 compare-and-swap attempts lost")

    def _body(self, faults: list[dict[str, Any]], now_ms: int, devices: list[str]) -> dict[str, Any]:
        self._sequence += 1
        message = {
            "id": f"nh.{_node_tag(self.node)}.{now_ms}.{self._sequence}",
            "timestamp": now_ms,
            "version": "1.0",
            "resource": self.sender,
            "faults": faults,
        }
        labels = {**LABELS, f"{self.prefix}/node": self.node_label}
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": labels,
                "annotations": {f"{self.prefix}/isolated": ",".join(devices)},
            },
            "data": {DATA_KEY: json.dumps(message, sort_keys=True)},
        }


def occurring_count(configmap: Mapping[str, Any] | None) -> int:
    """How many faults of a stored message still occur (cleanup's and the fleet view's count)."""
    return sum(1 for f in parse_faults(configmap) if f["assertion"] == "occur")


def recover_all(api: KubeApi, configmap: Mapping[str, Any], clock: Callable[[], float]) -> int:
    """Cleanup: every `occur` of one stored ConfigMap turned into a `recover` (the ConfigMap stays, so ClusterD
    sees the recovery); the number recovered. A 409 raises (the caller reports it)."""
    count = occurring_count(configmap)
    if not count:
        return 0
    faults = parse_faults(configmap)
    text = json.loads(configmap["data"][DATA_KEY])
    now_ms = int(clock() * 1000)
    text.update(
        {
            "id": f"nh.cleanup.{now_ms}",
            "timestamp": now_ms,
            "faults": [{**f, "assertion": "recover"} for f in faults],
        }
    )
    metadata = dict(configmap["metadata"])
    annotations = {k: v for k, v in (metadata.get("annotations") or {}).items() if not k.endswith("/isolated")}
    body = {**configmap, "metadata": {**metadata, "annotations": annotations}, "data": {DATA_KEY: json.dumps(text)}}
    api.replace_configmap(metadata["namespace"], metadata["name"], body)
    return count
