"""deploy/components/preflight-injection: a MutatingAdmissionPolicy that adds the pre-flight init container to the
pods that ask for it (label node-health.io/preflight: "true").

What is proven here, and how. The API double (tests/support/kube_double.py) does not run admission plugins, and
no CEL implementation here knows Kubernetes' typed object construction (`Object.spec{...}`), so:
- rendered by kustomize over deploy/ and validated strictly as v1beta1 for Kubernetes 1.34 and the newest the
  validator knows, and as v1alpha1 (the overlay change the component documents) for 1.32;
- every CEL expression of the policy compiles in cel-python (the CEL grammar, typed construction included);
- the matchCondition is evaluated by cel-python on pods with and without the container; the binding's
  objectSelector is evaluated as a label selector;
- the mutation: its applyConfiguration expression, with each typed constructor read as a map (the fields it
  sets, nothing else), is evaluated by cel-python, merged into a job pod as server-side apply merges
  `initContainers` (by name), and the mutated pod validated strictly;
- the init container's command, taken from that result, runs under busybox sh and dash against a real agent
  (its HTTP server and state on 127.0.0.1): it fetches /preflight.sh with curl and runs it, exit 0 when ready,
  1 when not; with no agent, 3 (0 with NODE_HEALTH_FAIL_OPEN=1).
Not proven: an API server's own evaluation of the policy (no API server runs here)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml
from support.kustomize import overlay, rendered
from support.netservers import refused_port
from support.system import REPO, require_tool

from agent.http.routes import HttpServer
from agent.metrics import MetricsRenderer
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes.base import Finding, Status

COMPONENT = REPO / "deploy" / "components" / "preflight-injection"
LABEL = "node-health.io/preflight"
NAME = "node-health-preflight"


def policy_documents() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((COMPONENT / "preflight-policy.yaml").read_text())}
    return docs["MutatingAdmissionPolicy"], docs["MutatingAdmissionPolicyBinding"]


def job_pod(labels: dict[str, str], init: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "train", "image": "registry.example.com/train:1"}]}
    if init is not None:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train-0", "labels": labels}, "spec": spec}


@pytest.mark.system  # kubectl kustomize
def test_the_component_adds_the_policy_and_its_binding(tmp_path: Path) -> None:
    docs = rendered(overlay(tmp_path / "o", [REPO / "deploy"], (COMPONENT,)))
    base = rendered(REPO / "deploy")
    added = [doc for doc in docs if doc not in base]
    assert sorted((doc["kind"], doc["metadata"]["name"]) for doc in added) == [
        ("MutatingAdmissionPolicy", NAME),
        ("MutatingAdmissionPolicyBinding", NAME),
    ]


@pytest.mark.parametrize(
    ("version", "api_version"),
    [
        (kubernetes_validate.utils.latest_version(), "v1beta1"),
        ("1.34", "v1beta1"),
        ("1.32", "v1alpha1"),
    ],
)
def test_the_policy_validates(version: str, api_version: str) -> None:
    for doc in policy_documents():
        doc = copy.deepcopy(doc)
        doc["apiVersion"] = f"admissionregistration.k8s.io/{api_version}"
        kubernetes_validate.validate(doc, version, strict=True)


def expressions(policy: dict[str, Any]) -> list[str]:
    spec = policy["spec"]
    found = [c["expression"] for c in spec.get("matchConditions", [])]
    found += [m["applyConfiguration"]["expression"] for m in spec["mutations"] if "applyConfiguration" in m]
    return found


def test_every_expression_compiles() -> None:
    env = celpy.Environment()
    assert len(expressions(policy_documents()[0])) == 2
    for expression in expressions(policy_documents()[0]):
        env.compile(expression)
    with pytest.raises(celpy.CELParseError):
        env.compile("Object{spec: ")


def evaluate(expression: str, pod: dict[str, Any]) -> Any:
    env = celpy.Environment()
    program = env.program(env.compile(expression))
    return celpy.json_to_cel(program.evaluate({"object": celpy.json_to_cel(pod)}))


def plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, bool):
        return bool(value)
    return str(value) if isinstance(value, str) else value


def test_the_match_condition_skips_a_pod_that_has_the_container() -> None:
    condition = policy_documents()[0]["spec"]["matchConditions"][0]["expression"]
    assert evaluate(condition, job_pod({LABEL: "true"})) is not False
    assert bool(evaluate(condition, job_pod({LABEL: "true"}, [{"name": "setup", "image": "busybox"}])))
    assert not bool(evaluate(condition, job_pod({LABEL: "true"}, [{"name": NAME, "image": "x"}])))


def selected(binding: dict[str, Any], labels: dict[str, str]) -> bool:
    selector = binding["spec"]["matchResources"]["objectSelector"]
    assert set(selector) == {"matchLabels"}
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_only_pods_that_ask_are_mutated() -> None:
    binding = policy_documents()[1]
    assert binding["spec"]["policyName"] == policy_documents()[0]["metadata"]["name"]
    assert selected(binding, {LABEL: "true", "app": "train"})
    assert not selected(binding, {LABEL: "false"})
    assert not selected(binding, {"app": "train"})


def as_map_literal(expression: str) -> str:
    """The apply configuration with each typed constructor (`Object.spec{`) read as a map (`{`) and each field name
    quoted, outside string literals; everything else as written."""
    out, i = [], 0
    while i < len(expression):
        char = expression[i]
        if char == "'":
            end = expression.index("'", i + 1)
            out.append(expression[i : end + 1])
            i = end + 1
            continue
        constructor = re.match(r"Object(\.\w+)*\{", expression[i:])
        field = re.match(r"(\w+)\s*:", expression[i:])
        if constructor:
            out.append("{")
            i += constructor.end()
        elif field and (not out or not re.search(r"[\w.]$", "".join(out[-1:]))):
            out.append(f"'{field.group(1)}':")
            i += field.end()
        else:
            out.append(char)
            i += 1
    return "".join(out)


def mutated(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod after the policy's mutation, merged as server-side apply merges initContainers: by name."""
    mutation = policy_documents()[0]["spec"]["mutations"][0]
    assert mutation["patchType"] == "ApplyConfiguration"
    applied = plain(evaluate(as_map_literal(mutation["applyConfiguration"]["expression"]), pod))
    assert set(applied) == {"spec"} and set(applied["spec"]) == {"initContainers"}
    result = copy.deepcopy(pod)
    containers = result["spec"].setdefault("initContainers", [])
    for container in applied["spec"]["initContainers"]:
        same = [c for c in containers if c["name"] == container["name"]]
        if same:
            same[0].update(container)
        else:
            containers.append(container)
    return result


@pytest.mark.parametrize("version", [kubernetes_validate.utils.latest_version(), "1.34"])
def test_the_mutation_adds_one_valid_init_container(version: str) -> None:
    own = {"name": "setup", "image": "busybox"}
    pod = mutated(job_pod({LABEL: "true"}, [own]))
    kubernetes_validate.validate(pod, version, strict=True)
    init = pod["spec"]["initContainers"]
    assert [c["name"] for c in init] == ["setup", NAME] and init[0] == own
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in init[1]["env"]}
    assert env == {"POD_NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"}
    assert pod["spec"]["containers"] == job_pod({})["spec"]["containers"]
    assert mutated(job_pod({LABEL: "true"}))["spec"]["initContainers"][0]["name"] == NAME


def init_command() -> list[str]:
    container = mutated(job_pod({LABEL: "true"}))["spec"]["initContainers"][0]
    assert container["command"][:2] == ["/bin/sh", "-c"]
    return container["command"][2:]


def run_init(shell: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    require_tool("curl")
    argv = [require_tool("busybox"), "sh"] if shell == "busybox" else [require_tool(shell)]
    return subprocess.run(
        [*argv, "-c", *init_command()],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )


@pytest.mark.system  # a server on 127.0.0.1
@pytest.mark.parametrize("shell", ["busybox", "dash"])
def test_the_init_container_fetches_the_script_from_the_agent_and_runs_it(shell: str) -> None:
    state = HealthState("node-a", HealthSettings(fail_threshold=1, recovery_threshold=1))
    state.configure([ProbeSpec("p0", ("storage.space",), 60.0, 5.0)])
    server = HttpServer(
        state,
        MetricsRenderer(state.current).render,
        lambda: (True, {}),
        lambda: ["storage.space"],
        address="127.0.0.1",
        port=0,
    )
    server.start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        state.record("p0", [Finding("storage.space", "/data", Status.OK, "OK", "12% used", "")])
        ready = run_init(shell, {"NODE_HEALTH_URL": url})
        assert ready.returncode == 0 and ready.stdout.splitlines()[-1] == "ready on node-a", ready
        state.record("p0", [Finding("storage.space", "/data", Status.FAIL, "DiskFull", "98% used", "clean it")])
        not_ready = run_init(shell, {"NODE_HEALTH_URL": url})
        assert not_ready.returncode == 1 and "DiskFull: 98% used" in not_ready.stdout, not_ready
    finally:
        server.stop()


@pytest.mark.system  # a refused port on 127.0.0.1
def test_without_an_agent_it_fails_closed_or_open_as_asked() -> None:
    url = f"http://127.0.0.1:{refused_port()}"
    closed = run_init("busybox", {"NODE_HEALTH_URL": url})
    assert closed.returncode == 3 and "no node-health agent served" in closed.stderr, closed
    opened = run_init("busybox", {"NODE_HEALTH_URL": url, "NODE_HEALTH_FAIL_OPEN": "1"})
    assert opened.returncode == 0 and "the job starts unchecked" in opened.stderr, opened
