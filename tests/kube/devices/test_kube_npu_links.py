"""One bad link costs one chip: npu.roce, npu.grade and npu.ecc findings, from real probe runs on fake tools (a fake
hccn_tool serving sourced outputs, a fake npu-smi whose `info -m` maps logical to physical ids out of order),
isolate that chip alone through the real reconciler on the API double (DRA rule, public fault), never the node."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support.fake_hccn_tool import FakeHccn
from support.fake_npu_smi import FakeSmi, context, make_dev, npu_fixture
from support.kube_devices import ASCEND, CHIPS, publish_npus, record_gpus
from support.kube_double import ApiDouble
from support.kube_helpers import Clock, conditions, health_state, make_agent, our_taints, record

from agent.kube.devices.match import rule_name
from probes.base import Finding, Probe
from probes.npu.ecc import EccProbe
from probes.npu.grade import GradeProbe
from probes.npu.roce import RoceProbe

pytestmark = pytest.mark.system
PROBES = {
    "gpu": ("gpu.holders",),
    "storage": ("storage.mounts",),
    "npu.roce": tuple(RoceProbe.checks),
    "npu.grade": tuple(GradeProbe.checks),
    "npu.ecc": tuple(EccProbe.checks),
}
OK_HEALTH = npu_fixture("910a-t-health-OK-i0-c0-faultdiag.txt").read_text()
ZERO_ECC = npu_fixture("910a-t-ecc-i1-ddr-and-hbm-docexample-mindcluster.txt").read_text()


class Node:
    """Eight 910B chips (support.kube_devices.CHIPS: physical id (3 * logical) % 8), fake tools, real probes."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp = tmp
        self.hccn = FakeHccn(tmp / "hccn")
        self.smi = FakeSmi(tmp / "smi")
        monkeypatch.setenv("PATH", f"{self.hccn.bin}{os.pathsep}{self.smi.bin}{os.pathsep}{os.environ['PATH']}")
        self.dev = make_dev(tmp / "dev", {f"davinci{c.physical_id}": (236, c.physical_id) for c in CHIPS})
        self.probes: dict[str, Probe] = {"npu.roce": RoceProbe(), "npu.grade": GradeProbe(), "npu.ecc": EccProbe()}
        self.answer_smi({}, {})

    def answer_smi(self, health: dict[int, str], ecc: dict[int, str]) -> None:
        header = f"{'NPU ID':<16}{'Chip ID':<16}{'Chip Logic ID':<16}{'Chip Phy-ID':<16}Chip Name\n"
        rows = "".join(f"{c.logical_id:<16}{0:<16}{c.logical_id:<16}{c.physical_id:<16}Ascend 910B\n" for c in CHIPS)
        responses: dict[str, dict[str, Any]] = {"info -m": {"stdout": header + rows}}
        for chip in CHIPS:
            n = chip.logical_id
            responses[f"info -t health -i {n} -c 0"] = {"stdout": health.get(n, OK_HEALTH)}
            responses[f"info -t ecc -i {n} -c 0"] = {"stdout": ecc.get(n, ZERO_ECC)}
        self.smi.answer(responses)

    def run_into(self, state: Any) -> dict[str, list[Finding]]:
        settings = {
            "state_dir": str(self.tmp / "state"),
            "hccn_conf": str(self.tmp / "hccn.conf"),
            "fault_code_files": [str(self.tmp / "no-faultCode.json")],
            "optical_interval_seconds": 0,
            "link_stat_interval_seconds": 0,
            "net_health_interval_seconds": 0,
            "address_interval_seconds": 0,
            "hccn_max_calls_per_run": 1000,
        }
        out = {}
        for name, probe in self.probes.items():
            items = probe.run(context(self.tmp, settings, dev=self.dev, timeout=30.0))
            findings = [i for i in items if isinstance(i, Finding)]
            state.record(name, findings)
            out[name] = findings
        return out


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    return Node(tmp_path, monkeypatch)


def setup(double: ApiDouble, **kube: Any) -> tuple[Any, Any, Clock]:
    clock = Clock()
    double.serve_dra("1.37")
    double.add_node("n1", labels={"accelerator": "huawei-Ascend910"})
    double.mutate("nodes", "", "n1", lambda n: n["status"].update({"capacity": {"huawei.com/Ascend910": "8"}}))
    publish_npus(double, "n1")
    state = health_state("n1", clock, PROBES)
    agent = make_agent(double, state, clock, max_unhealthy="100%", max_unhealthy_devices="100%", **kube)
    record(state, "storage", "storage.mounts", "ok")
    record_gpus(state)
    return state, agent, clock


def rules(double: ApiDouble) -> dict[str, dict[str, Any]]:
    return {r["metadata"]["name"]: r for r in double.device_taint_rules()}


FAULTS = [
    ("hccn", {"link": {"file": "link-down-hccn_tool-go.txt"}}, "NpuLinkDown"),
    ("hccn", {"net_health": {"file": "net_health-fault-doc.txt"}}, "NpuNetUnhealthy"),
    ("hccn", {"optical": {"file": "optical-present-rx-los-DERIVED.txt"}}, "NpuOpticalSignalLost"),
    ("hccn", {"optical": {"file": "optical-not-present-rx-los-faultdiag.txt"}}, "NpuOpticalAbsent"),
    ("hccn", {"ip": {"file": "ip-empty-faultdiag.txt"}}, "NpuAddressMissing"),
    ("health", "80E18402", "NpuFaultSeparate"),
    ("health", "8C03A000", "NpuFaultReset"),
    ("ecc", "HBM Double Bit Error Count               : 2", "NpuEccDoubleBit"),
]


@pytest.mark.parametrize(("kind", "fault", "reason"), FAULTS, ids=[f[2] for f in FAULTS])
def test_each_reason_isolates_its_chip_by_physical_id_and_clears(
    double: ApiDouble, node: Node, kind: str, fault: Any, reason: str
) -> None:
    state, agent, clock = setup(double)
    chip = CHIPS[2]  # logical 2, physical 6: hccn_tool -i 6, DRA device ascend910-6
    if kind == "hccn":
        node.hccn.serve({chip.physical_id: fault})
    elif kind == "health":
        word = f"\tHealth Status                  : OK\n\tError Code                     : {fault}\n"
        node.answer_smi({chip.logical_id: word}, {})
    else:
        node.answer_smi({}, {chip.logical_id: ZERO_ECC.replace("HBM Double Bit Error Count               : 0", fault)})
    found = node.run_into(state)
    bad = [(f.reason, f.subject, f.device) for fs in found.values() for f in fs if f.status.value in ("warn", "fail")]
    assert bad == [(reason, "npu2", 2)]
    agent.reconcile_once()
    name = rule_name("node-health", "npu", "n1", ASCEND, f"ascend910-{chip.physical_id}")
    assert list(rules(double)) == [name]
    assert rules(double)[name]["spec"]["deviceSelector"]["device"] == "ascend910-6"
    assert rules(double)[name]["spec"]["taint"]["value"] == reason
    node_object = double.node("n1")
    assert our_taints(node_object) == {}, "a chip's problem never taints the node"
    assert f"npu2 isolated by DeviceTaintRule {name}" in conditions(node_object)["NPUHealthy"]["message"]

    node.hccn.serve({})
    node.answer_smi({}, {})
    clock.advance(1)
    node.run_into(state)
    agent.reconcile_once()
    assert rules(double) == {}
    assert conditions(double.node("n1"))["NPUHealthy"]["status"] == "True"


def test_a_bad_link_is_a_public_fault_on_the_chips_physical_id(double: ApiDouble, node: Node) -> None:
    public = {"enabled": True, "sender": "node-health", "namespace": "mindx-dl"}
    state, agent, _clock = setup(double, mindcluster={"public_fault": public})
    node.hccn.serve({CHIPS[5].physical_id: {"link": {"file": "link-down-hccn_tool-go.txt"}}})
    node.run_into(state)
    agent.reconcile_once()
    stored = double.configmap("mindx-dl", "node-health-publicfault-n1")
    assert stored is not None
    import json

    (fault,) = json.loads(stored["data"]["PublicFault"])["faults"]
    assert fault["influence"] == [{"nodeName": "n1", "deviceIds": [CHIPS[5].physical_id]}]
    assert "NpuLinkDown on npu5" in fault["description"]
    assert our_taints(double.node("n1")) == {}
