"""npu.holders end to end: real processes holding mknod'ed device nodes, in real cgroups named like pods, with
a fake npu-smi listing PIDs; two pods on one chip; a process on a hung FUSE mount that must hide nothing;
command lines only when not redacted; the chips' Bus-Ids in the device inventory and in metric labels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.fake_npu_smi import FakeSmi, context, make_dev, npu_fixture, run_probe, sample, table
from support.fusefs import fuse_mount
from support.pod_cgroups import containerd_bundle, holding, idle_devices, mapping, pod_cgroups
from support.system import fuse_capable, require

from probes.base import Finding, Status
from probes.runtime.procfs import classify_cgroup


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSmi:
    smi = FakeSmi(tmp_path / "fake")
    monkeypatch.setenv("PATH", f"{smi.bin}{os.pathsep}{os.environ.get('PATH', '')}")
    return smi


# --- holders: real processes holding mknod'ed nodes ---------------------------------------------


Devices = list[tuple[int, int]]


@pytest.fixture
def free() -> Devices:
    """Two real character devices no process holds now: the nodes a test's processes hold."""
    return idle_devices(2)


def _table_listing(pid: int) -> dict[str, Any]:
    text = npu_fixture("910b1-8card-healthy-1proc-info-24.1.0.txt").read_text()
    return {"stdout": text.replace("| 641248        |", f"| {pid:<13} |")}


def _holder(finding: Finding, pid: int) -> dict[str, Any]:
    return next(h for h in finding.observed["holders"] if h["pid"] == pid)


def _others(finding: Finding, *mine: int) -> list[dict[str, Any]]:
    """Holders this test did not start (another process of this machine may hold /dev/full too)."""
    return [h for h in finding.observed["holders"] if h["pid"] not in mine]


@pytest.mark.system
def test_holder_outside_kubernetes_of_a_container_copy(
    tmp_path: Path, fake: FakeSmi, free: list[tuple[int, int]]
) -> None:
    host_dev = make_dev(tmp_path / "dev", {"davinci0": free[0], "davinci1": (240, 1)})
    # A container's /dev is its own tmpfs with its own inode for the same major:minor.
    container_dev = make_dev(tmp_path / "container-dev", {"davinci0": free[0]})
    with holding(container_dev / "davinci0", "--token=s3cr3t-argv") as child:
        fake.answer({"info": _table_listing(child.pid)})
        findings, samples = run_probe(context(tmp_path, proc=Path("/proc"), dev=host_dev))
        cgroup = classify_cgroup(Path(f"/proc/{child.pid}/cgroup").read_text())
    require(not cgroup.in_pod, "a test process outside any Kubernetes pod cgroup")
    held = findings[("npu.holders", "npu0")]
    assert (held.status, held.reason, held.device) == (Status.FAIL, "NpuHeldOutOfBand", 0)
    assert f"PID {child.pid} ({Path(sys.executable).name})" in held.message and "/dev/davinci0" in held.message
    assert cgroup.describe() in held.message
    assert f"kill {child.pid}" in held.hint
    holder = _holder(held, child.pid)
    assert holder["sources"] == ["fd", "npu-smi"] and holder["things"] == ["davinci0"]
    assert holder["kind"] == cgroup.kind and holder["cgroup_path"] == cgroup.path
    # Another tenant's command line may hold secrets: never shown unless the operator allows it.
    assert "s3cr3t" not in json.dumps([f.to_dict() for f in findings.values()])
    assert "command" not in holder
    assert findings[("npu.holders", "npu1")].status == Status.OK
    assert sample(samples, "nodehealth_npu_out_of_band_holders", 0) >= 1
    assert sample(samples, "nodehealth_npu_out_of_band_holders", 1) == 0
    assert findings[("npu.hbm", "npu0")].reason != "NpuHbmLeaked"


@pytest.mark.system
def test_command_lines_shown_only_when_not_redacted(tmp_path: Path, fake: FakeSmi, free: Devices) -> None:
    host_dev = make_dev(tmp_path / "dev", {"davinci0": free[0]})
    with holding(host_dev / "davinci0", "--token=s3cr3t-argv") as child:
        fake.answer({"info": _table_listing(child.pid)})
        ctx = context(tmp_path, proc=Path("/proc"), dev=host_dev)
        ctx.redact_cmdlines = False
        findings, _ = run_probe(ctx)
    held = findings[("npu.holders", "npu0")]
    assert held.status == Status.FAIL and f"PID {child.pid} ({sys.executable} -c import os" in held.message
    assert "--token=s3cr3t-argv" in held.message
    assert "--token=s3cr3t-argv" in _holder(held, child.pid)["command"]


@pytest.mark.system
def test_vanished_npu_smi_pid_is_counted(tmp_path: Path, fake: FakeSmi) -> None:
    host_dev = make_dev(tmp_path / "dev", {"davinci0": (240, 0)})
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its PID names no process now
    fake.answer({"info": _table_listing(gone.pid)})
    findings, _ = run_probe(context(tmp_path, proc=Path("/proc"), dev=host_dev))
    held = findings[("npu.holders", "npu0")]
    assert held.status == Status.OK and held.observed["vanished"] >= 1
    assert all(h["pid"] != gone.pid for h in held.observed["holders"])


@pytest.mark.system
def test_failed_scan_is_unknown_not_fatal(tmp_path: Path, fake: FakeSmi) -> None:
    host_dev = make_dev(tmp_path / "dev", {"davinci0": (240, 0)})
    fake.answer({"info": table("910b3-container-only-card3-visible-info-25.2.3-IRREGULAR-ALIGNMENT.txt")})
    findings, _ = run_probe(context(tmp_path, proc=tmp_path / "no-such-proc", dev=host_dev))
    held = findings[("npu.holders", "npu0")]
    assert (held.status, held.reason, held.device) == (Status.UNKNOWN, "NpuHolderScanFailed", 0)
    assert "no-such-proc" in held.observed["scan_error"] and "no-such-proc" in held.message
    assert findings[("npu.smi", "")].status == Status.OK and findings[("npu.health", "npu0")].status == Status.OK


@pytest.mark.system
def test_holder_in_a_pod_is_fine(tmp_path: Path, fake: FakeSmi, free: Devices) -> None:
    host_dev = make_dev(tmp_path / "dev", {"davinci0": free[0]})
    with pod_cgroups(1) as (pod,), holding(host_dev / "davinci0") as child:
        pod.add(child.pid)
        fake.answer({"info": _table_listing(child.pid)})
        findings, samples = run_probe(context(tmp_path, proc=Path("/proc"), dev=host_dev))
        child.kill()
    held = findings[("npu.holders", "npu0")]
    holder = _holder(held, child.pid)
    assert holder["kind"] == "pod" and holder["pod"] == {"uid": pod.uid}
    assert holder["container_id"] == pod.container_id and f"pod {pod.uid}" in holder["owner"]
    assert held.observed["holders_in_pods"] >= 1 and held.observed["pods"] == 1
    others = [h for h in _others(held, child.pid) if h["kind"] != "pod"]
    assert held.status == (Status.FAIL if others else Status.OK)
    assert sample(samples, "nodehealth_npu_out_of_band_holders", 0) == len(others)


@pytest.mark.system
def test_two_pods_on_one_chip_fail_naming_each_pod(tmp_path: Path, fake: FakeSmi, free: Devices) -> None:
    """Volcano and the default scheduler both placed a job on davinci1: two pods' processes hold it."""
    host_dev = make_dev(tmp_path / "dev", {"davinci0": free[0], "davinci1": free[1]})
    host_root = tmp_path / "host"
    with (
        pod_cgroups(2) as (named, unnamed),
        holding(host_dev / "davinci1") as first,
        holding(tmp_path / "dev" / "davinci1") as second,
    ):
        containerd_bundle(host_root, named.container_id, "team-a", "train-0", "worker")
        named.add(first.pid)
        unnamed.add(second.pid)
        fake.answer({"info": table("910b1-8card-healthy-1proc-info-24.1.0.txt")})
        ctx = context(tmp_path, proc=Path("/proc"), dev=host_dev)
        ctx.host.root = host_root
        findings, _ = run_probe(ctx)
        first.kill()
        second.kill()
    shared = findings[("npu.holders", "npu1")]
    assert (shared.status, shared.reason, shared.device) == (Status.FAIL, "NpuSharedByPods", 1)
    executable = Path(sys.executable).name
    assert "/dev/davinci1 is held by 2 pods" in shared.message
    assert f"pod team-a/train-0 container worker: PID {first.pid} ({executable})" in shared.message
    assert f"pod {unnamed.uid}: PID {second.pid} ({executable})" in shared.message
    assert "kubectl delete pod -n team-a train-0" in shared.hint
    assert f"io.kubernetes.pod.uid={unnamed.uid}" in shared.hint
    assert _holder(shared, first.pid)["pod"] == {
        "uid": named.uid,
        "namespace": "team-a",
        "name": "train-0",
        "container": "worker",
    }
    assert findings[("npu.holders", "npu0")].reason != "NpuSharedByPods"


@pytest.mark.system
def test_one_pod_with_several_processes_on_a_chip_is_not_shared(
    tmp_path: Path, fake: FakeSmi, free: list[tuple[int, int]]
) -> None:
    host_dev = make_dev(tmp_path / "dev", {"davinci0": free[1]})
    with pod_cgroups(1) as (pod,), holding(host_dev / "davinci0") as one, holding(host_dev / "davinci0") as two:
        pod.add(one.pid)
        pod.add(two.pid)
        fake.answer({"info": table("910b1-8card-healthy-1proc-info-24.1.0.txt")})
        findings, _ = run_probe(context(tmp_path, proc=Path("/proc"), dev=host_dev))
        one.kill()
        two.kill()
    held = findings[("npu.holders", "npu0")]
    others = [h for h in _others(held, one.pid, two.pid)]
    require(not others, "no other process of this machine holding /dev/random")
    assert (held.status, held.observed["pods"], held.observed["holders_in_pods"]) == (Status.OK, 1, 2)


@pytest.mark.system
def test_a_process_on_a_hung_fuse_mount_does_not_hide_an_out_of_band_holder(
    tmp_path: Path, fake: FakeSmi, free: list[tuple[int, int]]
) -> None:
    """A process with a file open on a FUSE mount that never answers: a plain stat of that fd would block the
    scan; the holder of /dev/davinci3 outside Kubernetes is still reported, within the probe's deadline."""
    fuse_capable()
    host_dev = make_dev(tmp_path / "dev", {f"davinci{n}": (240, n) for n in range(3)} | {"davinci3": free[0]})
    (tmp_path / "fuse").mkdir()
    with (
        fuse_mount(tmp_path / "fuse", "--hang-getattr") as mount,
        holding(mount.path) as stuck,
        holding(host_dev / "davinci3") as holder,
    ):
        fake.answer({"info": table("910b1-8card-healthy-1proc-info-24.1.0.txt")})
        started = time.monotonic()
        findings, _ = run_probe(context(tmp_path, {"holder_scan_timeout_seconds": 3.0}, Path("/proc"), host_dev))
        elapsed = time.monotonic() - started
        stuck_state = Path(f"/proc/{stuck.pid}/stat").read_text().split(") ", 1)[1][0]
    assert elapsed < 10.0  # the probe's own deadline
    held = findings[("npu.holders", "npu3")]
    assert (held.status, held.reason, held.device) == (Status.FAIL, "NpuHeldOutOfBand", 3)
    assert f"PID {holder.pid}" in held.message
    assert stuck_state != "D"  # the process on the hung mount was only looked at, never blocked on
    assert held.observed.get("unreadable") is None and findings[("npu.holders", "npu0")].status == Status.OK


def test_chips_publish_their_bus_ids_and_label_their_metrics(tmp_path: Path, fake: FakeSmi) -> None:
    fake.answer({"info": table("910b1-8card-healthy-1proc-info-24.1.0.txt")})
    ctx = context(tmp_path)
    _, samples = run_probe(ctx)
    device = ctx.host.devices.at("0000:c1:00.0")
    assert device is not None and (device.kind, device.index, device.name) == ("npu", 0, "npu0")
    assert ctx.host.devices.at("0000:42:00.0").index == 7  # type: ignore[union-attr]
    labels = next(s.labels for s in samples if s.name == "nodehealth_npu_health" and s.labels["chip"] == "1")
    # `id`: the physical id, npu-exporter's chip label; the pod labels are empty without a ledger.
    assert labels == {
        "chip": "1",
        "card": "1",
        "name": "910B1",
        "pci_bus_id": "0000:01:00.0",
        "id": "1",
        "pod": "",
        "namespace": "",
        "container": "",
    }
    # A run without a table keeps what is known: a chip that fell off the bus still has its bus id.
    fake.answer({"info": {"stdout": "dcmi module initialize failed. ret is -8005\n", "rc": 1}})
    run_probe(ctx)
    assert ctx.host.devices.at("0000:c1:00.0") is not None


@pytest.mark.system
def test_holder_of_only_the_shared_node_warns(tmp_path: Path, fake: FakeSmi, free: Devices) -> None:
    host_dev = make_dev(tmp_path / "dev", {"davinci0": (240, 0), "davinci_manager": free[0]})
    with holding(host_dev / "davinci_manager") as child:
        fake.answer({"info": table("910b3-container-only-card3-visible-info-25.2.3-IRREGULAR-ALIGNMENT.txt")})
        findings, samples = run_probe(context(tmp_path, proc=Path("/proc"), dev=host_dev))
        comm = Path(f"/proc/{child.pid}/comm").read_text().strip()
        shared = findings[("npu.holders", "")]
        assert (shared.status, shared.reason) == (Status.WARN, "NpuHeldOutOfBand")
        assert _holder(shared, child.pid)["things"] == ["davinci_manager"]
        assert "/dev/davinci_manager held outside Kubernetes" in shared.message
        assert findings[("npu.holders", "npu0")].status == Status.OK
        assert next(s.value for s in samples if s.name == "nodehealth_npu_shared_out_of_band_holders") >= 1
        # A node daemon that must keep the node open can be allowed by name.
        findings, _ = run_probe(context(tmp_path, {"holder_ignore_commands": [comm]}, proc=Path("/proc"), dev=host_dev))
        assert all(h["pid"] != child.pid for h in findings[("npu.holders", "")].observed["holders"])


@pytest.mark.system
def test_a_process_that_mapped_the_node_and_closed_its_fd_is_the_holder(tmp_path: Path, fake: FakeSmi) -> None:
    """The Ascend runtime keeps mappings of its device nodes: a holder with no fd open on the node still holds
    the chip. The node is mknod'ed with /dev/zero's number (1:5), a device that maps; npu-smi lists no process."""
    host_dev = make_dev(tmp_path / "dev", {"davinci1": (1, 5)})
    with mapping(host_dev / "davinci1") as child:
        fake.answer({"info": table("910b1-8card-healthy-1proc-info-24.1.0.txt")})
        findings, _ = run_probe(context(tmp_path, {"hbm_leak_min_mib": 1000}, proc=Path("/proc"), dev=host_dev))
    held = findings[("npu.holders", "npu1")]
    assert (held.status, held.reason, held.device) == (Status.FAIL, "NpuHeldOutOfBand", 1)
    assert f"PID {child.pid} ({Path(sys.executable).name})" in held.message and "/dev/davinci1" in held.message
    assert f"kill {child.pid}" in held.hint
    holder = _holder(held, child.pid)
    assert (holder["sources"], holder["things"]) == (["mmap"], ["davinci1"])
    # The HBM the mapping holder uses is in use, not leaked; a chip nobody holds with as much in use is.
    assert findings[("npu.hbm", "npu1")].status == Status.OK
    assert findings[("npu.hbm", "npu2")].reason == "NpuHbmLeaked"
