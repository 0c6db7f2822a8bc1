"""deploy/admission-policy.yaml, evaluated: its CEL expressions run in a CEL implementation (cel-python) against
real Node object/oldObject pairs, as the API server's ValidatingAdmissionPolicy plugin runs them.

The evaluation follows the plugin's rules: a request outside matchConstraints or with a false matchCondition is
not the policy's business (allowed); variables are evaluated in order and seen as `variables.<name>`; every
validation that is false denies with its message (messageExpression first); an expression that fails to evaluate
denies, as failurePolicy Fail says. The agent's own writes are taken from a real agent reconciling its Node on
the in-repo API double (tests/support/kube_double.py): each stored change of the Node is an object/oldObject pair.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.admission import (
    AGENT,
    NODE,
    OWN_CONDITIONS,
    POLICY_FILE,
    AdmissionPolicy,
    Verdict,
    agent_request,
    changed,
    condition,
    npu_node,
    own_taint_keys,
    policy_documents,
    request_by,
)
from support.fake_node import FakeNode
from support.kube_double import ApiDouble
from support.system import REPO, require_fixtures, require_root, require_tool

from agent.config import KubernetesConfig
from probes.base import CATEGORIES


@pytest.fixture(scope="module")
def policy() -> AdmissionPolicy:
    return AdmissionPolicy(policy_documents()[0])


# --- the policy and the agent agree --------------------------------------------------------------------------


def test_policy_is_bound_and_matches_the_agent_and_its_config() -> None:
    policy, binding = policy_documents()
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["prefix"] == repr(KubernetesConfig().key_prefix + "/")
    owned = yaml.safe_load(variables["ownConditionTypes"])
    assert owned == [category.condition_type for category in CATEGORIES.values()]
    daemonset = yaml.safe_load((REPO / "deploy" / "daemonset.yaml").read_text())
    namespace, account = daemonset["metadata"]["namespace"], daemonset["spec"]["template"]["spec"]["serviceAccountName"]
    (match,) = policy["spec"]["matchConditions"]
    assert match["expression"] == f"request.userInfo.username == 'system:serviceaccount:{namespace}:{account}'"
    configmap = yaml.safe_load((REPO / "deploy" / "configmap.yaml").read_text())
    assert yaml.safe_load(configmap["data"]["config.yaml"])["kubernetes"]["key_prefix"] + "/" == "node-health/"


@pytest.mark.parametrize("part,own", [("spec", "taints"), ("status", "conditions")])
def test_policy_compares_every_other_node_field_of_every_schema(part: str, own: str) -> None:
    """Every spec and status field of Node in 1.30 and in the newest schema is compared, except the agent's own
    (read directly, or through dyn() where the release's type check cannot type the field or lacks it)."""
    text = POLICY_FILE.read_text()
    compared = set(re.findall(rf"has\((?:object\.{part}|dyn\(object\.{part}\))\.(\w+)\)", text))
    schema_dir = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    for version in ("1.30.0", kubernetes_validate.utils.all_versions()[-1]):
        definitions = json.loads((schema_dir / f"v{version}-local-strict" / "_definitions.json").read_text())
        definitions = definitions.get("definitions", definitions.get("$defs"))
        fields = set(definitions[f"io.k8s.api.core.v1.Node{part.title()}"]["properties"])
        assert fields - {own} <= compared, (version, sorted(fields - {own} - compared))


@pytest.mark.system
def test_rendered_default_kustomization_carries_this_policy() -> None:
    kubectl = require_tool("kubectl")
    result = subprocess.run([kubectl, "kustomize", str(REPO / "deploy")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    policy, binding = policy_documents()
    assert policy in docs and binding in docs


# --- what the agent may do on its own Node ---------------------------------------------------------------------


def test_own_node_label_change_is_allowed(policy: AdmissionPolicy) -> None:
    old = npu_node()
    new = changed(old, lambda n: n["metadata"]["labels"].update({"node-health/ready": "false"}))
    assert policy.admit(agent_request(), old, new) == Verdict(True, ())
    removed = changed(old, lambda n: n["metadata"]["labels"].pop("node-health/ready"))
    assert policy.admit(agent_request(), old, removed).allowed


def test_own_taints_change_and_foreign_taints_stay_is_allowed(policy: AdmissionPolicy) -> None:
    old = npu_node()

    def retaint(node: dict[str, Any]) -> None:
        node["spec"]["taints"] = [
            {"key": "node-health/npu", "value": "NpuHealthCritical", "effect": "NoSchedule"},
            {"key": "dedicated", "value": "training", "effect": "NoSchedule"},
        ]

    assert policy.admit(agent_request(), old, changed(old, retaint)).allowed
    untainted = changed(old, lambda n: n["spec"].pop("taints"))
    untainted["spec"]["taints"] = [{"key": "dedicated", "value": "training", "effect": "NoSchedule"}]
    assert policy.admit(agent_request(), old, untainted).allowed


def test_own_conditions_change_is_allowed(policy: AdmissionPolicy) -> None:
    old = npu_node()

    def reconditions(node: dict[str, Any]) -> None:
        conditions = node["status"]["conditions"]
        conditions[3] = condition("NPUHealthy", "False", "NpuHealthCritical", "2026-11-02T09:00:00Z")
        del conditions[4]  # ClockSynced: the category went away
        conditions.append(condition("StorageHealthy", "True", "Healthy", "2026-11-02T09:00:00Z"))

    assert policy.admit(agent_request("status"), old, changed(old, reconditions)) == Verdict(True, ())


# --- what it may not do ---------------------------------------------------------------------------------------


def test_foreign_taint_removed_is_denied(policy: AdmissionPolicy) -> None:
    old = npu_node()
    new = changed(old, lambda n: n["spec"]["taints"].pop(0))
    verdict = policy.admit(agent_request(), old, new)
    assert verdict == Verdict(
        False, ("the node-health agent may only add, change or remove taints under node-health/",)
    )
    revalued = changed(old, lambda n: n["spec"]["taints"][0].update({"value": "inference"}))
    assert not policy.admit(agent_request(), old, revalued).allowed
    added = changed(old, lambda n: n["spec"]["taints"].append({"key": "gpu", "effect": "NoExecute"}))
    assert not policy.admit(agent_request(), old, added).allowed


def test_another_node_is_denied(policy: AdmissionPolicy) -> None:
    other = npu_node("npu-node-8")
    new = changed(other, lambda n: n["metadata"]["labels"].update({"node-health/ready": "false"}))
    verdict = policy.admit(agent_request(node_claim=NODE, name="npu-node-8"), other, new)
    assert verdict == Verdict(False, ("the node-health agent on npu-node-7 may not change Node npu-node-8",))
    status = changed(other, lambda n: n["status"]["conditions"].pop(3))
    assert not policy.admit(agent_request("status", node_claim=NODE, name="npu-node-8"), other, status).allowed


def test_a_token_without_the_node_claim_is_denied(policy: AdmissionPolicy) -> None:
    old = npu_node()
    new = changed(old, lambda n: n["metadata"]["labels"].update({"node-health/ready": "false"}))
    verdict = policy.admit(agent_request(node_claim=None), old, new)
    assert not verdict.allowed
    assert "carries no node name" in verdict.messages[0]


def test_condition_of_a_foreign_type_is_denied(policy: AdmissionPolicy) -> None:
    old = npu_node()
    flipped = changed(old, lambda n: n["status"]["conditions"].__setitem__(0, condition("Ready", "False", "X")))
    verdict = policy.admit(agent_request("status"), old, flipped)
    assert not verdict.allowed
    assert "may only write the conditions NPUHealthy" in verdict.messages[0]
    added = changed(old, lambda n: n["status"]["conditions"].append(condition("FrequentDockerRestart", "True", "X")))
    assert not policy.admit(agent_request("status"), old, added).allowed
    removed = changed(old, lambda n: n["status"]["conditions"].pop(2))  # KernelDeadlock, node-problem-detector's
    assert not policy.admit(agent_request("status"), old, removed).allowed


@pytest.mark.parametrize(
    "what,change",
    [
        ("foreign label changed", lambda n: n["metadata"]["labels"].update({"accelerator": "huawei-Ascend310P"})),
        ("foreign label removed", lambda n: n["metadata"]["labels"].pop("node.kubernetes.io/npu.chip.name")),
        (
            "foreign label added",
            lambda n: n["metadata"]["labels"].update({"node-role.kubernetes.io/control-plane": ""}),
        ),
        ("annotation added", lambda n: n["metadata"]["annotations"].update({"x": "y"})),
        ("finalizer added", lambda n: n["metadata"].update({"finalizers": ["example.com/hold"]})),
        ("cordoned", lambda n: n["spec"].update({"unschedulable": True})),
        ("podCIDR changed", lambda n: n["spec"].update({"podCIDRs": ["10.244.8.0/24"]})),
        ("capacity forged", lambda n: n["status"]["capacity"].update({"huawei.com/Ascend910": "16"})),
        ("allocatable forged", lambda n: n["status"]["allocatable"].update({"nvidia.com/gpu": "8"})),
        ("addresses changed", lambda n: n["status"]["addresses"].pop(0)),
        ("features added", lambda n: n["status"].update({"features": {"supplementalGroupsPolicy": True}})),
    ],
)
def test_changes_outside_its_own_keys_are_denied(
    policy: AdmissionPolicy, what: str, change: Callable[[dict[str, Any]], None]
) -> None:
    old = npu_node()
    assert not policy.admit(agent_request(), old, changed(old, change)).allowed, what


def test_other_users_are_not_the_policys_business(policy: AdmissionPolicy) -> None:
    old = npu_node()
    new = changed(old, lambda n: n["spec"]["taints"].pop(0))
    kubelet = request_by("system:node:npu-node-7", None)
    cleanup = request_by("system:serviceaccount:node-health:node-health-cleanup", None)
    for request in (kubelet, cleanup):
        assert policy.admit(request, old, new).allowed
    # Outside matchConstraints: the agent's RBAC has no delete or create on nodes in the first place.
    assert policy.admit(request_by(AGENT, NODE, operation="DELETE"), old, new).allowed


# --- the agent's real writes pass ------------------------------------------------------------------------------


@pytest.mark.system
def test_the_agents_real_writes_pass_the_policy(policy: AdmissionPolicy, tmp_path: Path) -> None:
    """A real agent on a fake accelerator node taints, labels and conditions its Node on the API double; every
    stored change of that Node, taken as oldObject → object, is admitted for the agent's token on that node."""
    require_root()  # the fake node's mknod'ed device nodes
    node = FakeNode(tmp_path, require_fixtures(), interval=1.0, kube=True)
    config = node.prepare()
    config["kubernetes"]["max_unhealthy"] = "100%"  # let it taint (the fake node's default withholds taints)
    node.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    api = node.api
    assert isinstance(api, ApiDouble)
    foreign_taint = {"key": "dedicated", "value": "training", "effect": "NoSchedule"}
    api.mutate("nodes", "", node.node_name, lambda n: n["spec"].update({"taints": [foreign_taint]}))
    api.mutate(
        "nodes",
        "",
        node.node_name,
        lambda n: n["status"]["conditions"].append(condition("KernelDeadlock", "False", "KernelHasNoDeadlock")),
    )
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    last = [api.node(node.node_name)]

    def record(double: ApiDouble) -> None:
        current = double.node(node.node_name)
        if current != last[0]:
            pairs.append((last[0], current))
            last[0] = current

    api.after_write = record
    try:
        node.start_holder()
        node.start_agent()
        node.wait_ready_to_serve()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            current = api.node(node.node_name)
            keys = {t["key"] for t in current["spec"].get("taints", [])}
            types = {c["type"] for c in current["status"].get("conditions", [])}
            annotations = current["metadata"].get("annotations") or {}
            own = (
                own_taint_keys(keys) and types & OWN_CONDITIONS and "node-health/ready" in current["metadata"]["labels"]
            )
            if own and "node-health/isolated-devices" in annotations:  # its held NPU, on the node taint (no DRA)
                break
            time.sleep(0.5)
    finally:
        api.after_write = None
        node.close()
    assert pairs, "the agent wrote nothing to its Node"
    final = pairs[-1][1]
    assert own_taint_keys({t["key"] for t in final["spec"]["taints"]}), final
    assert {c["type"] for c in final["status"]["conditions"]} & OWN_CONDITIONS, final
    assert foreign_taint in final["spec"]["taints"]
    assert "KernelDeadlock" in {c["type"] for c in final["status"]["conditions"]}
    assert "node-health/isolated-devices" in final["metadata"]["annotations"]
    for old, new in pairs:
        for subresource in ("", "status"):
            verdict = policy.admit(agent_request(subresource, node.node_name, node.node_name), old, new)
            assert verdict.allowed, (verdict.messages, old, new)
    # The same writes, made with a token bound to another node, are refused.
    old, new = pairs[-1]
    assert not policy.admit(agent_request("", "fake-node-2", node.node_name), old, new).allowed
