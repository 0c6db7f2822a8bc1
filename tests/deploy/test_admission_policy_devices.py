"""deploy/admission-policy-devices.yaml, evaluated like deploy/admission-policy.yaml (test_admission_policy.py runs
the CEL with cel-python as the API server's ValidatingAdmissionPolicy plugin does): each agent may write only
DeviceTaintRules labelled with its own node, selecting one device of its own pool. The agent's real rule writes,
from a real agent on a fake node with the NVIDIA DRA driver's slice, pass; the same writes with another node's
token do not. Also the node policy's allowance for the agent's own annotation (`node-health/isolated-devices`)."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.admission import (
    AGENT,
    NODE,
    NODE_NAME_KEY,
    AdmissionPolicy,
    agent_request,
    changed,
    npu_node,
    policy_documents,
)
from support.fake_node import FakeNode
from support.kube_double import ApiDouble
from support.system import REPO, require_fixtures, require_root

from agent.config import KubernetesConfig
from agent.kube.devices.match import RULE_LABELS

POLICY_FILE = REPO / "deploy" / "admission-policy-devices.yaml"


def device_policy_documents() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(POLICY_FILE.read_text()) if doc}
    return docs["ValidatingAdmissionPolicy"], docs["ValidatingAdmissionPolicyBinding"]


@pytest.fixture(scope="module")
def policy() -> AdmissionPolicy:
    return AdmissionPolicy(device_policy_documents()[0])


def rule_request(operation: str, node_claim: str | None = NODE, username: str = AGENT) -> dict[str, Any]:
    extra = {NODE_NAME_KEY: [node_claim]} if node_claim is not None else {}
    return {
        "operation": operation,
        "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "devicetaintrules"},
        "subResource": "",
        "name": "r",
        "userInfo": {"username": username, "groups": ["system:serviceaccounts"], "extra": extra},
    }


def rule(node: str = NODE, pool: str | None = None, selector: dict[str, Any] | None = None) -> dict[str, Any]:
    wanted = selector if selector is not None else {"driver": "gpu.nvidia.com", "pool": pool or node, "device": "gpu-3"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": f"node-health.gpu.{node}.gpu.nvidia.com.gpu-3",
            "resourceVersion": "17",
            "labels": {**RULE_LABELS, "node-health/node": node, "node-health/category": "gpu"},
        },
        "spec": {
            "deviceSelector": wanted,
            "taint": {"key": "node-health/gpu", "value": "GpuHeldOutOfBand", "effect": "NoSchedule"},
        },
    }


def admit(policy: AdmissionPolicy, operation: str, old: Any, new: Any, node_claim: str | None = NODE) -> Any:
    return policy.admit(rule_request(operation, node_claim), old, new)


def test_policy_is_bound_and_matches_the_agent() -> None:
    devices, binding = device_policy_documents()
    node_policy, _ = policy_documents()
    assert binding["spec"] == {"policyName": devices["metadata"]["name"], "validationActions": ["Deny"]}
    variables = {v["name"]: v["expression"] for v in devices["spec"]["variables"]}
    assert variables["prefix"] == repr(KubernetesConfig().key_prefix + "/")
    assert devices["spec"]["matchConditions"] == node_policy["spec"]["matchConditions"]
    node_variables = {v["name"]: v["expression"] for v in node_policy["spec"]["variables"]}
    assert variables["tokenNodeName"] == node_variables["tokenNodeName"]
    rules = devices["spec"]["matchConstraints"]["resourceRules"]
    assert rules == [
        {
            "apiGroups": ["resource.k8s.io"],
            "apiVersions": ["v1", "v1beta2"],
            "operations": ["CREATE", "UPDATE", "DELETE"],
            "resources": ["devicetaintrules"],
        }
    ]


def test_the_agents_own_rules_are_allowed(policy: AdmissionPolicy) -> None:
    mine = rule()
    assert admit(policy, "CREATE", None, mine).allowed
    revalued = copy.deepcopy(mine)
    revalued["spec"]["taint"]["value"] = "GpuSharedByPods"
    assert admit(policy, "UPDATE", mine, revalued).allowed
    assert admit(policy, "DELETE", mine, None).allowed


@pytest.mark.parametrize(
    "what,old,new,operation",
    [
        ("another node's label", None, rule(node="npu-node-8"), "CREATE"),
        ("another node's pool", None, rule(pool="npu-node-8"), "CREATE"),
        ("no device", None, rule(selector={"driver": "gpu.nvidia.com", "pool": NODE}), "CREATE"),
        ("no driver", None, rule(selector={"pool": NODE, "device": "gpu-3"}), "CREATE"),
        ("an empty selector: every device of the cluster", None, rule(selector={}), "CREATE"),
        (
            "an extra selector field",
            None,
            rule(selector={"driver": "d.example.com", "pool": NODE, "device": "x", "deviceClassName": "c"}),
            "CREATE",
        ),
        ("a rule of another node relabelled", rule(node="npu-node-8"), rule(), "UPDATE"),
        ("another node's rule deleted", rule(node="npu-node-8"), None, "DELETE"),
    ],
)
def test_other_rules_are_denied(policy: AdmissionPolicy, what: str, old: Any, new: Any, operation: str) -> None:
    assert not admit(policy, operation, old, new).allowed, what


def test_a_foreign_taint_key_and_a_token_without_a_node_are_denied(policy: AdmissionPolicy) -> None:
    foreign = rule()
    foreign["spec"]["taint"]["key"] = "team/maintenance"
    assert not admit(policy, "CREATE", None, foreign).allowed
    verdict = admit(policy, "CREATE", None, rule(), node_claim=None)
    assert not verdict.allowed and "carries no node name" in verdict.messages[0]
    unlabelled = rule()
    del unlabelled["metadata"]["labels"]
    assert not admit(policy, "DELETE", unlabelled, None).allowed, "a foreign rule (no labels) is not the agent's"


def test_other_users_are_not_the_policys_business(policy: AdmissionPolicy) -> None:
    request = rule_request("CREATE", None, username="system:serviceaccount:gpu-operator:nvidia-dra-driver")
    assert policy.admit(request, None, rule(selector={})).allowed


def test_the_node_policy_lets_the_agent_write_only_its_own_annotation() -> None:
    node_policy = AdmissionPolicy(policy_documents()[0])
    old = npu_node()
    key = "node-health/isolated-devices"
    added = changed(old, lambda n: n["metadata"]["annotations"].update({key: '[{"device":"npu3"}]'}))
    assert node_policy.admit(agent_request(), old, added).allowed
    removed = changed(added, lambda n: n["metadata"]["annotations"].pop(key))
    assert node_policy.admit(agent_request(), added, removed).allowed
    foreign = changed(old, lambda n: n["metadata"]["annotations"].update({"node.alpha.kubernetes.io/ttl": "30"}))
    verdict = node_policy.admit(agent_request(), old, foreign)
    assert verdict.messages == ("the node-health agent may only add, change or remove annotations under node-health/",)


@pytest.mark.system
def test_the_agents_real_rule_writes_pass_the_policy(policy: AdmissionPolicy, tmp_path: Path) -> None:
    """A real agent on a fake node with the NVIDIA DRA driver's slice: the rule it creates for the GPU held out of
    band, and the delete when the holder is gone, are admitted for its token and refused for another node's."""
    require_root()
    node = FakeNode(tmp_path, require_fixtures(), hold="nvidia3", dra="1.37", publish=("gpu",))
    node.prepare()
    api = node.api
    assert isinstance(api, ApiDouble)
    changes: list[tuple[str, Any, Any]] = []
    stored: dict[str, dict[str, Any]] = {}

    def record(double: ApiDouble) -> None:
        assert double.last_saved is not None
        resource, _, name = double.last_saved
        if resource == "devicetaintrules":
            new = copy.deepcopy(double._store.objects[double.last_saved])
            changes.append(("UPDATE" if name in stored else "CREATE", stored.get(name), new))
            stored[name] = new

    def before(method: str, path: str) -> None:
        name = path.rsplit("/", 1)[-1]
        if method == "DELETE" and name in stored:
            changes.append(("DELETE", stored.pop(name), None))

    api.after_write, api.before_write = record, before
    try:
        node.start_holder()
        node.start_agent()
        node.wait_ready_to_serve()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(op == "CREATE" for op, _, _ in changes):
            time.sleep(0.3)
        node.stop_holder()
        while time.monotonic() < deadline and not any(op == "DELETE" for op, _, _ in changes):
            time.sleep(0.3)
    finally:
        api.after_write = api.before_write = None
        node.close()
    assert {op for op, _, _ in changes} >= {"CREATE", "DELETE"}, changes
    for operation, old, new in changes:
        verdict = admit(policy, operation, old, new, node_claim=node.node_name)
        assert verdict.allowed, (verdict.messages, operation, old, new)
        assert not admit(policy, operation, old, new, node_claim="fake-node-2").allowed
