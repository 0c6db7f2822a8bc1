"""The node's pods as the probes need them (`probes.runtime.podresources.pods.PodDirectory`): UID, namespace,
name and Volcano's `huawei.com/AscendReal`, for the npu and gpu checks against the device plugin's ledger.

`PodFeed` is the one seam by which this list reaches the probes: the daemon makes one feed, hands it to the
scheduler (the probes' context, `ctx.kubelet.pods`) and to `/ready?pod=` (agent.http.pod), and connects the
Kubernetes side's `NodePods` to it once that side runs. Data flows one way through it: the probes read the list
(`current`) and may ask for a newer one (`want_fresh`); nothing of theirs reaches the API. Until it is connected
(Kubernetes off) the feed has no list, which the checks read as "the node's pod list is not available". The
feed itself loads nothing of the kubernetes client (the daemon imports it at start, Kubernetes or not).

AscendReal is kept only for the pods Volcano placed: a pod's annotations are written by whoever creates the pod,
so a tenant's own `huawei.com/AscendReal` on a pod of any other scheduler would name chips the kubelet never gave
it, and make the pod look like it holds its own chip outside its allocation. Which pods a trusted scheduler
placed (`kubernetes.ascend_real_schedulers`, default `volcano`) is a second metadata list with a field selector
on spec.schedulerName, which only the API server sets from the pod's spec (a pod cannot claim it by annotation).

The list is this node's pods' metadata only (`KubeApi.list_node_pods_metadata`: a field selector on
spec.nodeName, resourceVersion=0 so the API server answers from its watch cache), made in this module's own
thread: once at start, then only when a probe asks (`want_fresh`: a pod the list does not know yet, or one newer
than the list), at most every `MIN_SECONDS_BETWEEN_LISTS`. A probe reads the last list (`current`) and never
waits for the API. A failed list keeps the previous one and is retried at the next request, backed off.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from probes.runtime.podresources.ledger import ASCEND_REAL_ANNOTATION
from probes.runtime.podresources.pods import PodDirectory, PodIndex, PodMeta

if TYPE_CHECKING:
    from agent.kube.client import KubeApi

log = logging.getLogger(__name__)

MIN_SECONDS_BETWEEN_LISTS = 10.0
MAX_PODS = 2000  # a node runs at most a few hundred (the kubelet's max-pods is 110 by default)
KEPT_ANNOTATIONS = (ASCEND_REAL_ANNOTATION,)
MAX_ANNOTATION_CHARS = 1024


def pod_index(items: list[dict[str, Any]], fetched_at: float, trusted: Collection[str] = frozenset()) -> PodIndex:
    """The list's pods, with only the annotations the checks read (bounded); AscendReal only on the pods whose UID
    is in `trusted` (placed by a trusted scheduler)."""
    pods = []
    for metadata in items[:MAX_PODS]:
        annotations = metadata.get("annotations") or {}
        uid = str(metadata.get("uid", ""))
        kept = {
            key: str(annotations[key])[:MAX_ANNOTATION_CHARS]
            for key in KEPT_ANNOTATIONS
            if isinstance(annotations, dict)
            and key in annotations
            and (key != ASCEND_REAL_ANNOTATION or uid in trusted)
        }
        pods.append(
            PodMeta(
                str(metadata.get("uid", "")), str(metadata.get("namespace", "")), str(metadata.get("name", "")), kept
            )
        )
    return PodIndex(tuple(pods), fetched_at)


class PodFeed:
    """The probes' view of the node's pods (a `PodDirectory`), fed by whatever source the daemon connects."""

    def __init__(self) -> None:
        self._source: PodDirectory | None = None

    def connect(self, source: PodDirectory | None) -> None:
        self._source = source

    @property
    def connected(self) -> bool:
        return self._source is not None

    def current(self) -> PodIndex | None:
        source = self._source
        return source.current() if source is not None else None

    def want_fresh(self) -> None:
        source = self._source
        if source is not None:
            source.want_fresh()


class NodePods:
    def __init__(
        self,
        api: Callable[[], KubeApi],
        node: str,
        clock: Callable[[], float] = time.time,
        min_interval: float = MIN_SECONDS_BETWEEN_LISTS,
        schedulers: Callable[[], Collection[str]] = lambda: ("volcano",),
    ) -> None:
        self._api = api
        self._schedulers = schedulers
        self.node = node
        self._clock = clock
        self._min_interval = min_interval
        self._index: PodIndex | None = None
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_attempt = 0.0
        self.lists = 0
        self.last_error = ""

    # --- what probes call (never blocks) ---------------------------------------------------------

    def current(self) -> PodIndex | None:
        return self._index

    def want_fresh(self) -> None:
        self._wanted.set()

    # --- the thread --------------------------------------------------------------------------------

    def refresh(self) -> bool:
        """One list now (the thread's step; tests call it directly). False when it failed."""
        from agent.kube.client import short_error  # the client is heavy: loaded with the Kubernetes side only

        self._last_attempt = time.monotonic()
        started = self._clock()
        try:
            api = self._api()
            items = api.list_node_pods_metadata(self.node)
            # One list per trusted scheduler; a failed one fails the whole refresh (the previous list stays):
            # without it Volcano's pods would lose their real chips and look like they hold chips not theirs.
            trusted = {
                str(item.get("uid", ""))
                for scheduler in tuple(self._schedulers())[:8]
                for item in api.list_node_pods_metadata(self.node, scheduler)[:MAX_PODS]
            }
        except Exception as exc:  # noqa: BLE001 - any failure keeps the previous list
            if short_error(exc) != self.last_error:
                log.warning("listing the node's pods failed: %s", short_error(exc))
            self.last_error = short_error(exc)
            return False
        self._index = pod_index(items, started, trusted)
        self.lists += 1
        self.last_error = ""
        return True

    def start(self) -> None:
        self._wanted.set()  # the first list at once
        self._thread = threading.Thread(target=self._run, name="kube-pods", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._wanted.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            self._wanted.wait()
            if self._stop.is_set():
                return
            wait = self._last_attempt + self._min_interval * (2 ** min(failures, 5)) - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                return
            self._wanted.clear()
            failures = 0 if self.refresh() else failures + 1

    def status(self) -> dict[str, Any]:
        index = self._index
        out: dict[str, Any] = {"lists": self.lists, "pods": len(index.pods) if index else None}
        if index is not None:
            out["listed_at"] = round(index.fetched_at, 3)
        if self.last_error:
            out["last_error"] = self.last_error
        return out
