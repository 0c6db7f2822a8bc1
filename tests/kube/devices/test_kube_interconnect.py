"""One bad link costs one GPU: the gpu.links and interconnect.ports probes' own findings on an 8-GPU/8-HCA fake
node (fake nvidia-smi from the sourced outputs, a fake /sys/class/infiniband), applied by the agent against the
API double serving DRA: an NVLink or fabric problem isolates exactly that GPU by a DeviceTaintRule (the NVIDIA
driver's device named by its /dev minor, matched by UUID/Bus-Id), an HCA port taints the node only in the
interconnect category, and every one clears."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.fake_gpu_links import BUSES, FABRIC_OK, UUIDS, Clock, Node, fabric_proc, fake_smi
from support.fake_infiniband import node as ib_node
from support.kube_devices import NVIDIA, Gpu, publish_gpus
from support.kube_double import ApiDouble
from support.kube_helpers import Clock as KubeClock
from support.kube_helpers import conditions, health_state, make_agent, our_taints

from agent.config import parse_config
from agent.kube.devices.match import rule_name
from agent.scheduler import execute
from probes.gpu.links import GpuLinksProbe
from probes.interconnect.ports import InterconnectPortsProbe
from probes.runtime.host import Host

PROBES = {"gpu.links": ("gpu.nvlink", "gpu.fabric"), "interconnect.ports": ("interconnect.ports",)}
# The GPUs of the -q fixture as the NVIDIA DRA driver publishes them: device gpu-<minor>, its UUID and Bus-Id.
FIXTURE_GPUS = tuple(Gpu(i, i, UUIDS[i], BUSES[i]) for i in range(8))


def rule_for(index: int) -> str:
    return rule_name("node-health", "gpu", "n1", NVIDIA, f"gpu-{index}")


class FakeNode:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.gpus = Node()
        self.ib = ib_node(tmp / "sys")
        self.fabric_manager = True
        self.links = GpuLinksProbe(Clock())
        self.ports = InterconnectPortsProbe(Clock())

    def run(self, state: Any) -> None:
        smi = fake_smi(self.tmp, self.gpus)
        config = parse_config(
            {
                "gpu": {"smi_command": [smi], "nvml_library": str(self.tmp / "absent.so"), "expected_gpus": 8},
                "interconnect": {
                    "state_dir": str(self.tmp / "state"),
                    "expected_rate_gbps": 400,
                },
            }
        )
        host = Host(proc=fabric_proc(self.tmp, self.fabric_manager), sys=self.tmp / "sys")
        for probe in (self.links, self.ports):
            result, findings, _ = execute(probe, host, config, 20.0)
            assert result == "ok", findings
            state.record(probe.name, findings)


def rules(double: ApiDouble) -> dict[str, dict[str, Any]]:
    return {r["metadata"]["name"]: r for r in double.device_taint_rules()}


def isolated(node: dict[str, Any]) -> dict[str, str]:
    text = (node["metadata"].get("annotations") or {}).get("node-health/isolated-devices", "[]")
    return {entry["device"]: entry["reason"] for entry in json.loads(text)}


@pytest.mark.system
def test_each_link_reason_isolates_its_gpu_and_an_hca_port_taints_only_interconnect(
    double: ApiDouble, tmp_path: Path
) -> None:
    clock = KubeClock()
    double.serve_dra("1.37")
    double.add_node("n1")
    publish_gpus(double, "n1", FIXTURE_GPUS)
    state = health_state("n1", clock, PROBES)
    agent = make_agent(double, state, clock, max_unhealthy="100%", max_unhealthy_devices="100%")
    fake = FakeNode(tmp_path)

    fake.run(state)
    agent.reconcile_once()
    node = double.node("n1")
    assert rules(double) == {} and our_taints(node) == {}
    assert conditions(node)["InterconnectHealthy"]["status"] == "True"

    # NVLink down on GPU 5, GPU 2's fabric still in progress: two rules, for those two GPUs, no node taint.
    fake.gpus.inactive[5] = [0, 1]
    fake.gpus.fabric[2] = FABRIC_OK.replace("Completed", "In Progress").replace("Success", "N/A")
    fake.run(state)
    agent.reconcile_once()
    stored = rules(double)
    assert set(stored) == {rule_for(5), rule_for(2)}
    assert stored[rule_for(5)]["spec"]["deviceSelector"] == {"driver": NVIDIA, "pool": "n1", "device": "gpu-5"}
    assert stored[rule_for(5)]["spec"]["taint"]["value"] == "NvlinkDown"
    assert stored[rule_for(2)]["spec"]["taint"]["value"] == "FabricNotReady"
    node = double.node("n1")
    assert our_taints(node) == {}, "six GPUs and the node stay schedulable"
    assert isolated(node) == {"gpu5": "NvlinkDown", "gpu2": "FabricNotReady"}

    # An HCA port down: the node's interconnect taint, and only that one.
    fake.ib.set_state("mlx5_3/1", "DOWN", "Polling")
    fake.run(state)
    agent.reconcile_once()
    node = double.node("n1")
    assert our_taints(node) == {"interconnect": ("HcaPortDown", "NoSchedule")}
    condition = conditions(node)["InterconnectHealthy"]
    assert condition["status"] == "False" and condition["reason"] == "HcaPortDown"
    assert "mlx5_3/1" in condition["message"]
    assert set(rules(double)) == {rule_for(5), rule_for(2)}

    # Everything recovers: rules deleted, taint removed.
    fake.gpus.inactive.clear()
    fake.gpus.fabric[2] = FABRIC_OK
    fake.ib.set_state("mlx5_3/1", "ACTIVE", "LinkUp")
    fake.run(state)
    agent.reconcile_once()
    node = double.node("n1")
    assert rules(double) == {} and our_taints(node) == {} and isolated(node) == {}
    assert conditions(node)["InterconnectHealthy"]["status"] == "True"


@pytest.mark.system
@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("errors", "NvlinkErrors"),
        ("degraded", "HcaPortDegraded"),
        ("fabric_manager", "FabricManagerDown"),
    ],
)
def test_every_other_reason_raised_and_cleared(double: ApiDouble, tmp_path: Path, change: str, reason: str) -> None:
    clock = KubeClock()
    double.serve_dra("1.37")
    double.add_node("n1")
    publish_gpus(double, "n1", FIXTURE_GPUS)
    state = health_state("n1", clock, PROBES)
    agent = make_agent(double, state, clock, max_unhealthy="100%", max_unhealthy_devices="100%")
    fake = FakeNode(tmp_path)
    fake.run(state)
    if change == "errors":
        fake.gpus.counters[(6, 2, "Recovery Errors")] = 1
        fake.links._clock.now += 30  # type: ignore[attr-defined]
    elif change == "degraded":
        fake.ib.set_rate("mlx5_7/1", "200 Gb/sec (2X NDR)")
    else:
        fake.fabric_manager = False
    fake.run(state)
    agent.reconcile_once()
    node = double.node("n1")
    if change == "errors":
        assert set(rules(double)) == {rule_for(6)} and isolated(node) == {"gpu6": reason}
    elif change == "degraded":
        condition = conditions(node)["InterconnectHealthy"]
        assert rules(double) == {} and condition["status"] == "True" and f"warn: {reason}" in condition["message"]
        assert our_taints(node) == {}, "a warn is told on the condition only (warn_effect None)"
    else:
        assert set(rules(double)) == {rule_for(i) for i in range(8)}, "every GPU of the NVSwitch system"
        assert set(isolated(node).values()) == {reason}
    # cleared
    fake.gpus.counters.clear()
    fake.ib.set_rate("mlx5_7/1", "400 Gb/sec (4X NDR)")
    fake.fabric_manager = True
    fake.links._clock.now += 7200  # type: ignore[attr-defined]
    fake.run(state)
    agent.reconcile_once()
    node = double.node("n1")
    assert rules(double) == {} and isolated(node) == {} and our_taints(node) == {}
    assert conditions(node)["InterconnectHealthy"]["status"] == "True"
