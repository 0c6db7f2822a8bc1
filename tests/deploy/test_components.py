"""deploy/components/monitoring and deploy/components/accelerator-nodes, rendered by kustomize over deploy/ and
validated (kubernetes-validate, strict, for the built-in kinds; the Prometheus Operator's kinds against the files
they come from): the monitoring component adds exactly the PodMonitor, the PrometheusRule and the dashboard's
ConfigMap for Grafana's sidecar, made from deploy/grafana/node-health.json itself; the accelerator-nodes component
changes only the DaemonSet's node affinity, whose terms, evaluated as the scheduler's node selector does (terms
ORed, expressions ANDed), admit the labelled accelerator nodes of NVIDIA and Ascend clusters and no other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.kustomize import overlay, rendered
from support.system import REPO

DEPLOY = REPO / "deploy"
COMPONENTS = DEPLOY / "components"
VERSIONS = [kubernetes_validate.utils.latest_version(), "1.30"]
OPERATOR_KINDS = {"PodMonitor", "PrometheusRule"}

pytestmark = pytest.mark.system  # kubectl kustomize


def with_component(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    return rendered(overlay(tmp_path / name, [DEPLOY], (COMPONENTS / name,)))


def key(doc: dict[str, Any]) -> tuple[str, str, str]:
    return doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"]


@pytest.mark.parametrize("version", VERSIONS)
def test_monitoring_adds_the_scrape_the_alerts_and_the_dashboard(tmp_path: Path, version: str) -> None:
    base = {key(doc): doc for doc in rendered(DEPLOY)}
    docs = {key(doc): doc for doc in with_component(tmp_path, "monitoring")}
    added = sorted(set(docs) - set(base))
    assert added == [
        ("ConfigMap", "node-health", "node-health-dashboard"),
        ("PodMonitor", "node-health", "node-health"),
        ("PrometheusRule", "node-health", "node-health"),
    ]
    assert all(docs[k] == base[k] for k in base), "the component changed the base"
    for doc in docs.values():
        if doc["kind"] not in OPERATOR_KINDS:
            kubernetes_validate.validate(doc, version, strict=True)
    dashboard = docs[("ConfigMap", "node-health", "node-health-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"] == {"node-health.json": (DEPLOY / "grafana" / "node-health.json").read_text()}
    for kind, source in (("PodMonitor", "podmonitor.yaml"), ("PrometheusRule", "prometheusrule.yaml")):
        shipped = yaml.safe_load((DEPLOY / "prometheus" / source).read_text())
        assert docs[(kind, "node-health", "node-health")]["spec"] == shipped["spec"]
        assert docs[(kind, "node-health", "node-health")]["metadata"]["labels"]["release"] == "prometheus"


def selects(terms: list[dict[str, Any]], labels: dict[str, str]) -> bool:
    """A required node affinity's verdict: any term whose every expression holds (In, NotIn, Exists,
    DoesNotExist: the operators these terms use and their negations)."""

    def holds(expression: dict[str, Any]) -> bool:
        value, operator = labels.get(expression["key"]), expression["operator"]
        if operator == "In":
            return value in expression["values"]
        if operator == "NotIn":
            return value not in expression["values"]
        if operator == "Exists":
            return value is not None
        if operator == "DoesNotExist":
            return value is None
        raise AssertionError(f"operator {operator} not evaluated here")

    return any(all(holds(e) for e in term.get("matchExpressions", [])) for term in terms)


NODES = {
    "GPU Operator node": ({"nvidia.com/gpu.present": "true", "kubernetes.io/os": "linux"}, True),
    "NFD-labelled NVIDIA node": ({"feature.node.kubernetes.io/pci-10de.present": "true"}, True),
    "MindCluster Ascend 910 node": ({"accelerator": "huawei-Ascend910"}, True),
    "MindCluster Ascend 310P node": ({"accelerator": "huawei-Ascend310P"}, True),
    "Ascend node by chip name": ({"node.kubernetes.io/npu.chip.name": "910B3"}, True),
    "NFD-labelled Huawei node": ({"feature.node.kubernetes.io/pci-19e5.present": "true"}, True),
    "control plane": ({"node-role.kubernetes.io/control-plane": "", "kubernetes.io/os": "linux"}, False),
    "CPU-only worker": ({"kubernetes.io/os": "linux", "feature.node.kubernetes.io/pci-8086.present": "true"}, False),
    "a GPU node whose operator said no": ({"nvidia.com/gpu.present": "false"}, False),
    "another accelerator label": ({"accelerator": "nvidia-tesla-t4"}, False),
}


@pytest.mark.parametrize("version", VERSIONS)
def test_accelerator_nodes_narrows_only_the_daemonset(tmp_path: Path, version: str) -> None:
    base = {key(doc): doc for doc in rendered(DEPLOY)}
    docs = {key(doc): doc for doc in with_component(tmp_path, "accelerator-nodes")}
    assert set(docs) == set(base)
    changed = [k for k in base if docs[k] != base[k]]
    assert changed == [("DaemonSet", "node-health", "node-health")]
    daemonset = docs[changed[0]]
    kubernetes_validate.validate(daemonset, version, strict=True)
    spec, before = daemonset["spec"]["template"]["spec"], base[changed[0]]["spec"]["template"]["spec"]
    assert {k: v for k, v in spec.items() if k != "affinity"} == before, "only the affinity is added"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    verdicts = {name: selects(terms, labels) for name, (labels, _) in NODES.items()}
    assert verdicts == {name: wanted for name, (_, wanted) in NODES.items()}


def test_the_readme_install_starts_with_the_image_and_its_images_entry_sets_it(tmp_path: Path) -> None:
    """README's Deploy: step 0 builds and pushes the image (scripts/release.py) or sets `images:`; that entry,
    in an overlay, makes the DaemonSet's image the registry's."""
    section = (REPO / "README.md").read_text().split("## Deploy", 1)[1]
    assert section.lstrip().startswith("0. **Image**") and "scripts/release.py --registry" in section
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    images = yaml.safe_load("\n".join(line[3:] for line in block.splitlines()))["images"]
    directory = overlay(tmp_path / "o", [DEPLOY])
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({**kustomization, "images": images}))
    daemonset = next(doc for doc in rendered(directory) if doc["kind"] == "DaemonSet")
    image = daemonset["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.startswith(f"{images[0]['newName']}:{images[0]['newTag']}")
    assert "kubectl -n node-health exec ds/node-health -- node-health fleet" in section
