"""The done-when scenario on a real control plane with kube-controller-manager running: one GPU held, its reason
changed, then recovered: one rule created, patched and deleted, no node-taint write for the gpu category, no 409
left in the device errors; with the gates off on 1.36 the GPU is reported not isolated (on the node taint)."""

from __future__ import annotations

import random

import pytest
from support.kube_devices import NVIDIA, nvidia_devices, record_gpus, record_npus
from support.kube_helpers import Clock, health_state, kube_config, our_taints, record
from support.realkube import plane

from agent.kube import KubeAgent

pytestmark = [pytest.mark.system, pytest.mark.realkube]
PROBES = {"gpu": ("gpu.holders",), "npu": ("npu.holders",), "storage": ("storage.mounts",)}


def _agent(real, node: str):  # type: ignore[no-untyped-def]
    real.register_node(node)
    real.ensure_namespace("node-health")
    version = "v1" if real.release == "1.37" else "v1beta2"
    slice_ = {
        "metadata": {"name": f"{node}-gpu"},
        "spec": {
            "driver": NVIDIA,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": nvidia_devices(),
        },
    }
    status, answer = real.request("POST", f"/apis/resource.k8s.io/{version}/resourceslices", slice_)
    assert status == 201, answer
    clock = Clock()
    state = health_state(node, clock, PROBES)
    record(state, "storage", "storage.mounts", "ok")
    record_npus(state)
    config = kube_config(max_unhealthy="100%", max_unhealthy_devices="100%", kubeconfig=str(real.kubeconfig))
    agent = KubeAgent(
        config, node, lambda: state.snapshot, real.api_client(), clock=clock, monotonic=clock, rng=random.Random(0)
    )
    return state, agent, clock


@pytest.mark.parametrize("release", ["1.37", "1.36"])
def test_held_changed_recovered_is_one_rule_and_no_node_taint(release: str) -> None:
    real = plane(release)
    node = f"dw-{release.replace('.', '')}"
    state, agent, clock = _agent(real, node)
    version = "v1" if release == "1.37" else "v1beta2"
    seen = []
    for bad in ({3: "GpuHeldOutOfBand"}, {3: "GpuEccUncorrectable"}, {}):
        record_gpus(state, bad)
        agent.reconcile_once()
        clock.advance(30)
        current = real.request("GET", f"/api/v1/nodes/{node}")[1]
        assert "gpu" not in our_taints(current), current["spec"]
        items = real.request("GET", f"/apis/resource.k8s.io/{version}/devicetaintrules")[1]["items"] or []
        ours = [r for r in items if (r["metadata"].get("labels") or {}).get("node-health/node") == node]
        seen.append([(r["metadata"]["uid"], r["spec"]["taint"]["value"]) for r in ours])
    assert len(seen[0]) == 1 and seen[0][0][1] == "GpuHeldOutOfBand", seen
    assert seen[1] == [(seen[0][0][0], "GpuEccUncorrectable")], "the same rule, patched"
    assert seen[2] == [], "deleted"
    status = agent.status()
    errors = status["devices"]["errors"]
    assert "conflict" not in errors, status["devices"]


def test_gates_off_on_136_reports_the_gpu_not_isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.kube.devices import acting

    monkeypatch.setattr(acting, "CONFIRM_SECONDS", 4.0)
    real = plane("1.36", taint_rules=False)
    state, agent, _clock = _agent(real, "dw-off")
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    agent.reconcile_once()
    current = real.request("GET", "/api/v1/nodes/dw-off")[1]
    assert our_taints(current).get("gpu") == ("GpuHeldOutOfBand", "NoSchedule")
    isolated = agent.status()["devices"]["isolated"]
    assert isolated[0]["mechanism"] == "node" and "does not act" in isolated[0]["why"], isolated
