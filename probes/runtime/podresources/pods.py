"""What the probes get about the kubelet and the node's pods: `KubeletAccess`, on the probe context.

- the PodResources socket and the deadline of one ledger read (config `kubernetes.pod_resources_socket`,
  `kubernetes.pod_resources_timeout_seconds`);
- a `PodDirectory` (optional): the node's pods as the API lists them (UID, namespace/name, the annotations the
  checks need), which the agent keeps when Kubernetes is on. It names a pod the runtime's OCI bundle does not,
  and carries Volcano's `huawei.com/AscendReal`: without it the chips of a Volcano pod are not known, and the
  npu checks do not compare them with the ledger.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_TIMEOUT_SECONDS = 1.0


@dataclass(frozen=True)
class PodMeta:
    uid: str
    namespace: str
    name: str
    annotations: Mapping[str, str] = field(default_factory=dict)  # only the ones the checks read


@dataclass(frozen=True)
class PodIndex:
    """The node's pods at one moment (`fetched_at`, wall clock)."""

    pods: tuple[PodMeta, ...] = ()
    fetched_at: float = 0.0

    def by_uid(self, uid: str) -> PodMeta | None:
        return next((pod for pod in self.pods if pod.uid == uid), None)

    def by_name(self, namespace: str, name: str) -> PodMeta | None:
        return next((pod for pod in self.pods if (pod.namespace, pod.name) == (namespace, name)), None)


class PodDirectory(Protocol):
    """The agent's view of the node's pods. `current()` never blocks; `want_fresh()` asks for a new list soon
    (a pod the index does not know yet, or one listed before its devices were allocated)."""

    def current(self) -> PodIndex | None: ...

    def want_fresh(self) -> None: ...


@dataclass(frozen=True)
class KubeletAccess:
    socket: str = DEFAULT_SOCKET
    timeout: float = DEFAULT_TIMEOUT_SECONDS
    pods: PodDirectory | None = None
