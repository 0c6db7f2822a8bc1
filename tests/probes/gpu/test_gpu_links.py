"""gpu.nvlink and gpu.fabric through a fake nvidia-smi serving the sourced outputs (tests/fixtures/nvidia-smi/
SOURCES.md) on an 8-GPU A100 node: every reason raised and cleared, the right GPU named with its identity (index,
UUID, PCI Bus-Id, minor) as gpu.health's findings carry it; a node without NVLink or NVSwitch skips; a hung
nvidia-smi is unknown within its timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.fake_gpu_links import (
    BUSES,
    ERRORS_I0,
    FABRIC_NA,
    FABRIC_OK,
    STATUS_I0,
    UUIDS,
    Clock,
    Node,
    fabric_proc,
    fake_smi,
    run,
)
from support.system import REPO

from agent.config import parse_config
from agent.scheduler import execute
from probes.base import Finding, Sample, Status
from probes.gpu.links import GpuLinksProbe, fabric_manager_running
from probes.gpu.links_smi import parse_errors, parse_status
from probes.runtime.host import Host


def findings(output: list[Any], check: str) -> dict[str, Finding]:
    return {f.subject: f for f in output if isinstance(f, Finding) and f.check == check}


def bad(output: list[Any], check: str) -> dict[str, str]:
    return {s: f.reason for s, f in findings(output, check).items() if f.status != Status.OK}


def test_a_healthy_nvswitch_node_is_ok_with_each_gpus_identity(tmp_path: Path) -> None:
    out = run(tmp_path, Node(), GpuLinksProbe(Clock()))
    nvlink, fabric = findings(out, "gpu.nvlink"), findings(out, "gpu.fabric")
    assert len(nvlink) == 8 and len(fabric) == 8 and not bad(out, "gpu.nvlink") and not bad(out, "gpu.fabric")
    gpu3 = nvlink["gpu3"]
    assert gpu3.device == 3 and gpu3.category == "gpu"
    assert gpu3.observed["device_ids"] == [UUIDS[3]]
    assert gpu3.observed["pci_bus_id"] == BUSES[3] and gpu3.observed["device_minor"] == 3
    assert gpu3.observed["active_links"] == 12
    active = [s for s in out if isinstance(s, Sample) and s.name == "nodehealth_gpu_nvlink_active"]
    assert len(active) == 96 and all(s.value == 1 for s in active)
    assert {"gpu", "UUID", "pci_bus_id", "link"} <= set(active[0].labels)


@pytest.mark.parametrize("rendering", ["<inactive>", "Inactive"])
def test_a_down_link_fails_that_gpu_only_and_clears(tmp_path: Path, rendering: str) -> None:
    node, probe = Node(), GpuLinksProbe(Clock())
    node.inactive[5] = [3]
    (tmp_path / "r").mkdir()
    out = run(tmp_path / "r", node, probe)
    assert bad(out, "gpu.nvlink") == {"gpu5": "NvlinkDown"}
    finding = findings(out, "gpu.nvlink")["gpu5"]
    assert finding.status == Status.FAIL and finding.device == 5 and "[3]" in finding.message
    assert finding.observed["device_ids"] == [UUIDS[5]]
    node.inactive.clear()
    assert not bad(run(tmp_path / "r", node, probe), "gpu.nvlink")
    assert parse_status(STATUS_I0.replace("Link 7: 25 GB/s", f"Link 7: {rendering}"))[0].states[7] is False


def test_link_errors_within_the_window_warn_or_fail_and_clear(tmp_path: Path) -> None:
    clock, node = Clock(), Node()
    probe = GpuLinksProbe(clock)
    node.counters[(2, 4, "Replay Errors")] = 500  # since the driver loaded: a baseline only
    assert not bad(run(tmp_path, node, probe, window_seconds=600), "gpu.nvlink")
    clock.now += 60
    node.counters[(2, 4, "Replay Errors")] = 700
    node.counters[(2, 4, "CRC Errors")] = 3
    out = run(tmp_path, node, probe, window_seconds=600, nvlink_error_threshold=100)
    finding = findings(out, "gpu.nvlink")["gpu2"]
    assert (
        finding.reason == "NvlinkErrors" and finding.status == Status.WARN and "replay_errors +200" in finding.message
    )
    clock.now += 30
    node.counters[(6, 0, "Recovery Errors")] = 1
    out = run(tmp_path, node, probe, window_seconds=600)
    assert findings(out, "gpu.nvlink")["gpu6"].status == Status.FAIL
    assert bad(out, "gpu.nvlink") == {"gpu2": "NvlinkErrors", "gpu6": "NvlinkErrors"}
    clock.now += 601
    assert not bad(run(tmp_path, node, probe, window_seconds=600), "gpu.nvlink")
    # a counter reset (driver reload) is a new baseline, never a burst
    node.counters[(2, 4, "Replay Errors")] = 0
    clock.now += 30
    assert not bad(run(tmp_path, node, probe, window_seconds=600), "gpu.nvlink")


def test_the_window_survives_a_restart(tmp_path: Path) -> None:
    clock, node = Clock(), Node()
    run(tmp_path, node, GpuLinksProbe(clock))
    clock.now += 30
    node.counters[(1, 1, "Recovery Errors")] = 2
    assert bad(run(tmp_path, node, GpuLinksProbe(clock)), "gpu.nvlink") == {"gpu1": "NvlinkErrors"}
    clock.now += 30
    assert bad(run(tmp_path, node, GpuLinksProbe(clock)), "gpu.nvlink") == {"gpu1": "NvlinkErrors"}


@pytest.mark.parametrize(("state", "status"), [("In Progress", "N/A"), ("Not Started", "N/A"), ("Completed", "Fail")])
def test_a_gpu_whose_fabric_is_not_completed_fails_alone(tmp_path: Path, state: str, status: str) -> None:
    node = Node()
    node.fabric[4] = FABRIC_OK.replace("Completed", state).replace("Success", status)
    out = run(tmp_path, node, GpuLinksProbe(Clock()))
    assert bad(out, "gpu.fabric") == {"gpu4": "FabricNotReady"}
    finding = findings(out, "gpu.fabric")["gpu4"]
    assert finding.device == 4 and finding.observed["device_ids"] == [UUIDS[4]] and state in finding.message
    node.fabric[4] = FABRIC_OK
    assert not bad(run(tmp_path, node, GpuLinksProbe(Clock())), "gpu.fabric")


def test_fabric_manager_down_on_an_nvswitch_system_is_every_gpus_problem(tmp_path: Path) -> None:
    out = run(tmp_path, Node(), GpuLinksProbe(Clock()), proc=fabric_proc(tmp_path, False))
    assert bad(out, "gpu.fabric") == {f"gpu{i}": "FabricManagerDown" for i in range(8)}
    assert not bad(run(tmp_path, Node(), GpuLinksProbe(Clock())), "gpu.fabric")


def test_a_tenants_process_named_nv_fabricmanager_does_not_count(tmp_path: Path) -> None:
    proc = fabric_proc(tmp_path, True)
    cgroup = proc / str(os.getpid()) / "cgroup"
    pod = "kubepods-besteffort-pod1f2e3d4c_5b6a_7980_1a2b_3c4d5e6f7a8b.slice"
    cgroup.write_text(f"0::/kubepods.slice/kubepods-besteffort.slice/{pod}/cri-containerd-{'a' * 64}.scope\n")
    assert not fabric_manager_running(proc)
    cgroup.write_text("0::/system.slice/nvidia-fabricmanager.service\n")
    assert fabric_manager_running(proc)


def test_a_node_without_nvswitch_or_nvlink_skips(tmp_path: Path) -> None:
    node = Node(fabric=FABRIC_NA)
    out = run(tmp_path, node, GpuLinksProbe(Clock()), proc=fabric_proc(tmp_path, False))
    (fabric,) = findings(out, "gpu.fabric").values()
    assert fabric.reason == "NotApplicable" and "not an NVSwitch system" in fabric.message
    assert len(findings(out, "gpu.nvlink")) == 8  # NVLinks without NVSwitch (bridges): still checked
    (tmp_path / "pcie").mkdir()
    smi = fake_smi(tmp_path / "pcie", node)
    (tmp_path / "pcie" / "s.txt").write_text("".join(f"GPU {i}: NVIDIA A10 (UUID: {UUIDS[i]})\n" for i in range(8)))
    (tmp_path / "pcie" / "e.txt").write_text("")
    config = parse_config({"gpu": {"smi_command": [smi], "nvml_library": "/absent.so", "expected_gpus": 8}})
    _, found, _ = execute(GpuLinksProbe(Clock()), Host(proc=fabric_proc(tmp_path, False)), config, 20.0)
    assert {f.reason for f in found} == {"NotApplicable"}


def test_no_nvidia_smi_skips(tmp_path: Path) -> None:
    config = parse_config({"gpu": {"smi_command": [str(tmp_path / "absent")], "nvml_library": "/absent.so"}})
    result, found, _ = execute(GpuLinksProbe(), Host(dev=tmp_path, root=tmp_path), config, 5.0)
    assert result == "skip"
    assert {f.reason for f in found} == {"NotApplicable"}


def test_a_hung_nvidia_smi_is_unknown_within_its_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    out = run(tmp_path, Node(), GpuLinksProbe(Clock()), hang="nvlink -e")
    assert time.monotonic() - started < 30  # smi_timeout_seconds is 2; the fake would sleep 60
    assert {f.reason for f in out if isinstance(f, Finding)} == {"GpuLinksUnreadable"}


def test_unparseable_output_is_a_parse_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        parse_status("Link 0: 25 GB/s\n")  # no GPU header
    with pytest.raises(ValueError):
        parse_errors(ERRORS_I0 + "\t garbage\n")
    assert parse_errors(ERRORS_I0)[0].counters[11] == {"replay_errors": 0, "recovery_errors": 0, "crc_errors": 0}


def test_the_probe_runs_in_the_agent_with_the_others(tmp_path: Path) -> None:
    script = (
        "import json, sys\nfrom probes import all_probes\n"
        "print(json.dumps(sorted(p.checks for p in all_probes().values() if p.name == 'gpu.links')))"
    )
    found = json.loads(
        subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True).stdout
    )
    assert found == [["gpu.nvlink", "gpu.fabric"]]
