"""The API double itself: the semantics the reconciler relies on, checked through the real client."""

from __future__ import annotations

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException
from support.kube_double import ApiDouble, json_patch, label_selector_matches, merge_patch, strategic_merge

STRATEGIC = "application/strategic-merge-patch+json"


def test_strategic_merge_merges_conditions_by_type_and_replaces_taints() -> None:
    node = {
        "spec": {"taints": [{"key": "a", "effect": "NoSchedule"}, {"key": "b", "effect": "NoExecute"}]},
        "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "X", "status": "False"}]},
    }
    patched = strategic_merge(
        node,
        {
            "spec": {"taints": [{"key": "c", "effect": "NoSchedule"}]},
            "status": {"conditions": [{"type": "X", "status": "True"}, {"type": "Ready", "$patch": "delete"}]},
        },
    )
    assert patched["spec"]["taints"] == [{"key": "c", "effect": "NoSchedule"}], "the taint list is atomic"
    assert patched["status"]["conditions"] == [{"type": "X", "status": "True"}]


def test_merge_and_json_patch() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1, 2]}, {"a": {"b": None}, "l": [3]}) == {"a": {"c": 2}, "l": [3]}
    doc = {"spec": {"taints": [{"key": "a"}]}}
    assert json_patch(doc, [{"op": "add", "path": "/spec/taints/-", "value": {"key": "b"}}])["spec"]["taints"] == [
        {"key": "a"},
        {"key": "b"},
    ]
    assert json_patch(doc, [{"op": "remove", "path": "/spec/taints/0"}]) == {"spec": {"taints": []}}
    with pytest.raises(Exception, match="test operation failed"):
        json_patch(doc, [{"op": "test", "path": "/spec/taints/0/key", "value": "z"}])


def test_label_selectors() -> None:
    labels = {"pool": "accel", "zone": "a"}
    assert label_selector_matches("pool=accel,zone in (a, b)", labels)
    assert label_selector_matches("pool==accel,!gpu,zone", labels)
    assert not label_selector_matches("pool!=accel", labels)
    assert not label_selector_matches("zone notin (a)", labels)
    assert not label_selector_matches("gpu", labels)


@pytest.mark.system
def test_real_client_conflicts_faults_and_cas(double: ApiDouble) -> None:
    double.add_node("n1", labels={"pool": "accel"})
    double.add_node("n2", labels={"pool": "cpu"})
    api = kubernetes.client.CoreV1Api(double.client())
    assert [n.metadata.name for n in api.list_node(label_selector="pool=accel").items] == ["n1"]
    node = api.read_node("n1")
    stale = node.metadata.resource_version
    api.patch_node("n1", {"metadata": {"labels": {"x": "1"}}}, _content_type=STRATEGIC)
    with pytest.raises(ApiException) as conflict:
        api.patch_node("n1", {"metadata": {"resourceVersion": stale, "labels": {"y": "1"}}}, _content_type=STRATEGIC)
    assert conflict.value.status == 409
    # A status write cannot change labels; a main-resource write cannot change status.
    api.patch_node_status(
        "n1",
        {"metadata": {"labels": {"z": "1"}}, "status": {"conditions": [{"type": "A", "status": "True"}]}},
        _content_type=STRATEGIC,
    )
    api.patch_node("n1", {"status": {"conditions": [{"type": "B", "status": "True"}]}}, _content_type=STRATEGIC)
    stored = double.node("n1")
    assert "z" not in stored["metadata"]["labels"]
    assert [c["type"] for c in stored["status"]["conditions"]] == ["A"]
    with pytest.raises(ApiException) as invalid:
        api.patch_node("n1", {"spec": {"taints": [{"key": "k", "effect": "Sometimes"}]}}, _content_type=STRATEGIC)
    assert invalid.value.status == 422

    body = kubernetes.client.V1ConfigMap(metadata=kubernetes.client.V1ObjectMeta(name="cm"), data={"a": "1"})
    with pytest.raises(ApiException) as missing:
        api.create_namespaced_config_map("ns", body)
    assert missing.value.status == 404, "no such namespace"
    api.create_namespace(kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name="ns")))
    created = api.create_namespaced_config_map("ns", body)
    body.metadata.resource_version = created.metadata.resource_version
    body.data = {"a": "2"}
    api.replace_namespaced_config_map("cm", "ns", body)
    with pytest.raises(ApiException) as cas:
        api.replace_namespaced_config_map("cm", "ns", body)  # the same resourceVersion again
    assert cas.value.status == 409

    double.inject("/nodes/n2", status=500, times=1)
    with pytest.raises(ApiException) as server:
        api.read_node("n2")
    assert server.value.status == 500
    double.outage()
    with pytest.raises(Exception, match=r"refused|Max retries"):
        api.read_node("n2", _request_timeout=1)
    double.restore()
    assert api.read_node("n2").metadata.name == "n2"
