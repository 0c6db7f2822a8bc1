"""agent/kube/pods.py on the API double: the node's pods listed metadata-only from the watch cache, only this node's,
only the annotations the device checks read; lists on request, never more often than the minimum interval; a
failed list keeps the last one. PodFeed, the seam the daemon hands the probes and /ready?pod=."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from support.kube_double import ApiDouble

from agent.config import parse_config
from agent.daemon import Agent
from agent.kube.client import KubeApi
from agent.kube.pods import NodePods, PodFeed
from agent.scheduler import probe_context
from probes.runtime.podresources.ledger import ASCEND_REAL_ANNOTATION

pytestmark = pytest.mark.system  # a server on 127.0.0.1


def test_lists_this_nodes_pods_metadata_only_from_the_cache(double: ApiDouble) -> None:
    double.add_node("a")
    double.add_pod(
        "team-a",
        "vc-0",
        "a",
        uid="1111",
        annotations={ASCEND_REAL_ANNOTATION: "Ascend910-3", "x": "y"},
        scheduler="volcano",
    )
    double.add_pod("team-b", "other", "b")
    pods = NodePods(lambda: KubeApi(double.client, 5), "a")
    before = time.time()
    assert pods.current() is None and pods.refresh()
    index = pods.current()
    assert index is not None and index.fetched_at >= before
    assert [(p.uid, p.namespace, p.name, dict(p.annotations)) for p in index.pods] == [
        ("1111", "team-a", "vc-0", {ASCEND_REAL_ANNOTATION: "Ascend910-3"})
    ]
    assert index.by_uid("1111") is index.by_name("team-a", "vc-0")
    request = next(r for r in double.log if r.path == "/api/v1/pods")
    assert request.query == {"fieldSelector": ["spec.nodeName=a"], "resourceVersion": ["0"]}
    assert "as=PartialObjectMetadataList" in request.accept


def test_lists_only_when_asked_and_at_most_every_min_interval(double: ApiDouble) -> None:
    double.add_node("a")
    pods = NodePods(lambda: KubeApi(double.client, 5), "a", min_interval=1.0)

    def until(lists: int) -> None:
        deadline = time.monotonic() + 10
        while pods.lists < lists and time.monotonic() < deadline:
            time.sleep(0.02)

    pods.start()
    try:
        until(1)
        assert pods.lists == 1  # the first list at start
        time.sleep(0.3)
        assert pods.lists == 1  # nobody asked
        for _ in range(20):
            pods.want_fresh()  # asked twenty times before the interval is over: one more list, after it
        assert pods.lists == 1
        until(2)
        time.sleep(0.3)
        assert pods.lists == 2
        double.add_pod("team-a", "new", "a")
        pods.want_fresh()
        until(3)
        index = pods.current()
        assert index is not None and [p.name for p in index.pods] == ["new"]
    finally:
        pods.stop()


def test_a_failed_list_keeps_the_last_one(double: ApiDouble) -> None:
    double.add_node("a")
    double.add_pod("team-a", "p", "a")
    pods = NodePods(lambda: KubeApi(double.client, 2), "a")
    assert pods.refresh()
    double.outage()
    try:
        assert not pods.refresh()
    finally:
        double.restore()
    index = pods.current()
    assert index is not None and [p.name for p in index.pods] == ["p"] and pods.last_error
    assert pods.status()["pods"] == 1 and "last_error" in pods.status()


def test_the_feed_is_the_one_seam_to_the_probes_and_ready_pod(double: ApiDouble) -> None:
    """The daemon makes one PodFeed for the probes' context and /ready?pod=; unconnected it has no list (what the
    checks read as Kubernetes off), connected it forwards the Kubernetes side's list and requests."""
    config = parse_config({"http": {"address": "127.0.0.1", "port": 0}}, {})
    agent = Agent(None, config, no_kube=True, probe_classes={})
    feed = agent.pods
    assert isinstance(feed, PodFeed) and agent.scheduler.pods is feed
    assert agent.pod_ledger._pods() is feed  # the seam itself is what is tested
    assert probe_context(agent.host, config, 1.0, agent.scheduler.pods).kubelet.pods is feed
    assert not feed.connected and feed.current() is None
    feed.want_fresh()  # unconnected: asks nothing of anyone
    double.add_node("a")
    double.add_pod("team-a", "vc-0", "a", uid="1111")
    source = NodePods(lambda: KubeApi(double.client, 5), "a")
    feed.connect(source)
    assert feed.connected and feed.current() is None
    assert source.refresh()
    index = feed.current()
    assert index is source.current() and index is not None and index.by_uid("1111") is not None
    feed.want_fresh()
    assert source._wanted.is_set()  # the request reached the source's thread


def test_the_daemon_loads_no_kubernetes_client_for_the_feed() -> None:
    code = "import sys, agent.daemon; print(sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_ascend_real_is_trusted_only_on_the_pods_a_trusted_scheduler_placed(double: ApiDouble) -> None:
    """A pod's own huawei.com/AscendReal (anyone who creates a pod writes its annotations) is dropped unless
    Volcano (spec.schedulerName, kubernetes.ascend_real_schedulers) placed it."""
    double.add_node("a")
    real = {ASCEND_REAL_ANNOTATION: "Ascend910-3"}
    double.add_pod("team-a", "vc-0", "a", uid="1111", annotations=real, scheduler="volcano")
    double.add_pod("team-b", "own-0", "a", uid="2222", annotations=real)  # default-scheduler
    double.add_pod("team-c", "other-0", "a", uid="3333", annotations=real, scheduler="my-scheduler")
    pods = NodePods(lambda: KubeApi(double.client, 5), "a")
    assert pods.refresh()
    index = pods.current()
    assert index is not None
    kept = {p.name: dict(p.annotations) for p in index.pods}
    assert kept == {"vc-0": real, "own-0": {}, "other-0": {}}
    queries = [r.query["fieldSelector"] for r in double.log if r.path == "/api/v1/pods"]
    assert queries[-2:] == [["spec.nodeName=a"], ["spec.nodeName=a,spec.schedulerName=volcano"]]
    # A site whose Volcano runs under another name lists it.
    other = NodePods(lambda: KubeApi(double.client, 5), "a", schedulers=lambda: ["my-scheduler"])
    assert other.refresh()
    index = other.current()
    assert index is not None
    assert {p.name: dict(p.annotations) for p in index.pods} == {"vc-0": {}, "own-0": {}, "other-0": real}
