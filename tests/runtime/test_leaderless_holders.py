"""Holders whose main thread has exited (pthread_exit): a real C process (tests/support/leaderless) keeps its
fds and mappings in its one live thread while /proc/PID/fd and /proc/PID/maps of its zombie leader read empty.
Every holder scan names it: the /proc scan itself (device fd, mapped device, file, socket), npu.holders,
gpu.holders, network.ports and the lock walk's holder check."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.fake_npu_smi import FakeSmi, context, make_dev, run_probe, table
from support.fake_nvml.build import build_fake_nvml, device_config
from support.fake_nvml.runner import run_probe as run_gpu_probe
from support.leaderless import leaderless
from support.pod_cgroups import idle_devices

from agent.config import parse_config
from probes.base import Finding, ProbeContext, Status
from probes.network.ports import PortsProbe
from probes.runtime.host import Host
from probes.runtime.procfs import scan_open_files
from probes.runtime.procstat import parse_stat
from probes.storage.locks import LocksProbe

pytestmark = pytest.mark.system

ZERO = (1, 5)  # /dev/zero's number: a device that maps


def _listener_inode(port: int) -> int:
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:
            return int(fields[9])
    raise AssertionError(f"no listener on 127.0.0.1:{port}")


def test_the_scan_reads_a_live_thread_when_the_leader_has_exited(tmp_path: Path) -> None:
    (held,) = idle_devices(1)
    dev = make_dev(tmp_path / "dev", {"davinci0": held, "davinci1": ZERO})
    lock = tmp_path / "model.lock"
    lock.write_text("")
    with leaderless(tmp_path / "bin", dev / "davinci1", dev / "davinci0", lock) as child:
        assert os.listdir(f"/proc/{child.pid}/fd") == [] and Path(f"/proc/{child.pid}/maps").read_text() == ""
        lock_stat = os.stat(lock)
        socket = _listener_inode(child.port)
        result = scan_open_files(
            Host(),
            rdevs={os.makedev(*held), os.makedev(*ZERO)},
            timeout=30,
            mappings=True,
        )
        by_file = scan_open_files(Host(), inodes=[(lock_stat.st_dev, lock_stat.st_ino)], sockets=[socket], timeout=30)
        start = parse_stat(Path(f"/proc/{child.pid}/stat").read_text()).start_time
    mine = {(m.key, m.via, m.target) for m in result.matches + by_file.matches if m.pid == child.pid}
    assert mine == {
        (("rdev", os.makedev(*held)), "fd", str(dev / "davinci0")),
        (("rdev", os.makedev(*ZERO)), "mmap", str(dev / "davinci1")),
        (("inode", lock_stat.st_dev, lock_stat.st_ino), "fd", str(lock)),
        (("socket", socket), "fd", f"socket:[{socket}]"),
    }
    assert {m.start_time for m in result.matches if m.pid == child.pid} == {start}  # the process, not the thread
    # The command line comes from the live thread (the leader's reads empty): the holder is named.
    assert result.texts[child.pid][3] is not None and result.texts[child.pid][3].startswith(b"/")


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSmi:
    smi = FakeSmi(tmp_path / "fake")
    monkeypatch.setenv("PATH", f"{smi.bin}{os.pathsep}{os.environ.get('PATH', '')}")
    return smi


def test_npu_holders_name_a_holder_whose_main_thread_exited(tmp_path: Path, fake: FakeSmi) -> None:
    (held,) = idle_devices(1)
    dev = make_dev(tmp_path / "dev", {"davinci0": held, "davinci1": ZERO})
    with leaderless(tmp_path / "bin", dev / "davinci1", dev / "davinci0") as child:
        fake.answer({"info": table("910b1-8card-healthy-1proc-info-24.1.0.txt")})
        findings, _ = run_probe(context(tmp_path, proc=Path("/proc"), dev=dev))
    for chip, source in ((0, "fd"), (1, "mmap")):
        finding = findings[("npu.holders", f"npu{chip}")]
        assert (finding.status, finding.reason) == (Status.FAIL, "NpuHeldOutOfBand"), finding
        assert f"PID {child.pid} (leaderless)" in finding.message and f"kill {child.pid}" in finding.hint
        (holder,) = [h for h in finding.observed["holders"] if h["pid"] == child.pid]
        assert source in holder["sources"]


def test_gpu_holders_name_a_holder_whose_main_thread_exited(tmp_path: Path) -> None:
    (held,) = idle_devices(1)
    dev = make_dev(tmp_path / "gpudev", {"nvidia0": held, "nvidiactl": (1, 3)})
    library = build_fake_nvml(tmp_path / "nvml")
    with leaderless(tmp_path / "bin", None, dev / "nvidia0") as child:
        run = run_gpu_probe(tmp_path, library.parent, device_config({}), dev_dir=dev)
    gpu0 = run.finding("gpu.holders", "gpu0")
    assert (gpu0["status"], gpu0["reason"]) == ("fail", "GpuHeldOutOfBand"), gpu0
    assert [h["sources"] for h in gpu0["observed"]["out_of_band"] if h["pid"] == child.pid] == [["fd"]]
    assert f"PID {child.pid} (leaderless)" in gpu0["message"]


def test_ports_name_a_holder_whose_main_thread_exited(tmp_path: Path) -> None:
    with leaderless(tmp_path / "bin", None) as child:
        base = max(1, child.port - 3)
        config = parse_config({"network": {"ports": {"only_with_npus": False, "base": base, "count": 16}}})
        out = PortsProbe().run(ProbeContext(Host(), config, 20))
    (finding,) = [f for f in out if isinstance(f, Finding) and f.subject == f"{base}-{base + 15}"]
    assert (finding.status, finding.reason) == (Status.FAIL, "PortRangeOccupied"), finding
    assert child.pid in finding.observed["pids"] and f"PID {child.pid} (leaderless)" in finding.message


def test_a_lock_held_by_a_process_whose_main_thread_exited_is_not_stale(tmp_path: Path) -> None:
    lock = tmp_path / "torch_extensions" / "py311_cpu" / "ext" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    then = os.stat(lock).st_mtime - 7200
    os.utime(lock, (then, then))
    glob = f"{tmp_path}/torch_extensions/*/*/lock"
    config = parse_config({"storage": {"lock_globs": [glob], "stale_lock_age_seconds": 3600}})
    with leaderless(tmp_path / "bin", None, lock):
        held = [f for f in LocksProbe().run(ProbeContext(Host(), config, 20)) if isinstance(f, Finding)]
    gone = [f for f in LocksProbe().run(ProbeContext(Host(), config, 20)) if isinstance(f, Finding)]
    assert (held[0].status, held[0].observed["held"]) == (Status.OK, 1), held
    assert gone[0].reason == "StaleFileBaton", gone  # the same lock, its holder gone: the check can fail
