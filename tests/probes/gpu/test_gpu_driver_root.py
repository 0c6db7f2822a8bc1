"""GPU Operator nodes: the driver, libnvidia-ml and nvidia-smi live in the driver container's root
(/run/nvidia/driver on the host), not on the host's PATH. The probe loads NVML from the driver root's lib dirs
and runs nvidia-smi chrooted into it; with device nodes but no tool anywhere, the GPUs are unknown, not failed.

The driver roots here are real directories under a fake host root: the fake libnvidia-ml.so.1, and a static
fake nvidia-smi that answers from files inside the root (it runs chrooted, where nothing else exists).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from support.fake_nvml.build import LIBRARY_NAME, build_fake_nvml, build_fake_smi, device_config
from support.fake_nvml.runner import run_probe
from support.system import require, require_fixtures, require_root, require_tool

# Every test here builds the fake NVML or nvidia-smi with gcc; some need root (mknod, cgroups, chroot) too.
pytestmark = pytest.mark.system

DRIVER_ROOT = "run/nvidia/driver"
A100_BUSES = [f"0000000{d}:00:00.0" for d in "1234BCDE"]
MIG_UUIDS = ["MIG-4a0c5f3e-1b2d-5c6e-8f90-a1b2c3d4e5f6", "MIG-7b8c9d0e-1f2a-5b3c-9d4e-f5a6b7c8d9e0"]


@pytest.fixture(scope="module")
def fake_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require(shutil.which("gcc") is not None or shutil.which("cc") is not None, "gcc to build the fake NVML")
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))


def _nodes(dev: Path, count: int) -> Path:
    """/dev/nvidia0..N-1 and /dev/nvidiactl, mknod'ed with NVIDIA's major (nothing opens them here)."""
    require_root()
    dev.mkdir()
    for minor in range(count):
        os.mknod(dev / f"nvidia{minor}", 0o600 | stat.S_IFCHR, os.makedev(195, minor))
    os.mknod(dev / "nvidiactl", 0o600 | stat.S_IFCHR, os.makedev(195, 255))
    return dev


def test_nvml_is_loaded_from_the_driver_root(tmp_path: Path, fake_library: Path) -> None:
    host = tmp_path / "host"
    lib_dir = host / DRIVER_ROOT / "usr/lib/x86_64-linux-gnu"
    lib_dir.mkdir(parents=True)
    shutil.copy(fake_library, lib_dir / LIBRARY_NAME)
    # No LD_LIBRARY_PATH and no gpu.nvml_library: only the driver root has the library.
    run = run_probe(tmp_path, None, device_config({}, {}), host_root=host)
    assert run.result == "ok" and run.pynvml_imported
    assert {run.finding(check, f"gpu{i}")["status"] for check in ("gpu.health", "gpu.memory") for i in (0, 1)} == {"ok"}
    assert run.sample("nodehealth_gpu_devices", source="nvml") == 2
    assert run.calls[0] == "nvmlInitWithFlags"


def test_nvidia_smi_runs_chrooted_into_the_driver_root(tmp_path: Path) -> None:
    require_tool("chroot")
    require(shutil.which("gcc") is not None, "gcc (with a static libc) to build the fake nvidia-smi")
    driver = tmp_path / "host" / DRIVER_ROOT
    build_fake_smi(driver / "usr/bin/nvidia-smi")
    answers = driver / "fake-smi"
    answers.mkdir()
    full_q = (require_fixtures() / "nvidia-smi" / "a100-sxm4-40gb-8gpu-q-full-460.32.03-healthy.txt").read_text()
    # GPU 0 in MIG mode (the first MIG Mode section is GPU 0's).
    (answers / "q.txt").write_text(
        full_q.replace("Current                           : Disabled", "Current : Enabled", 1)
    )
    (answers / "csv.txt").write_text(
        "".join(f"{i}, {bus}, {'Reset' if i == 1 else 'None'}\n" for i, bus in enumerate(A100_BUSES))
    )
    (answers / "list.txt").write_text(
        "GPU 0: A100-SXM4-40GB (UUID: GPU-b01e9f90-c60c-4ad1-2052-154833662357)\n"
        f"  MIG 3g.20gb     Device  0: (UUID: {MIG_UUIDS[0]})\n"
        f"  MIG 3g.20gb     Device  1: (UUID: {MIG_UUIDS[1]})\n"
        "GPU 1: A100-SXM4-40GB (UUID: GPU-fccd4a78-556b-7b41-320b-f2a10438c176)\n"
    )
    (answers / "responses").write_text(
        "0 q.txt -q\n0 csv.txt --query-gpu=index,pci.bus_id,gpu_recovery_action --format=csv,noheader\n0 list.txt -L\n"
    )
    dev = _nodes(tmp_path / "dev", 8)
    run = run_probe(tmp_path, None, "", {"nvml_library": str(tmp_path / "absent.so")}, dev, tmp_path / "host")
    assert run.result == "ok" and not run.pynvml_imported
    assert run.sample("nodehealth_gpu_devices", source="nvidia-smi") == 8
    reset = run.finding("gpu.health", "gpu1")
    assert (reset["status"], reset["reason"], reset["device"]) == ("fail", "GpuRecoveryRequired", 1)
    assert {run.finding("gpu.health", f"gpu{i}")["status"] for i in (0, *range(2, 8))} == {"ok"}
    assert run.finding("gpu.memory", "gpu0")["observed"]["device_ids"] == [
        "GPU-b01e9f90-c60c-4ad1-2052-154833662357",
        *MIG_UUIDS,
    ]
    calls = (answers / "calls").read_text().splitlines()
    assert calls == ["-q", "--query-gpu=index,pci.bus_id,gpu_recovery_action --format=csv,noheader", "-L"]


def test_device_nodes_without_any_tool_are_unknown_not_failed(tmp_path: Path) -> None:
    """/dev/nvidia* present but neither the library nor nvidia-smi anywhere: nothing says a GPU is broken."""
    dev = _nodes(tmp_path / "dev", 2)
    run = run_probe(tmp_path, None, "", {"nvml_library": str(tmp_path / "absent.so")}, dev, tmp_path / "host")
    assert run.result == "ok"
    assert {(f["check"], f["status"], f["reason"]) for f in run.findings} == {
        (check, "unknown", "GpuToolMissing")
        for check in ("gpu.health", "gpu.throttle", "gpu.memory", "gpu.holders", "gpu.ledger")
    }
    message = run.finding("gpu.health", "")["message"]
    assert "2 GPUs expected (2 /dev/nvidiaN nodes)" in message and "run/nvidia/driver" in message


def test_expected_gpus_without_any_tool_are_unknown(tmp_path: Path) -> None:
    run = run_probe(tmp_path, None, "", {"nvml_library": str(tmp_path / "absent.so"), "expected_gpus": 4})
    health = run.finding("gpu.health", "")
    assert (health["status"], health["reason"], health["observed"]) == (
        "unknown",
        "GpuToolMissing",
        {"expected": 4, "device_nodes": 0},
    )
