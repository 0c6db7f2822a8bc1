"""`node-health cleanup` against the API double: it takes off exactly what the agent put on the Nodes, releases
the budget, and says what it did; deploy/examples/cleanup-job.yaml runs it with least privilege."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.cli import node_env
from support.kube_double import ApiDouble
from support.kube_helpers import BUDGET_NS, budget_configmap, conditions, fleet_record, labels
from support.system import REPO

from agent.cli import main

JOB = REPO / "deploy" / "examples" / "cleanup-job.yaml"
FOREIGN_TAINTS = [
    {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
    {"key": "node-healthy", "value": "x", "effect": "PreferNoSchedule"},  # not under node-health/
]
FOREIGN_CONDITIONS = [
    {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting"},
    {"type": "KernelDeadlock", "status": "False", "reason": "KernelHasNoDeadlock", "message": "npd"},
]
FOREIGN_LABELS = {"team": "ml", "node-health.example.com/x": "y", "topology.kubernetes.io/zone": "a"}
OUR_TAINT = {"key": "node-health/network", "value": "DnsFailed", "effect": "NoSchedule"}
OUR_SOFT = {"key": "node-health/storage", "value": "DiskLow", "effect": "PreferNoSchedule"}
OUR_LABELS = {"node-health/ready": "false", "node-health/tainted": "true"}
OUR_CONDITIONS = [
    {"type": "NetworkHealthy", "status": "False", "reason": "DnsFailed", "message": "fail: DnsFailed (network.dns)"},
    {"type": "StorageHealthy", "status": "True", "reason": "Healthy", "message": "warn: DiskLow (storage.space)"},
]


@pytest.fixture
def cluster(double: ApiDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Three nodes carrying ours and others' things, a budget with slots; a kubeconfig and a config for the CLI."""
    double.add_node(
        "gpu-1",
        labels={**FOREIGN_LABELS, **OUR_LABELS},
        taints=[FOREIGN_TAINTS[0], OUR_TAINT, FOREIGN_TAINTS[1], OUR_SOFT],
        conditions=[FOREIGN_CONDITIONS[0], *OUR_CONDITIONS, FOREIGN_CONDITIONS[1]],
    )
    double.add_node("gpu-2", labels=dict(FOREIGN_LABELS), taints=list(FOREIGN_TAINTS), conditions=FOREIGN_CONDITIONS)
    double.add_node("gpu-3", labels={"node-health/ready": "true"}, taints=[OUR_SOFT], conditions=OUR_CONDITIONS[1:])
    slot = json.dumps({"acquired_at": 1.0, "taints": "network=DnsFailed"})
    data = {"gpu-1": slot, "gone-node": slot}
    double.create("configmaps", BUDGET_NS, budget_configmap(data, {"nodes": 3, "counted_at": 1.0}))
    kubeconfig = double.write_kubeconfig(tmp_path / "kubeconfig", user="cleanup")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("POD_NAMESPACE", BUDGET_NS)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"kubernetes": {"key_prefix": "node-health"}}))
    return config


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], str]:
    code = main(["cleanup", *args])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def foreign_parts(node: dict[str, Any]) -> tuple[dict[str, str], list[dict[str, Any]], list[dict[str, Any]]]:
    taints = [t for t in (node.get("spec") or {}).get("taints") or [] if not t["key"].startswith("node-health/")]
    mine = {"NetworkHealthy", "StorageHealthy"}
    kept = [c for c in node["status"]["conditions"] if c["type"] not in mine]
    return {k: v for k, v in labels(node).items() if not k.startswith("node-health/")}, taints, kept


@pytest.mark.system
def test_cleanup_removes_only_ours_and_releases_the_budget(
    double: ApiDouble, cluster: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, lines, _ = run(capsys, "--all-nodes", "--config", str(cluster))
    assert code == 0
    assert lines == [
        "node gpu-1: removed taint node-health/network=DnsFailed:NoSchedule, taint node-health/storage=DiskLow:"
        "PreferNoSchedule, label node-health/ready, label node-health/tainted, condition NetworkHealthy, "
        "condition StorageHealthy",
        "node gpu-2: nothing to remove",
        "node gpu-3: removed taint node-health/storage=DiskLow:PreferNoSchedule, label node-health/ready, "
        "condition StorageHealthy",
        "budget node-health/node-health-budget: released 2 slot(s) (gone-node, gpu-1)",
    ]
    gpu1, gpu2 = double.node("gpu-1"), double.node("gpu-2")
    assert foreign_parts(gpu1) == (FOREIGN_LABELS, FOREIGN_TAINTS, FOREIGN_CONDITIONS), "others' things stay, in order"
    assert foreign_parts(gpu2) == (FOREIGN_LABELS, FOREIGN_TAINTS, FOREIGN_CONDITIONS)
    assert set(conditions(gpu1)) == {"Ready", "KernelDeadlock"}
    assert double.node("gpu-3")["spec"].get("taints") == [] and labels(double.node("gpu-3")) == {}
    assert double.configmap(BUDGET_NS, "node-health-budget")["data"] == {}
    patches = [w for w in double.writes if w.method == "PATCH"]
    assert all(w.body["metadata"]["resourceVersion"] for w in patches), "every Node write is resourceVersion-guarded"
    assert not [w for w in double.writes if "gpu-2" in w.path], "nothing to remove: no write"

    code, lines, _ = run(capsys, "--all-nodes", "--config", str(cluster))
    assert code == 0 and lines[:3] == [f"node gpu-{i}: nothing to remove" for i in (1, 2, 3)], "idempotent"


@pytest.mark.system
def test_dry_run_changes_nothing(double: ApiDouble, cluster: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = [double.node(f"gpu-{i}") for i in (1, 2, 3)]
    code, lines, _ = run(capsys, "--all-nodes", "--dry-run", "--config", str(cluster))
    assert code == 0
    assert lines[0].startswith("node gpu-1: would remove taint node-health/network=DnsFailed:NoSchedule")
    assert lines[-1] == "budget node-health/node-health-budget: would release 2 slot(s) (gone-node, gpu-1)"
    assert double.writes == []
    assert [double.node(f"gpu-{i}") for i in (1, 2, 3)] == before


@pytest.mark.system
def test_a_dry_run_of_one_node_names_its_slot_only(
    double: ApiDouble, cluster: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, lines, _ = run(capsys, "--node", "gpu-1", "--dry-run", "--config", str(cluster))
    assert code == 0
    assert lines[-1] == "budget node-health/node-health-budget: would release 1 slot(s) (gpu-1)"
    assert double.writes == []


@pytest.mark.system
def test_one_node_and_its_slot_only(double: ApiDouble, cluster: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = run(capsys, "--node", "gpu-1", "--config", str(cluster))
    assert code == 0
    assert lines[-1] == "budget node-health/node-health-budget: released 1 slot(s) (gpu-1)"
    assert set(double.configmap(BUDGET_NS, "node-health-budget")["data"]) == {"gone-node"}
    assert fleet_record(double)["nodes"] == 3, "the fleet record stays"
    assert double.node("gpu-3")["spec"]["taints"] == [OUR_SOFT], "another node is not touched"


@pytest.mark.system
def test_a_conflict_is_redone_on_the_new_version(
    double: ApiDouble, cluster: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    double.foreign_write_before_ours("gpu-1", ("late", "writer"))
    code, lines, _ = run(capsys, "--node", "gpu-1", "--config", str(cluster))
    assert code == 0 and lines[0].startswith("node gpu-1: removed taint node-health/network")
    node = double.node("gpu-1")
    assert labels(node) == {**FOREIGN_LABELS, "late": "writer"}
    assert [t["key"] for t in node["spec"]["taints"]] == ["nvidia.com/gpu", "node-healthy"]
    assert [w.status for w in double.writes if w.path == "/api/v1/nodes/gpu-1"] == [409, 200]


@pytest.mark.system
def test_api_errors_are_reported_and_exit_1_after_the_rest_is_done(
    double: ApiDouble, cluster: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    double.inject(r"^/api/v1/nodes/gpu-3$", method="PATCH", status=500, times=-1)
    code, lines, _ = run(capsys, "--all-nodes", "--config", str(cluster))
    assert code == 1
    assert lines[0].startswith("node gpu-1: removed")
    assert lines[2] == "node gpu-3: not cleaned: HTTP 500 Internal Server Error injected fault"
    assert lines[3] == "budget node-health/node-health-budget: released 1 slot(s) (gpu-1)", "only the cleaned nodes'"
    assert double.node("gpu-3")["spec"]["taints"] == [OUR_SOFT]

    double.clear_faults()
    code, lines, _ = run(capsys, "--node", "no-such-node", "--config", str(cluster))
    assert code == 1 and lines == ['node no-such-node: HTTP 404 Not Found nodes "no-such-node" not found']


@pytest.mark.system
def test_usage_errors_exit_2(cluster: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as both:
        main(["cleanup", "--node", "a", "--all-nodes"])
    assert both.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    code, _, err = run(capsys, "--node", " ")
    assert code == 2 and "--node needs a node name" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"kubernetes": {"key_prefix": "Not A Prefix"}}))
    code, _, err = run(capsys, "--all-nodes", "--config", str(bad))
    assert code == 2 and "kubernetes.key_prefix" in err


@pytest.mark.system
def test_no_credentials_exit_1(
    cluster: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    code, lines, err = run(capsys, "--all-nodes", "--config", str(cluster))
    assert code == 1 and lines == []
    assert "cannot load Kubernetes credentials" in err


@pytest.mark.system
def test_the_command_line_entry_point(double: ApiDouble, cluster: Path) -> None:
    env = node_env()
    result = subprocess.run(
        [sys.executable, "-m", "agent.cli", "cleanup", "--all-nodes", "--config", str(cluster)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith("budget node-health/node-health-budget: released 2 slot(s)")
    assert double.node("gpu-1")["spec"]["taints"] == FOREIGN_TAINTS


def job_documents() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(JOB.read_text()) if doc]


@pytest.mark.parametrize("version", [kubernetes_validate.utils.latest_version(), "1.30"])
def test_the_cleanup_job_validates(version: str) -> None:
    for doc in job_documents():
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_cleanup_job_runs_cleanup_with_its_own_service_account() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in job_documents()}
    job = docs[("Job", "node-health-cleanup")]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["cleanup", "--all-nodes", "--config", "/etc/node-health/config.yaml"]
    assert pod["serviceAccountName"] == "node-health-cleanup"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["tolerations"] == [{"operator": "Exists"}], "it runs even when every node is tainted"
    assert pod["volumes"][0]["configMap"]["name"] == "node-health-config"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    subject = [{"kind": "ServiceAccount", "name": "node-health-cleanup", "namespace": "node-health"}]
    assert docs[("ClusterRoleBinding", "node-health-cleanup")]["subjects"] == subject
    assert docs[("RoleBinding", "node-health-cleanup")]["subjects"] == subject
