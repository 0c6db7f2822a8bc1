"""The image's slimming of the `kubernetes` client (scripts/slim_venv.py), proven against the pinned range.

pyproject.toml bounds the client (`kubernetes>=37,<38`) to the releases the slimming was proven on. Here the
installed client, which must be in that range, is copied and slimmed exactly as the Dockerfile slims it; then a
real `node-health run` imports that copy, with every aiohttp module made unimportable (the image uninstalls
them), and reconciles its Node on the Kubernetes API double: label and conditions written, a taint for a failing
check. A client release that moves what the slimming removes, or starts importing aiohttp outside
kubernetes.aio, fails here before it fails in an image.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version
from support.kube_double import ApiDouble
from support.system import REPO

from probes import all_probes

sys.path.insert(0, str(REPO / "scripts"))
from slim_venv import AIOHTTP_STACK, slim_kubernetes

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (Debian 12's python3 and CI)
NODE = "slim-node"
MISSING = "/nonexistent/node-health-slimming"


def kubernetes_requirement() -> Requirement:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (requirement,) = [Requirement(d) for d in dependencies if Requirement(d).name == "kubernetes"]
    return requirement


def test_the_client_range_is_bounded_and_the_installed_client_is_in_it() -> None:
    requirement = kubernetes_requirement()
    assert any(spec.operator == "<" for spec in requirement.specifier), "an upper bound: the proven range"
    assert Version(kubernetes.__version__) in requirement.specifier, (
        f"kubernetes {kubernetes.__version__} is installed here, outside {requirement}: this test proves the "
        "slimming against the installed client, so install one in the range (or prove a new range)"
    )


@pytest.fixture(scope="module")
def slimmed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(Path(kubernetes.__file__).parent, site / "kubernetes", ignore=shutil.ignore_patterns("*.pyc"))
    done = slim_kubernetes(site / "kubernetes")
    assert done[0].startswith("removed "), done
    assert all("nothing" not in line for line in done), done
    return site


def test_the_slimming_removes_what_it_says(slimmed: Path) -> None:
    package = slimmed / "kubernetes"
    assert not (package / "aio").exists()
    for generated in ("client/api", "client/models"):
        assert not list((package / generated).rglob("*.py")), generated
        assert len(list((package / generated).glob("*.pyc"))) > 50, generated
    assert (package / "client" / "api_client.py").is_file(), "the hand-written client stays source"


BOOT = """
import importlib.abc, sys
sys.path.insert(0, {site!r})
BLOCKED = {blocked!r}

class NoAiohttp(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is uninstalled in the image")
        return None

sys.meta_path.insert(0, NoAiohttp())
import kubernetes
print("kubernetes from", kubernetes.__file__, flush=True)
from agent.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def double() -> Iterator[ApiDouble]:
    with ApiDouble() as api:
        yield api


@pytest.mark.system
def test_the_agent_reconciles_its_node_with_the_slimmed_client(
    slimmed: Path, double: ApiDouble, tmp_path: Path
) -> None:
    double.add_node(NODE)
    double.token = "slim"
    config = {
        "http": {"address": "127.0.0.1", "port": 0},
        "probes": {name: {"enabled": name == "storage.space"} for name in all_probes()},
        "storage": {"space": [{"path": MISSING}]},
        "kubernetes": {
            "kubeconfig": str(double.write_kubeconfig(tmp_path / "kubeconfig", token="slim")),
            "max_unhealthy": "1",
            "poll_seconds": 0.2,
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    blocked = sorted({name.replace("-", "_") for name in AIOHTTP_STACK})
    boot = BOOT.format(site=str(slimmed), blocked=blocked)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(NODE_NAME=NODE, PYTHONPATH=str(REPO), POD_NAMESPACE="node-health")
    log = tmp_path / "agent.log"
    with log.open("w") as sink:
        agent = subprocess.Popen(
            [sys.executable, "-c", boot, "run", "--config", str(tmp_path / "config.yaml")],
            env=env,
            cwd=tmp_path,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while not any(t["key"] == "node-health/storage" for t in double.node(NODE)["spec"].get("taints", [])):
            assert agent.poll() is None, log.read_text()
            assert time.monotonic() < deadline, (log.read_text(), json.dumps(double.node(NODE)))
            time.sleep(0.3)
    finally:
        agent.terminate()
        agent.wait(timeout=15)
    text = log.read_text()
    assert re.search(rf"kubernetes from {re.escape(str(slimmed))}/kubernetes/__init__\.py", text), text
    node = double.node(NODE)
    assert node["metadata"]["labels"].get("node-health/ready") == "false", node["metadata"]
    condition = {c["type"]: c for c in node["status"]["conditions"]}["StorageHealthy"]
    assert condition["status"] == "False", condition
    assert "Traceback" not in text and "ImportError" not in text, text
