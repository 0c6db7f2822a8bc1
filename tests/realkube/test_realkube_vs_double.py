"""The same calls against a real kube-apiserver 1.37 and the API double, compared: status codes, answer shapes
and the objects left, for each way the double was found to differ from the real server."""

from __future__ import annotations

import zlib
from typing import Any

import pytest
from support.kube_double import ApiDouble
from support.realkube import Requester, plane, register_node
from support.realkube_compare import Double, shape

pytestmark = [pytest.mark.system, pytest.mark.realkube]
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"
NOT_READY = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}


def _targets(double: ApiDouble, node: str = "") -> tuple[Requester, Requester]:
    real, fake = plane("1.37"), Double(double)
    real.ensure_namespace("node-health")  # the double implies it (an installed cluster)
    if node:
        for target in (real, fake):
            if target.request("GET", f"/api/v1/nodes/{node}")[0] == 404:
                register_node(target, node)
    return real, fake


def _types(target: Requester, node: str) -> list[str]:
    return [c["type"] for c in target.request("GET", f"/api/v1/nodes/{node}")[1]["status"]["conditions"]]


def _each(targets: tuple[Requester, ...], method: str, path: str, body: Any = None, kind: str = "") -> list[Any]:
    return [target.request(method, path, body, content_type=kind) for target in targets]


def test_condition_order_after_a_strategic_merge_is_the_real_servers(double: ApiDouble) -> None:
    """Without `$setElementOrder` new conditions go before the kubelet's; with it (the agent's patch) every condition
    stays where it is and new ones follow; a patch whose items disagree with the order is a 500."""
    targets = _targets(double, "order-1")
    path = "/api/v1/nodes/order-1/status"
    seen = []
    steps: list[dict[str, Any]] = [
        {"conditions": [{"type": "NetworkHealthy", "status": "True"}]},
        {"conditions": [{"type": "Ready", "status": "True"}, {"type": "ClockSynced", "status": "True"}]},
        {
            "$setElementOrder/conditions": [
                {"type": t} for t in ("NetworkHealthy", "ClockSynced", "MemoryPressure", "DiskPressure", "Ready")
            ]
            + [{"type": "GPUHealthy"}],
            "conditions": [{"type": "ClockSynced", "status": "False"}, {"type": "GPUHealthy", "status": "True"}],
        },
        {
            "$setElementOrder/conditions": [{"type": "Ready"}, {"type": "GPUHealthy"}],
            "conditions": [{"type": "GPUHealthy", "status": "False"}, {"type": "Ready", "status": "True"}],
        },
    ]
    for step in steps:
        answers = _each(targets, "PATCH", path, {"status": step}, STRATEGIC)
        seen.append(
            [
                (status, shape(answer), _types(t, "order-1"))
                for (status, answer), t in zip(answers, targets, strict=True)
            ]
        )
    for real, fake in seen:
        assert real == fake
    assert seen[0][0][2] == ["NetworkHealthy", "MemoryPressure", "DiskPressure", "Ready"], seen
    assert seen[2][0][2][-1] == "GPUHealthy" and seen[3][0][0] == 500, seen


@pytest.mark.parametrize(("namespace", "involved"), [("default", ""), ("node-health", ""), ("node-health", "x")])
def test_a_nodes_event_outside_default_is_refused_as_by_the_real_server(
    double: ApiDouble, namespace: str, involved: str
) -> None:
    """An Event about a Node (no involvedObject.namespace) is accepted in `default` only, so the agent's
    `kubernetes.events_namespace` must be default (a config error otherwise); a namespaced object's Event only
    in its own namespace."""
    targets = _targets(double)
    for target in targets:
        target.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    involved_object = {"apiVersion": "v1", "kind": "Node", "name": "ev-1", "namespace": involved}
    event = {
        "metadata": {"generateName": "ev-1."},
        "involvedObject": involved_object,
        "reason": "NodeHealthProbe",
        "message": "m",
        "type": "Normal",
        "source": {"component": "node-health"},
    }
    real, fake = _each(targets, "POST", f"/api/v1/namespaces/{namespace}/events", event)
    assert (real[0], shape(real[1])) == (fake[0], shape(fake[1]))
    assert real[0] == (201 if namespace == "default" and not involved else 422), real
    if real[0] == 422:
        for _status, answer in (real, fake):
            assert answer["message"].endswith(
                f'involvedObject.namespace: Invalid value: "{involved}": does not match event.namespace'
            ), answer


BIG = "x" * (256 * 1024)
MERGE = "application/merge-patch+json"
# (what, method, path, body, content type): each a call where the double once answered otherwise.
CALLS = [
    ("create", "POST", "/api/v1/namespaces/node-health/configmaps", {"metadata": {"name": "cmp"}, "data": {}}, ""),
    ("delete: a Status naming it", "DELETE", "/api/v1/namespaces/node-health/configmaps/cmp", None, ""),
    ("delete again: 404", "DELETE", "/api/v1/namespaces/node-health/configmaps/cmp", None, ""),
    ("a pod's delete answers the pod", "DELETE", "/api/v1/namespaces/node-health/pods/cmp-pod", None, ""),
    ("create in a missing namespace", "POST", "/api/v1/namespaces/nowhere/configmaps", {"metadata": {"name": "x"}}, ""),
    ("name mismatch", "PUT", "/api/v1/nodes/cmp-node", {"metadata": {"name": "other"}}, ""),
    ("annotations over 256 KiB", "PATCH", "/api/v1/nodes/cmp-node", {"metadata": {"annotations": {"a/b": BIG}}}, MERGE),
    (
        "a condition status of any string",
        "PATCH",
        "/api/v1/nodes/cmp-node/status",
        {"status": {"conditions": [{"type": "NPUHealthy", "status": "Maybe"}]}},
        STRATEGIC,
    ),
    ("bad label selector", "GET", "/api/v1/nodes?labelSelector=a%3D%3D%3Db", None, ""),
    ("unsupported field selector", "GET", "/api/v1/nodes?fieldSelector=spec.nope%3Dx", None, ""),
    (
        "the slice selector spec.pool.name (served by 1.37's v1)",
        "GET",
        "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.pool.name%3Dx",
        None,
        "",
    ),
    ("not a DNS subdomain", "POST", "/api/v1/nodes", {"metadata": {"name": "Bad_Name"}}, ""),
]


@pytest.mark.parametrize(("what", "method", "path", "body", "kind"), CALLS, ids=[c[0] for c in CALLS])
def test_the_double_answers_as_the_real_server(
    double: ApiDouble, what: str, method: str, path: str, body: Any, kind: str
) -> None:
    double.serve_dra("1.37")
    targets = _targets(double, "cmp-node")
    pod = {"metadata": {"name": "cmp-pod"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    for target in targets:
        target.request("POST", "/api/v1/namespaces/node-health/pods", pod)
        if what.startswith("delete"):
            target.request("POST", CALLS[0][2], CALLS[0][3])
        if what == "delete again: 404":
            target.request("DELETE", path)
    (real_status, real), (fake_status, fake) = _each(targets, method, path, body, kind)
    assert (fake_status, shape(fake)) == (real_status, shape(real)), (what, real, fake)
    if isinstance(real, dict) and real.get("kind") == "Status" and real_status == 200:
        assert {k: v for k, v in fake["details"].items() if k != "uid"} == {
            k: v for k, v in real["details"].items() if k != "uid"
        }, (real, fake)
    if isinstance(real, dict) and real_status >= 400:
        words = {"not found", "nowhere", "other", "262144", "unable to parse", "field label not supported", "RFC 1123"}
        said = [w for w in words if w in real["message"]]
        assert said and all(w in fake["message"] for w in said), (real["message"], fake["message"])


SELECTORS = [
    "",
    "accel=true",
    "accel==true,pool!=cpu",
    "node-role.kubernetes.io/gpu",
    "!node-role.kubernetes.io/control-plane",
    "pool in (a, b),zone notin (z1)",
    "accel=",
    "accel===true",
    "accel=true pool=a",
    "bad key=1",
    "x/y/z=1",
    "accel=$$",
    "accel=true,",
    "pool in a",
    "pool in (a b)",
]


@pytest.mark.parametrize("selector", SELECTORS)
def test_a_budget_node_selector_loads_exactly_when_the_real_server_parses_it(double: ApiDouble, selector: str) -> None:
    """`kubernetes.budget_node_selector` is checked at load (a config error, exit 2) by the rules kube-apiserver
    parses label selectors with; the double refuses what the real server refuses."""
    from urllib.parse import quote

    from agent.labelselector import label_selector_problem

    path = f"/api/v1/nodes?labelSelector={quote(selector)}"
    (real_status, real), (fake_status, _fake) = _each(_targets(double), "GET", path)
    assert real_status in (200, 400), real
    assert (label_selector_problem(selector) == "") == (real_status == 200), (selector, real)
    assert fake_status == real_status, (selector, real)


@pytest.mark.parametrize(
    ("device", "uuid"),
    [("gpu-0", "x" * 64), ("GPU_0", "x"), ("g" * 64, "x"), ("gpu-0", "x" * 65), ("gpu-0", "é" * 32 + "x")],
    ids=["fits", "not-a-dns-label", "64-character-name", "65-byte-string", "multibyte-string"],
)
def test_resource_slice_names_and_attribute_strings_are_refused_as_by_the_real_server(
    double: ApiDouble, device: str, uuid: str
) -> None:
    """Device names are DNS labels, a string attribute at most 64 bytes: the agent reads them from the slices the
    server accepted (and selects devices by those names), so the double must refuse what the real server does."""
    double.serve_dra("1.37")
    body = {
        "metadata": {"name": f"slice-{zlib.crc32((device + uuid).encode())}"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "slice-node",
            "pool": {"name": "slice-node", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": device, "attributes": {"uuid": {"string": uuid}}}],
        },
    }
    (real_status, real), (fake_status, fake) = _each(
        _targets(double), "POST", "/apis/resource.k8s.io/v1/resourceslices", body
    )
    assert (fake_status, shape(fake)) == (real_status, shape(real)), (real, fake)
    if real_status == 422:
        field = "string" if "attributes" in real["message"] else "name"
        assert f"spec.devices{'[0]' if field == 'string' else ''}" in fake["message"] and field in fake["message"]


def test_a_node_created_is_born_with_the_not_ready_taint_on_both(double: ApiDouble) -> None:
    real, fake = _targets(double)
    body = {"metadata": {"name": "born-1"}, "spec": {"taints": [{"key": "a/b", "effect": "NoSchedule"}]}}
    answers = _each((real, fake), "POST", "/api/v1/nodes", body)
    assert [status for status, _ in answers] == [201, 201], answers
    taints = [answer["spec"]["taints"] for _, answer in answers]
    assert taints[0] == taints[1] == [{"key": "a/b", "effect": "NoSchedule"}, NOT_READY], taints


def test_server_side_apply_creates_then_merges_on_both(double: ApiDouble) -> None:
    """Server-side apply (what `kubectl apply --server-side` and tests/support/realkube_objects.py send): the
    object created when missing, then changed; an admin's apply of a Node's status; no fieldManager: 422."""
    targets = _targets(double, "ssa-node")
    path = "/api/v1/namespaces/node-health/configmaps/ssa"
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa", "namespace": "node-health"}}
    status = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "ssa-node"},
        "status": {"capacity": {"cpu": "4"}},
    }
    steps = [
        (f"{path}?fieldManager=t", {**config_map, "data": {"a": "1"}}),
        (f"{path}?fieldManager=t", {**config_map, "data": {"a": "2"}}),
        (path, {**config_map, "data": {"a": "3"}}),
        ("/api/v1/nodes/ssa-node/status?fieldManager=t", status),
    ]
    for where, body in steps:
        (real_status, real), (fake_status, fake) = _each(targets, "PATCH", where, body, APPLY)
        assert (fake_status, shape(fake)) == (real_status, shape(real)), (where, real, fake)
    assert [t.request("GET", path)[1]["data"] for t in targets] == [{"a": "2"}] * 2
    assert [t.request("GET", "/api/v1/nodes/ssa-node")[1]["status"]["capacity"] for t in targets] == [{"cpu": "4"}] * 2
