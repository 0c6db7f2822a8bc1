"""deploy/examples/arc/: node-health's pre-flight in GitHub Actions runner pods (ARC), as docs/preflight.md shows.

- runner-scale-set-values.yaml: the runner's pod template validates as a Pod (kubernetes-validate, strict, 1.30
  and the newest); its job-started hook and container-hook template are the files of the ConfigMap it mounts, made
  by the command in its header.
- hook-template.yaml: the k8s-mode pod template validates as a Pod (its `$job` container named as the hook names
  it), and its init container runs preflight.sh from the ConfigMap.
- idle-runner-reaper.yaml: every manifest validates; its RBAC is read-only except deleting EphemeralRunners in the
  runners' namespace; its script is POSIX sh (shellcheck), and its taint filter, run with the real awk on
  kubectl's jsonpath lines, picks the nodes with a node-health NoSchedule or NoExecute taint and no others.
The runner itself cannot run here; the script it runs is tested under bash -e in test_preflight.py.
"""

from __future__ import annotations

import copy
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.system import REPO, require_tool

ARC = REPO / "deploy" / "examples" / "arc"
VERSIONS = [kubernetes_validate.utils.latest_version(), "1.30"]


def pod(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "example"}, "spec": spec}


def values() -> dict[str, Any]:
    return dict(yaml.safe_load((ARC / "runner-scale-set-values.yaml").read_text()))


def assert_names_its_pod(env: dict[str, Any]) -> None:
    """POD_NAMESPACE and POD_NAME from the downward API: preflight.sh asks /ready?pod= (docs/preflight.md)."""
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


@pytest.mark.parametrize("version", VERSIONS)
def test_runner_pod_template_validates_and_runs_the_hook_from_its_configmap(version: str) -> None:
    spec = values()["template"]["spec"]
    kubernetes_validate.validate(pod(spec), version, strict=True)
    (runner,) = spec["containers"]
    env = {e["name"]: e for e in runner["env"]}
    (mount,) = runner["volumeMounts"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    configmap = volumes[mount["name"]]["configMap"]["name"]
    assert env["ACTIONS_RUNNER_HOOK_JOB_STARTED"]["value"] == f"{mount['mountPath']}/preflight.sh"
    assert env["ACTIONS_RUNNER_CONTAINER_HOOK_TEMPLATE"]["value"] == f"{mount['mountPath']}/hook-template.yaml"
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert int(env["NODE_HEALTH_WAIT_SECONDS"]["value"]) > 0
    assert_names_its_pod(env)
    header = (ARC / "runner-scale-set-values.yaml").read_text()
    joined = re.sub(r"\\\n#\s+", "", header)  # the command's continuation line
    (command,) = [line for line in joined.splitlines() if "kubectl create configmap" in line]
    assert f"kubectl create configmap {configmap} " in command
    assert "--from-file=deploy/examples/preflight.sh" in command
    assert "--from-file=deploy/examples/arc/hook-template.yaml" in command


@pytest.mark.parametrize("version", VERSIONS)
def test_hook_template_adds_the_preflight_init_container(version: str) -> None:
    template = yaml.safe_load((ARC / "hook-template.yaml").read_text())
    spec = copy.deepcopy(template["spec"])
    (job,) = spec["containers"]
    assert job == {"name": "$job"}, "only the job's own container, which the hook fills in"
    spec["containers"] = [{"name": "job", "image": "job-image"}]  # as the hook creates it
    kubernetes_validate.validate(pod(spec), version, strict=True)
    (init,) = spec["initContainers"]
    (mount,) = init["volumeMounts"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mount["name"]]["configMap"]["name"] == "node-health-preflight"
    assert init["command"] == ["/bin/sh", f"{mount['mountPath']}/preflight.sh"]
    assert_names_its_pod({e["name"]: e for e in init["env"]})


def reaper() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((ARC / "idle-runner-reaper.yaml").read_text()) if doc]


def reaper_script() -> str:
    (cronjob,) = [doc for doc in reaper() if doc["kind"] == "CronJob"]
    (container,) = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["/bin/sh", "-c"]
    return str(container["args"][0])


@pytest.mark.parametrize("version", VERSIONS)
def test_idle_runner_reaper_validates_and_may_delete_only_runners(version: str) -> None:
    docs = reaper()
    for doc in docs:
        manifest = copy.deepcopy(doc)
        manifest["metadata"].setdefault("namespace", "arc-runners")
        kubernetes_validate.validate(manifest, version, strict=True)
    rules = [(doc["kind"], rule) for doc in docs if doc["kind"] in ("Role", "ClusterRole") for rule in doc["rules"]]
    writes = [(kind, rule) for kind, rule in rules if set(rule["verbs"]) - {"get", "list", "watch"}]
    assert writes == [
        ("Role", {"apiGroups": ["actions.github.com"], "resources": ["ephemeralrunners"], "verbs": ["get", "delete"]})
    ]


@pytest.mark.system
def test_idle_runner_reaper_script_is_posix_sh() -> None:
    shellcheck = require_tool("shellcheck")
    done = subprocess.run(
        [shellcheck, "--shell=sh", "-"], input=reaper_script(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout


@pytest.mark.system
def test_idle_runner_reaper_picks_the_nodes_node_health_keeps_pods_from(tmp_path: Path) -> None:
    # The lines kubectl's jsonpath prints: the node name, then key=effect for each taint.
    nodes = "\n".join(
        [
            "gpu-1 node-health/gpu=NoSchedule ",
            "gpu-2 node-health/storage=PreferNoSchedule ",
            "gpu-3 other/node-health/gpu=NoSchedule ",
            "gpu-4 node.kubernetes.io/unschedulable=NoSchedule node-health/time=NoExecute ",
            "gpu-5 ",
        ]
    )
    (awk,) = re.findall(r"awk '([^']+)'", reaper_script())
    done = subprocess.run(
        [require_tool("awk"), awk], input=nodes + "\n", capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["gpu-1", "gpu-4"], shlex.quote(done.stdout)
