"""Pre-flight by pod name, end to end: a real agent (`node-health run`) on a fake accelerator node
(tests/support/fake_node.py) whose kubelet ledger is a fake PodResources server over real gRPC, and
deploy/examples/preflight.sh in sh, dash, busybox sh, bash and bash -e with POD_NAMESPACE and POD_NAME as the
downward API sets them, and no device variable at all.

The node: chip 0 is held by a process outside Kubernetes (NpuHeldOutOfBand: the node is not ready), chip 1 is
allocated to team-a/train-0, chip 0 to team-c/held-0, GPU 0 to team-b/infer-0; the pods are in the node's pod list
(the API double), so Volcano's rule can be applied to the Ascend ones.

- The agent: ready for train-0 and infer-0 while chip 0 fails, not ready for held-0, 503 for a pod the ledger does
  not know, a pod added to the kubelet's ledger while the agent runs is judged at once by its own chip.
- The script: exit 0 for train-0 (the answer names its chip), 1 for held-0, an unknown pod waited out for
  NODE_HEALTH_WAIT_SECONDS and then exit 1; an agent that predates pod= (a 400 for it) is asked without it; an agent
  that cannot read the kubelet's ledger is asked about the whole node. The same exit status and output in every
  shell.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from support.fake_node import FakeNode
from support.preflight import SHELLS, Outcome, preflight
from support.system import require_fixtures, require_root

from agent.http.pod import PodLedger
from agent.http.routes import HttpServer
from agent.http.server import Request, Response
from agent.state import HealthState, ProbeSpec
from probes.base import Finding, Status

pytestmark = pytest.mark.system

ASCEND = "huawei.com/Ascend910"


class PodNode(FakeNode):
    """The fake node with its pods in the node's pod list, a pod holding chip 0 by allocation, and only the checks
    that say something about devices (the host and stale-lock checks fail on any test machine)."""

    def prepare(self) -> dict[str, Any]:
        config = super().prepare()
        assert self.api is not None and self.kubelet is not None
        for namespace, name in (
            ("team-a", "train-0"),
            ("team-b", "infer-0"),
            ("team-c", "held-0"),
            ("team-d", "late-0"),
        ):
            self.api.add_pod(namespace, name, self.node_name)
        self.kubelet.allocate("team-c", "held-0", "main", ASCEND, "Ascend910-0")
        for probe in ("host", "storage.locks"):
            config["probes"][probe]["enabled"] = False
        self.config_path.write_text(json.dumps(config))
        return config


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodNode]:
    require_root()
    with PodNode(tmp_path_factory.mktemp("pod-node"), require_fixtures(), kube=True) as running:
        yield running


def ready(node: FakeNode, query: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(node.url(f"/ready?{query}"), timeout=40) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def reasons(body: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(r["check"], r["subject"], r["reason"]) for r in body["reasons"]]


# --- the agent ----------------------------------------------------------------------------------------------------


def test_each_pod_is_judged_by_its_own_devices(node: PodNode) -> None:
    status, body = ready(node, "")
    assert status == 503 and ("npu.holders", "npu0", "NpuHeldOutOfBand") in reasons(body)
    # train-0's chip 1 is healthy while chip 0 fails; Volcano's rule needs a pod list newer than the pod's first
    # sighting in the ledger, which the agent asks for: a long-poll waits for it.
    status, body = ready(node, "pod=team-a/train-0&wait=30")
    assert status == 200, body
    assert body["pod"]["devices"] == [{"category": "npu", "device": 1}] and body["pod"]["ledger_ids"] == ["Ascend910-1"]
    status, body = ready(node, "pod=team-b/infer-0")
    assert status == 200 and body["pod"]["devices"] == [{"category": "gpu", "device": 0}], "GPU 0 is not NPU 0"
    status, body = ready(node, "pod=team-c/held-0&wait=30")
    assert status == 503 and ("npu.holders", "npu0", "NpuHeldOutOfBand") in reasons(body)
    status, body = ready(node, "pod=team-z/nobody")
    assert status == 503 and reasons(body) == [("ready.pod", "team-z/nobody", "PodNotInLedger")]


def test_a_pod_the_kubelet_admits_while_the_agent_runs_is_judged_by_its_own_gpu(node: PodNode) -> None:
    """Within a second: the agent reads the ledger again for it (reads a second apart), no probe run needed."""
    assert node.kubelet is not None
    node.kubelet.allocate("team-d", "late-0", "main", "nvidia.com/gpu", gpu_uuid(node, 1))
    started = time.monotonic()
    status, body = ready(node, "pod=team-d/late-0&wait=20")
    assert status == 200 and body["pod"]["devices"] == [{"category": "gpu", "device": 1}], body
    assert time.monotonic() - started < 5, "not a probe interval (the fake node's is 1 s, a real one's 30 s)"


def gpu_uuid(node: FakeNode, index: int) -> str:
    status = node.status()
    (finding,) = [f for f in status["findings"] if f["check"] == "gpu.health" and f.get("device") == index]
    return str(finding["observed"]["device_ids"][0])


# --- the script ---------------------------------------------------------------------------------------------------


def run_everywhere(env: dict[str, str]) -> Outcome:
    """The script in every shell; the same exit status and output in each (but the seconds a wait printed)."""
    outcomes = {shell: preflight(env, shell) for shell in SHELLS}
    first = outcomes[SHELLS[0]]
    for shell, outcome in outcomes.items():
        assert (outcome.code, scrub(outcome.stdout), scrub(outcome.stderr)) == (
            first.code,
            scrub(first.stdout),
            scrub(first.stderr),
        ), shell
    return first


def scrub(text: str) -> str:
    return re.sub(r"(after|read) [\d.]+ ?s", r"\1 N s", text)


def pod_env(node: FakeNode, namespace: str, name: str, wait: str = "30") -> dict[str, str]:
    return {
        "NODE_HEALTH_URL": node.url(""),
        "POD_NAMESPACE": namespace,
        "POD_NAME": name,
        "NODE_HEALTH_WAIT_SECONDS": wait,
    }


def test_the_script_names_the_pod_and_passes_on_its_healthy_chip(node: PodNode) -> None:
    ready(node, "pod=team-a/train-0&wait=30")  # the pod list has caught up with the pod
    outcome = run_everywhere(pod_env(node, "team-a", "train-0"))
    assert outcome.code == 0, outcome
    assert re.search(r"/ready\?pod=team-a%2[fF]train-0 answered 200$", outcome.lines[0]), outcome.lines
    assert outcome.lines[1] == "ready on fake-node-1 for pod team-a/train-0 (npu1 from the kubelet's ledger)"


def test_the_script_fails_a_pod_whose_chip_is_held(node: PodNode) -> None:
    ready(node, "pod=team-c/held-0&wait=30")
    outcome = run_everywhere(pod_env(node, "team-c", "held-0"))
    assert outcome.code == 1, outcome
    assert "this node is not ready for the job" in outcome.lines[0]
    assert outcome.lines[1].startswith(
        "not ready on fake-node-1 for pod team-c/held-0 (npu0 from the kubelet's ledger)"
    )
    assert any(line.startswith("fail npu.holders npu0 NpuHeldOutOfBand: ") for line in outcome.lines)


def test_the_script_waits_out_an_unknown_pod_then_fails(node: PodNode) -> None:
    outcome = run_everywhere(pod_env(node, "team-z", "nobody", wait="2"))
    assert outcome.code == 1, outcome
    assert "this pod's devices are not known yet" in outcome.lines[0]
    assert "this pod's devices still not known after" in outcome.stdout
    assert any(line.startswith("unknown ready.pod team-z/nobody PodNotInLedger: ") for line in outcome.lines)


# --- agents that cannot answer pod= -------------------------------------------------------------------------------


# What every release before pod= answered to it (agent/ready.py's parser then): a 400 naming the parameter.
OLDER_ANSWER = (
    "bad request: unknown parameter 'pod' (allowed: checks, devices, format, min_hbm_free_mib, min_host_mem_mib, "
    "min_hugepages, wait)\n"
)


@contextmanager
def agent(ledger: PodLedger | None, predates_pod: bool = False) -> Iterator[str]:
    """The agent's own server and state, every check ok: an agent of today, or (predates_pod) one that answers
    pod= as every release before it did."""
    state = HealthState("node-b")
    state.configure([ProbeSpec("storage", ("storage.space",), 60.0, 5.0)])
    state.record("storage", [Finding("storage.space", "/data", Status.OK, "OK", "40% used")])
    server = HttpServer(
        state,
        lambda: b"",
        lambda: (True, {}),
        lambda: ("storage.space",),
        address="127.0.0.1",
        port=0,
        pod_ledger=ledger,
    )
    if predates_pod:
        current = server.core.routes["/ready"]

        def older(request: Request) -> Response | Awaitable[Response]:
            if "pod" in request.query:
                return Response(400, OLDER_ANSWER.encode(), content_type="text/plain; charset=utf-8")
            return current(request)

        server.core.routes["/ready"] = older
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


def test_an_agent_that_predates_pod_is_asked_without_it() -> None:
    with agent(None, predates_pod=True) as url:
        outcome = run_everywhere({"NODE_HEALTH_URL": url, "POD_NAMESPACE": "team-a", "POD_NAME": "train-0"})
    assert outcome.code == 0, outcome
    assert "this agent does not know pod= (an older release); asking about every device of the node" in outcome.lines[0]
    assert outcome.lines[-1] == "ready on node-b"


def test_an_agent_that_cannot_read_the_ledger_is_asked_about_the_whole_node(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-kubelet.sock")
    with agent(PodLedger(lambda: missing, lambda: 1.0)) as url:
        env = {"NODE_HEALTH_URL": url, "POD_NAMESPACE": "team-a", "POD_NAME": "train-0", "NODE_HEALTH_DEVICES": ""}
        outcome = run_everywhere(env)
    assert outcome.code == 0, outcome
    assert (
        "the agent cannot read the kubelet's ledger for this pod; asking about every device of the node"
        in outcome.stdout
    )
    assert any(line.startswith("unknown ready.pod team-a/train-0 LedgerUnavailable: ") for line in outcome.lines)
    assert outcome.lines[-1] == "ready on node-b"
