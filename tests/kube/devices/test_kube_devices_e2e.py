"""The whole agent on a fake accelerator node (tests/support/fake_node.py: fake npu-smi and nvidia-smi answering from
captured outputs, mknod'ed device nodes, a real process holding one of them outside any pod) reconciling its Node
on the API double, with the NVIDIA and MindCluster DRA drivers' ResourceSlices of its devices."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from support.fake_node import FakeNode
from support.kube_double import ApiDouble
from support.kube_helpers import conditions, our_taints
from support.system import require_fixtures, require_root

from agent.kube.devices.match import rule_name

NODE = "fake-node-1"
LET_IT_TAINT = {"max_unhealthy": "100%"}


def our_rules(api: ApiDouble) -> dict[str, dict[str, Any]]:
    return {r["metadata"]["name"]: r for r in api.device_taint_rules("app.kubernetes.io/name=node-health")}


@pytest.mark.system
@pytest.mark.parametrize(
    "hold,publish,category,device,reason",
    [
        ("nvidia3", ("gpu",), "gpu", "gpu-3", "GpuHeldOutOfBand"),
        ("davinci0", ("npu",), "npu", "ascend910-0", "NpuHeldOutOfBand"),
    ],
    ids=["8-gpu-node", "8-npu-node"],
)
def test_one_chip_held_out_of_band_gets_one_rule_and_the_node_keeps_its_other_chips(
    tmp_path: Path, hold: str, publish: tuple[str, ...], category: str, device: str, reason: str
) -> None:
    require_root()  # mknod of the fake device nodes
    fixtures = require_fixtures()
    with FakeNode(tmp_path, fixtures, hold=hold, dra="1.37", publish=publish, kube_settings=LET_IT_TAINT) as node:
        api = node.api
        assert api is not None
        driver = "gpu.nvidia.com" if category == "gpu" else "npu.huawei.com"
        name = rule_name("node-health", category, NODE, driver, device)
        rules = node.wait_for("a rule for the held chip", lambda: our_rules(api))
        node.wait_for("the storage taint", lambda: "storage" in our_taints(api.node(NODE)))
        time.sleep(2)  # a few more passes: nothing else appears
        rules = our_rules(api)
        assert list(rules) == [name], "exactly one rule, for the chip that is held"
        rule = rules[name]
        assert rule["spec"]["deviceSelector"] == {"driver": driver, "pool": NODE, "device": device}
        assert (rule["spec"]["taint"]["key"], rule["spec"]["taint"]["value"]) == (f"node-health/{category}", reason)
        assert rule["spec"]["taint"]["effect"] == "NoSchedule"

        node_object = api.node(NODE)
        taints = our_taints(node_object)
        assert category not in taints, "no node taint for the chip's category"
        assert taints["storage"] == ("StaleFileBaton", "NoSchedule"), "storage failing at the same time taints"
        condition = conditions(node_object)["NPUHealthy" if category == "npu" else "GPUHealthy"]
        assert (condition["status"], condition["reason"]) == ("False", reason)
        subject = "gpu3" if category == "gpu" else "npu0"
        assert f"{subject} isolated by DeviceTaintRule {name}" in condition["message"]
        annotation = json.loads(node_object["metadata"]["annotations"]["node-health/isolated-devices"])
        assert [(e["device"], e["mechanism"]) for e in annotation] == [(subject, "dra")]
        status = node.status()["kubernetes"]["devices"]
        assert status["isolated"][0]["rules"] == [name]
        metrics = node.metrics_text()
        assert 'nodehealth_devices_isolated{mechanism="dra"} 1.0' in metrics

        node.stop_holder()
        node.wait_for("the rule deleted on recovery", lambda: not our_rules(api))
        node.wait_for(
            "the condition healthy", lambda: conditions(api.node(NODE))[condition["type"]]["status"] == "True"
        )


@pytest.mark.system
def test_without_dra_the_held_gpu_taints_the_node_as_today(tmp_path: Path) -> None:
    require_root()
    with FakeNode(tmp_path, require_fixtures(), hold="nvidia3", kube_settings=LET_IT_TAINT) as node:
        api = node.api
        assert api is not None
        node.wait_for("the gpu taint", lambda: "gpu" in our_taints(api.node(NODE)))
        assert our_taints(api.node(NODE))["gpu"] == ("GpuHeldOutOfBand", "NoSchedule")
        assert api.device_taint_rules() == []
        message = conditions(api.node(NODE))["GPUHealthy"]["message"]
        assert "gpu3 falls back to the node taint: the cluster serves no resource.k8s.io (no DRA)" in message
        assert 'nodehealth_devices_isolated{mechanism="node"} 1.0' in node.metrics_text()
