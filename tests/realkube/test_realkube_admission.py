"""The admission policies on a real kube-apiserver 1.37 and 1.36: the manifests apply server-side, both policies
type-check clean against each release's Node and DeviceTaintRule schemas, a pod-bound token may write only what
its agent owns on its own Node, and tokens without a node name (TokenRequest bound to nothing, a legacy Secret
token without any `extra`) get the policies' 403 with their message, not an evaluation error."""

from __future__ import annotations

from typing import Any

import pytest
from support.realkube import Plane, plane, wait_for
from support.realkube_objects import apply, install, type_check

pytestmark = [pytest.mark.system, pytest.mark.realkube]
POLICIES = ("node-health-own-node", "node-health-own-devices")
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"  # conditions merged by type, as the agent patches them
NO_NODE = "the node-health agent token carries no node name (authentication.kubernetes.io/node-name): refused"
RULES = {"1.37": "v1", "1.36": "v1beta2"}


def _installed(release: str) -> Plane:
    real = plane(release)
    install(real)
    for node in ("adm-a", "adm-b"):
        if real.request("GET", f"/api/v1/nodes/{node}")[0] == 404:
            real.register_node(node)
    return real


def _patch(real: Plane, path: str, body: dict[str, Any], token: str, kind: str = MERGE) -> tuple[int, str]:
    status, answer = real.request("PATCH", path, body, token=token, content_type=kind)
    return status, (answer or {}).get("message", "") if isinstance(answer, dict) else str(answer)


def _rule(node: str, pool: str) -> dict[str, Any]:
    return {
        "metadata": {"name": f"adm-{node}-{pool}", "labels": {"node-health/node": node}},
        "spec": {
            "deviceSelector": {"driver": "gpu.nvidia.com", "pool": pool, "device": "gpu-0"},
            "taint": {"key": "node-health/gpu", "value": "GpuHeldOutOfBand", "effect": "NoSchedule"},
        },
    }


@pytest.mark.parametrize("release", ["1.37", "1.36"])
def test_the_policies_type_check_clean(release: str) -> None:
    real = _installed(release)
    for name in POLICIES:
        checked = wait_for(f"{name}'s type check", lambda name=name: type_check(real, name) is not None, 60)
        assert checked
        assert not (type_check(real, name) or {}).get("expressionWarnings"), type_check(real, name)
    # The check can fail: a field the release's Node schema cannot type (a map of quantities) is reported.
    probe = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": "typecheck-probe"},
        "spec": {
            "matchConstraints": {
                "resourceRules": [
                    {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["nodes"]}
                ]
            },
            "validations": [{"expression": "!has(object.status.capacity) || object.status.capacity == {}"}],
        },
    }
    assert apply(real, [probe])[0][1] in (200, 201)
    warned = wait_for("the probe's type check", lambda: type_check(real, "typecheck-probe"), 60)
    assert "capacity" in str(warned.get("expressionWarnings")), warned


@pytest.mark.parametrize("release", ["1.37", "1.36"])
def test_a_pod_bound_token_writes_only_what_its_agent_owns_on_its_own_node(release: str) -> None:
    real = _installed(release)
    token = real.node_token("adm-a")
    own, other = "/api/v1/nodes/adm-a", "/api/v1/nodes/adm-b"
    mine = {"metadata": {"labels": {"node-health/tainted": "true"}}, "spec": {"taints": []}}
    taints = (real.request("GET", own)[1]["spec"].get("taints") or []) + [
        {"key": "node-health/gpu", "value": "GpuHeldOutOfBand", "effect": "NoSchedule"}
    ]
    mine["spec"]["taints"] = taints
    assert _patch(real, own, mine, token) == (200, "")
    condition = {"type": "GPUHealthy", "status": "False", "reason": "GpuHeldOutOfBand", "message": "gpu3"}
    assert _patch(real, own + "/status", {"status": {"conditions": [condition]}}, token, STRATEGIC)[0] == 200
    refused = {
        "another node": (other, {"metadata": {"labels": {"node-health/tainted": "true"}}}, "may not change Node"),
        "a foreign label": (own, {"metadata": {"labels": {"team": "x"}}}, "labels under node-health/"),
        "a foreign annotation": (own, {"metadata": {"annotations": {"x/y": "1"}}}, "annotations under"),
        "the not-ready taint removed": (own, {"spec": {"taints": taints[1:]}}, "taints under node-health/"),
        "cordon": (own, {"spec": {"unschedulable": True}}, "may not change the Node's spec"),
        "capacity": (own + "/status", {"status": {"capacity": {"cpu": "1"}}}, "may not change the Node's status"),
    }
    for what, (path, body, message) in refused.items():
        status, text = _patch(real, path, body, token)
        assert status == 403 and message in text, (what, status, text)
    ready = [{"type": "Ready", "status": "False", "reason": "Bad"}]
    status, text = _patch(real, own + "/status", {"status": {"conditions": ready}}, token, STRATEGIC)
    assert status == 403 and "may only write the conditions" in text, text
    rules = f"/apis/resource.k8s.io/{RULES[release]}/devicetaintrules"
    status, answer = real.request("POST", rules, _rule("adm-a", "adm-a"), token=token)
    assert status == 201, answer
    status, answer = real.request("POST", rules, _rule("adm-b", "adm-b"), token=token)
    assert status == 403 and "may only write DeviceTaintRules labelled node-health/node=adm-a" in answer["message"]
    status, answer = real.request(
        "POST",
        rules,
        {**_rule("adm-a", "adm-b"), "metadata": {"name": "x", "labels": {"node-health/node": "adm-a"}}},
        token=token,
    )
    assert status == 403 and "must select one device of pool adm-a" in answer["message"], answer


@pytest.mark.parametrize("release", ["1.37", "1.36"])
@pytest.mark.parametrize("kind", ["unbound", "legacy"])
def test_a_token_without_a_node_name_gets_the_policies_403_with_their_message(release: str, kind: str) -> None:
    real = _installed(release)
    token = real.unbound_token() if kind == "unbound" else real.legacy_token()
    status, text = _patch(real, "/api/v1/nodes/adm-a", {"metadata": {"labels": {"node-health/x": "1"}}}, token)
    assert (status, text.endswith(NO_NODE)) == (403, True), (status, text)
    rules = f"/apis/resource.k8s.io/{RULES[release]}/devicetaintrules"
    status, answer = real.request("POST", rules, _rule("adm-a", "adm-a"), token=token)
    assert status == 403 and answer["message"].endswith(NO_NODE), answer
