"""ValidatingAdmissionPolicy evaluated as the API server's plugin does (cel-python runs the CEL), for the
admission policy tests of deploy/: the policy documents, requests as the agent sends them, Node objects."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import celpy
import yaml
from celpy.evaluation import CELEvalError

from probes.base import CATEGORIES
from support.system import REPO

POLICY_FILE = REPO / "deploy" / "admission-policy.yaml"
AGENT = "system:serviceaccount:node-health:node-health"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"
NODE = "npu-node-7"
OWN_CONDITIONS = {category.condition_type for category in CATEGORIES.values()}


def own_taint_keys(keys: set[str]) -> set[str]:
    return {key for key in keys if key.startswith("node-health/")}


def policy_documents() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(POLICY_FILE.read_text()) if doc}
    return docs["ValidatingAdmissionPolicy"], docs["ValidatingAdmissionPolicyBinding"]


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    messages: tuple[str, ...]


class AdmissionPolicy:
    """One ValidatingAdmissionPolicy, compiled with celpy."""

    def __init__(self, policy: dict[str, Any]) -> None:
        spec = policy["spec"]
        assert spec["failurePolicy"] == "Fail"
        self._env = celpy.Environment()
        self.rules = spec["matchConstraints"]["resourceRules"]
        self.match_conditions = [self._compile(c["expression"]) for c in spec.get("matchConditions", [])]
        self.variables = [(v["name"], self._compile(v["expression"])) for v in spec.get("variables", [])]
        self.validations = [
            (
                self._compile(v["expression"]),
                v.get("message", ""),
                self._compile(v["messageExpression"]) if "messageExpression" in v else None,
            )
            for v in spec["validations"]
        ]

    def _compile(self, expression: str) -> Callable[[dict[str, Any]], Any]:
        program = self._env.program(self._env.compile(expression))

        def evaluate(activation: dict[str, Any]) -> Any:
            result = program.evaluate(activation)
            if isinstance(result, CELEvalError):
                raise result
            return result

        return evaluate

    def _in_scope(self, request: dict[str, Any]) -> bool:
        resource = request["resource"]["resource"] + (f"/{request['subResource']}" if request["subResource"] else "")
        return any(
            request["operation"] in rule["operations"]
            and request["resource"]["group"] in rule["apiGroups"]
            and resource in rule["resources"]
            for rule in self.rules
        )

    def admit(self, request: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> Verdict:
        if not self._in_scope(request):
            return Verdict(True, ())
        activation: dict[str, Any] = {
            "request": celpy.json_to_cel(request),
            "oldObject": celpy.json_to_cel(old),
            "object": celpy.json_to_cel(new),
        }
        try:
            if not all(condition(activation) for condition in self.match_conditions):
                return Verdict(True, ())
            values = celpy.celtypes.MapType()
            for name, variable in self.variables:
                activation["variables"] = values
                values = celpy.celtypes.MapType({**values, celpy.celtypes.StringType(name): variable(activation)})
            activation["variables"] = values
        except CELEvalError as exc:
            return Verdict(False, (f"evaluation error (failurePolicy Fail): {exc}",))
        messages = []
        for validation, message, message_expression in self.validations:
            try:
                if validation(activation):
                    continue
            except CELEvalError as exc:
                messages.append(f"evaluation error (failurePolicy Fail): {exc}")
                continue
            try:
                messages.append(str(message_expression(activation)) if message_expression else message)
            except CELEvalError:
                messages.append(message)
        return Verdict(not messages, tuple(messages))


def request_by(
    username: str, node_claim: str | None, subresource: str = "", name: str = NODE, operation: str = "UPDATE"
) -> dict[str, Any]:
    extra: dict[str, list[str]] = {}
    if node_claim is not None:
        extra = {
            NODE_NAME_KEY: [node_claim],
            "authentication.kubernetes.io/pod-name": ["node-health-x7k2p"],
            "authentication.kubernetes.io/pod-uid": ["4c1f0a52-6f6e-4d2a-9d7e-2b7c3d0f1e11"],
        }
    return {
        "operation": operation,
        "resource": {"group": "", "version": "v1", "resource": "nodes"},
        "subResource": subresource,
        "name": name,
        "userInfo": {
            "username": username,
            "groups": ["system:serviceaccounts", "system:serviceaccounts:node-health", "system:authenticated"],
            "extra": extra,
        },
    }


def agent_request(subresource: str = "", node_claim: str | None = NODE, name: str = NODE) -> dict[str, Any]:
    return request_by(AGENT, node_claim, subresource, name)


def condition(type_: str, status: str, reason: str, at: str = "2026-11-02T08:00:00Z") -> dict[str, str]:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": f"{type_} {status}",
        "lastHeartbeatTime": at,
        "lastTransitionTime": at,
    }


def npu_node(name: str = NODE) -> dict[str, Any]:
    """A Node as the API server stores it: kubelet's fields, the Ascend device plugin's, ours."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": "9b2e7c1a-0d4f-4e55-8a3b-6f1d2c3b4a59",
            "resourceVersion": "81234",
            "creationTimestamp": "2026-10-01T07:12:44Z",
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/arch": "arm64",
                "accelerator": "huawei-Ascend910",
                "node.kubernetes.io/npu.chip.name": "910B1",
                "node-health/ready": "true",
            },
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            },
            "managedFields": [{"manager": "kubelet", "operation": "Update", "apiVersion": "v1"}],
        },
        "spec": {
            "podCIDR": "10.244.7.0/24",
            "podCIDRs": ["10.244.7.0/24"],
            "providerID": "baremetal://npu-node-7",
            "taints": [
                {"key": "dedicated", "value": "training", "effect": "NoSchedule"},
                {"key": "node-health/time", "value": "ClockSkew", "effect": "NoSchedule"},
            ],
        },
        "status": {
            "capacity": {"cpu": "192", "memory": "1584948916Ki", "pods": "110", "huawei.com/Ascend910": "8"},
            "allocatable": {"cpu": "190", "memory": "1572365972Ki", "pods": "110", "huawei.com/Ascend910": "8"},
            "addresses": [{"type": "InternalIP", "address": "10.0.7.17"}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"kubeletVersion": "v1.30.4", "containerRuntimeVersion": "containerd://1.7.20"},
            "conditions": [
                condition("Ready", "True", "KubeletReady"),
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                condition("KernelDeadlock", "False", "KernelHasNoDeadlock"),
                condition("NPUHealthy", "True", "Healthy"),
                condition("ClockSynced", "False", "ClockSkew"),
            ],
        },
    }


def changed(node: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The node after `change`, with what the API server changes on every write."""
    new = copy.deepcopy(node)
    change(new)
    new["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
    new["metadata"]["managedFields"] = [*node["metadata"]["managedFields"], {"manager": "node-health"}]
    return new
