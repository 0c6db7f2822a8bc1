"""The API double's resource.k8s.io (tests/support/kube_dra.py), over HTTP as a client sees it: what the device
isolation relies on must behave as kube-apiserver does, or the tests of the agent prove nothing."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from support.kube_devices import NVIDIA, nvidia_devices
from support.kube_double import ApiDouble
from support.kube_dra import add_resource_slice

RULES = "/apis/resource.k8s.io/{version}/devicetaintrules"


def call(
    double: ApiDouble, method: str, path: str, body: Any = None, content_type: str = "application/json"
) -> tuple[int, Any, list[str]]:
    """(status, JSON answer, Warning headers)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(double.host + path, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, json.loads(answer.read()), answer.headers.get_all("Warning") or []
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers.get_all("Warning") or []


def rule(name: str = "r1", selector: dict[str, Any] | None = None, effect: str = "NoSchedule") -> dict[str, Any]:
    wanted = selector if selector is not None else {"driver": NVIDIA, "pool": "n1", "device": "gpu-0"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": name, "labels": {"team": "ml"}},
        "spec": {"deviceSelector": wanted, "taint": {"key": "example.com/bad", "value": "Broken", "effect": effect}},
    }


@pytest.mark.system
@pytest.mark.parametrize(
    "release,served",
    [
        ("1.37", {"v1": {"resourceslices", "devicetaintrules"}, "v1beta2": {"resourceslices", "devicetaintrules"}}),
        ("1.36", {"v1": {"resourceslices"}, "v1beta2": {"resourceslices", "devicetaintrules"}}),
        ("none", {}),
    ],
)
def test_discovery_per_release(double: ApiDouble, release: str, served: dict[str, set[str]]) -> None:
    double.serve_dra(release)
    status, groups, _ = call(double, "GET", "/apis")
    assert status == 200
    assert ("resource.k8s.io" in {g["name"] for g in groups["groups"]}) == bool(served)
    for version in ("v1", "v1beta2"):
        status, document, _ = call(double, "GET", f"/apis/resource.k8s.io/{version}")
        if version not in served:
            assert status == 404
            continue
        assert status == 200 and document["kind"] == "APIResourceList"
        assert {r["name"] for r in document["resources"]} == served[version]
        assert all(r["namespaced"] is False for r in document["resources"])
    if release == "1.36":
        assert call(double, "GET", RULES.format(version="v1"))[0] == 404, "v1 has no DeviceTaintRules in 1.36"
        assert call(double, "GET", RULES.format(version="v1beta2"))[0] == 200


@pytest.mark.system
def test_strict_field_validation_refuses_unknown_fields_and_otherwise_drops_them(double: ApiDouble) -> None:
    double.serve_dra("1.37")
    old = rule(selector={"driver": NVIDIA, "pool": "n1", "device": "gpu-0", "deviceClassName": "gpu.nvidia.com"})
    status, answer, _ = call(double, "POST", RULES.format(version="v1") + "?fieldValidation=Strict", old)
    assert status == 400 and answer["reason"] == "BadRequest"
    assert 'unknown field "spec.deviceSelector.deviceClassName"' in answer["message"]
    assert double.device_taint_rules() == []

    status, answer, warnings = call(double, "POST", RULES.format(version="v1"), old)
    assert status == 201, answer
    assert answer["spec"]["deviceSelector"] == {"driver": NVIDIA, "pool": "n1", "device": "gpu-0"}, "silently dropped"
    assert any("spec.deviceSelector.deviceClassName" in w for w in warnings), "the default (Warn) says so"
    assert answer["spec"]["taint"]["timeAdded"], "set by the server"
    assert answer["metadata"]["generation"] == 1

    narrowed = {"metadata": {"name": "r2"}, "spec": {"deviceSelector": {"selectors": [{"cel": {}}]}, "taint": {}}}
    narrowed["spec"]["taint"] = {"key": "example.com/bad", "effect": "NoSchedule"}
    status, answer, _ = call(double, "POST", RULES.format(version="v1") + "?fieldValidation=Ignore", narrowed)
    assert status == 201 and answer["spec"]["deviceSelector"] == {}, "an empty selector, which matches every device"


@pytest.mark.system
def test_rule_validation_versions_conflicts_and_preconditions(double: ApiDouble) -> None:
    double.serve_dra("1.37")
    double.taint_controller = False  # no status writes in between: this test holds resourceVersions itself
    path = RULES.format(version="v1")
    assert call(double, "POST", path, rule(effect="PreferNoSchedule"))[0] == 422, "not a device taint effect"
    assert call(double, "POST", path, rule(name="Not_A_Name"))[0] == 422
    status, created, _ = call(double, "POST", path, rule())
    assert status == 201
    assert call(double, "POST", path, rule())[0] == 409, "AlreadyExists"
    status, beta, _ = call(double, "GET", RULES.format(version="v1beta2") + "/r1")
    assert status == 200 and beta["apiVersion"] == "resource.k8s.io/v1beta2", "one object, served in each version"

    version = created["metadata"]["resourceVersion"]
    patch = {"metadata": {"resourceVersion": version}, "spec": {"taint": {"value": "Other"}}}
    merge = "application/merge-patch+json"
    status, patched, _ = call(double, "PATCH", path + "/r1?fieldValidation=Strict", patch, merge)
    assert status == 200 and patched["spec"]["taint"]["timeAdded"] == created["spec"]["taint"]["timeAdded"]
    assert patched["metadata"]["generation"] == 2
    assert call(double, "PATCH", path + "/r1", patch, merge)[0] == 409, "a stale resourceVersion"

    stale = {"preconditions": {"resourceVersion": version}}
    assert call(double, "DELETE", path + "/r1", stale)[0] == 409, "DELETE at a version that is gone"
    current = {"preconditions": {"resourceVersion": patched["metadata"]["resourceVersion"]}}
    assert call(double, "DELETE", path + "/r1", current)[0] == 200
    assert call(double, "DELETE", path + "/r1", current)[0] == 404


@pytest.mark.system
def test_slices_by_field_selector_and_labels(double: ApiDouble) -> None:
    double.serve_dra("1.37")
    add_resource_slice(double, "n1-gpus", "n1", NVIDIA, nvidia_devices())
    add_resource_slice(double, "n2-gpus", "n2", NVIDIA, nvidia_devices())
    path = "/apis/resource.k8s.io/v1/resourceslices"
    status, listed, _ = call(double, "GET", path + "?fieldSelector=spec.nodeName%3Dn1")
    assert status == 200 and [s["metadata"]["name"] for s in listed["items"]] == ["n1-gpus"]
    assert listed["kind"] == "ResourceSliceList" and listed["metadata"]["resourceVersion"]
    status, answer, _ = call(double, "GET", path + "?fieldSelector=spec.devices.name%3Dgpu-0")
    assert status == 400 and "field label not supported" in answer["message"]
    assert call(double, "POST", path, {"metadata": {"name": "bad"}, "spec": {"driver": NVIDIA}})[0] == 422
    call(double, "POST", RULES.format(version="v1"), rule())
    rules = "/apis/resource.k8s.io/v1/devicetaintrules"
    assert len(call(double, "GET", rules + "?labelSelector=team%3Dml")[1]["items"]) == 1
    assert call(double, "GET", rules + "?labelSelector=team%3Dother")[1]["items"] == []
