"""The gpu probe's NVML path: nvidia-ml-py's real ctypes code against a fake libnvidia-ml.so.1 built with gcc.

pynvml keeps module-global state (the loaded library, an init refcount), and the library is found through
LD_LIBRARY_PATH, read when the process starts: every scenario runs the probe in a fresh Python process.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.fake_nvml.build import LIBRARY_NAME, build_fake_nvml, device_config
from support.fake_nvml.runner import GIB_80, run_probe
from support.pod_cgroups import idle_devices, pod_cgroups
from support.system import REPO, require, require_root

# Every test here builds the fake NVML or nvidia-smi with gcc; some need root (mknod, cgroups, chroot) too.
pytestmark = pytest.mark.system


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require(shutil.which("gcc") is not None or shutil.which("cc") is not None, "gcc to build the fake NVML")
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))


def test_healthy_gpus_every_check_ok_with_metrics_and_exactly_the_calls_the_fake_implements(
    tmp_path: Path, fake_nvml: Path
) -> None:
    text = device_config({"clock_event_reasons": "0x1", "memory_used_mib": 0}, {"temperature": 51, "power_mw": 312500})
    run = run_probe(tmp_path, fake_nvml.parent, text)
    assert run.result == "ok"
    for index in (0, 1):
        for check in ("gpu.health", "gpu.throttle", "gpu.memory", "gpu.holders"):
            finding = run.finding(check, f"gpu{index}")
            assert finding["status"] == "ok", finding
            assert finding["device"] == index
    memory = run.finding("gpu.memory", "gpu0")
    assert memory["observed"]["hbm_free_mib"] == GIB_80
    assert memory["observed"]["processes"] == []
    assert run.finding("gpu.throttle", "gpu0")["observed"]["active"] == ["gpu_idle"]
    health = run.finding("gpu.health", "gpu1")["observed"]
    assert health["uuid"] == "GPU-00000000-0000-0000-0000-000000000001"
    assert health["bus_id"] == "00000000:19:00.0"
    assert health["recovery_action"] == "None"
    labels = {"gpu": "1", "UUID": "GPU-00000000-0000-0000-0000-000000000001", "name": "NVIDIA H100 80GB HBM3"}
    assert run.sample("nodehealth_gpu_temperature_celsius", **labels) == 51
    assert run.sample("nodehealth_gpu_power_watts", **labels) == 312.5
    assert run.sample("nodehealth_gpu_memory_total_bytes", gpu="0") == GIB_80 << 20
    assert run.sample("nodehealth_gpu_memory_used_bytes", gpu="0") == 0
    assert run.sample("nodehealth_gpu_ecc_errors_total", gpu="0", type="uncorrected", counter="aggregate") == 0
    assert run.sample("nodehealth_gpu_clock_event_reason_active", gpu="0", reason="gpu_idle") == 1
    assert run.sample("nodehealth_gpu_clock_event_reason_active", gpu="0", reason="hw_slowdown") == 0
    assert run.sample("nodehealth_gpu_recovery_action_required", gpu="0", action="None") == 0
    assert run.sample("nodehealth_gpu_devices", source="nvml") == 2
    assert run.pynvml_imported
    # One pass: init, every device, shutdown; and every entry point the fake exports was used.
    assert run.calls[0] == "nvmlInitWithFlags" and run.calls[-1] == "nvmlShutdown"
    assert run.calls.count("nvmlInitWithFlags") == 1
    source = (REPO / "tests" / "support" / "fake_nvml" / "fake_nvml.c").read_text()
    exported = {name for name in set(run.calls) if f" {name}(" in source}
    assert exported == set(run.calls)
    assert {
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetRetiredPagesPendingStatus",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceValidateInforom",
    } <= set(run.calls)


def test_faulty_gpus_each_fault_maps_to_its_reason(tmp_path: Path, fake_nvml: Path) -> None:
    text = device_config(
        {"ecc_uncorrected_volatile": 2, "ecc_uncorrected_aggregate": 2, "memory_used_mib": 2048},
        {"remap_correctable": 1, "remap_pending": 1, "memory_used_mib": 80000, "compute_process": "999999 80000"},
        {"remap_uncorrectable": 3, "remap_failure": 1},
        {"recovery_action": 1},
        {"retired_dbe": 2, "retired_sbe": 1, "retired_pending": 1},
        {"clock_event_reasons": "0x48"},
        {"clock_event_reasons": "0x20"},
        {"clock_event_reasons": "0x5", "ecc_uncorrected_aggregate": 3},
    )
    run = run_probe(tmp_path, fake_nvml.parent, text, {"min_free_mib": 4096})
    expect = {
        ("gpu.health", 0): ("fail", "GpuEccUncorrectable"),
        ("gpu.health", 1): ("fail", "GpuRetirementPending"),
        ("gpu.health", 2): ("fail", "GpuRowRemapFailed"),
        ("gpu.health", 3): ("fail", "GpuRecoveryRequired"),
        ("gpu.health", 4): ("fail", "GpuRetirementPending"),
        ("gpu.health", 5): ("ok", "OK"),
        ("gpu.health", 7): ("warn", "GpuEccUncorrectable"),
        ("gpu.throttle", 4): ("ok", "OK"),
        ("gpu.throttle", 5): ("fail", "GpuThrottled"),
        ("gpu.throttle", 6): ("warn", "GpuThrottled"),
        ("gpu.throttle", 7): ("ok", "OK"),
        ("gpu.memory", 0): ("fail", "GpuMemoryLeaked"),
        ("gpu.memory", 1): ("fail", "GpuMemoryLow"),
        ("gpu.memory", 2): ("ok", "OK"),
    }
    for (check, index), (status, reason) in expect.items():
        finding = run.finding(check, f"gpu{index}")
        assert (finding["status"], finding["reason"]) == (status, reason), finding
        assert finding["device"] == index
        if status != "ok":
            assert finding["hint"] and finding["message"].startswith(f"gpu{index}: ")
    assert "nvidia-smi -r -i 3" in run.finding("gpu.health", "gpu3")["hint"]
    assert run.finding("gpu.health", "gpu3")["observed"]["recovery_action"] == "Reset"
    assert run.finding("gpu.health", "gpu4")["observed"]["retired_pages_dbe"] == 2
    assert run.finding("gpu.throttle", "gpu5")["observed"]["active"] == ["hw_slowdown", "hw_thermal_slowdown"]
    assert run.finding("gpu.memory", "gpu1")["observed"] == {
        "hbm_free_mib": GIB_80 - 80000,
        "used_mib": 80000,
        "total_mib": GIB_80,
        "processes": [999999],
        "reasons": ["GpuMemoryLow"],
        "device_ids": ["GPU-00000000-0000-0000-0000-000000000001"],
        "pci_bus_id": "00000000:19:00.0",
        "device_minor": 1,
    }
    assert run.sample("nodehealth_gpu_retired_pages_total", gpu="4", cause="dbe") == 2
    assert run.sample("nodehealth_gpu_row_remap_failed", gpu="2") == 1
    assert run.sample("nodehealth_gpu_remapped_rows_total", gpu="2", type="uncorrectable") == 3
    assert run.sample("nodehealth_gpu_recovery_action_required", gpu="3", action="Reset") == 1
    assert run.sample("nodehealth_gpu_ecc_errors_total", gpu="0", type="uncorrected", counter="volatile") == 2


def test_not_supported_calls_are_noted_not_failures(tmp_path: Path, fake_nvml: Path) -> None:
    text = device_config(
        {
            "error": [
                "nvmlDeviceGetRemappedRows 3",
                "nvmlDeviceGetRetiredPages 3",
                "nvmlDeviceGetCurrentClocksEventReasons 3",
                "nvmlDeviceValidateInforom 3",
            ],
            "recovery_return": 3,
        }
    )
    run = run_probe(tmp_path, fake_nvml.parent, text)
    health = run.finding("gpu.health", "gpu0")
    assert health["status"] == "ok", health
    assert health["observed"]["not_supported"] == ["inforom", "recovery_action", "remapped_rows", "retired_pages"]
    assert health["observed"]["recovery_action"] is None
    throttle = run.finding("gpu.throttle", "gpu0")
    assert throttle["status"] == "ok" and throttle["observed"]["not_supported"] == ["clock_event_reasons"]
    names = {s["name"] for s in run.samples}
    assert "nodehealth_gpu_row_remap_pending" not in names
    assert "nodehealth_gpu_clock_event_reason_active" not in names


def test_other_nvml_errors_make_the_check_unknown(tmp_path: Path, fake_nvml: Path) -> None:
    text = device_config({"error": ["nvmlDeviceGetTotalEccErrors 21", "nvmlDeviceGetMemoryInfo 21"]})
    run = run_probe(tmp_path, fake_nvml.parent, text)
    health = run.finding("gpu.health", "gpu0")
    assert (health["status"], health["reason"]) == ("unknown", "GpuQueryFailed")
    # 21 (NO_DATA) has no text in pynvml's table: it asks the library's nvmlErrorString.
    assert "ecc_uncorrected_volatile: fake NVML error 21" in health["message"]
    assert run.finding("gpu.memory", "gpu0")["status"] == "unknown"


def test_lost_and_unopenable_gpus_and_expected_count_are_missing(tmp_path: Path, fake_nvml: Path) -> None:
    text = device_config({}, {"error": "* 15"}, {"handle_error": 999})
    run = run_probe(tmp_path, fake_nvml.parent, text, {"expected_gpus": 4})
    lost = run.finding("gpu.health", "gpu1")
    assert (lost["status"], lost["reason"], lost["device"]) == ("fail", "GpuMissing", 1)
    assert "GPU is lost" in lost["message"]
    unopenable = run.finding("gpu.health", "gpu2")
    assert (unopenable["status"], unopenable["reason"], unopenable["device"]) == ("fail", "GpuMissing", 2)
    node = run.finding("gpu.health", "")
    assert (node["status"], node["reason"]) == ("fail", "GpuMissing")
    assert node["observed"] == {"expected": 4, "enumerated": 2}
    assert run.finding("gpu.health", "gpu0")["status"] == "ok"


def _mknod(path: Path, node: str | tuple[int, int]) -> None:
    rdev = os.stat(node).st_rdev if isinstance(node, str) else os.makedev(*node)
    os.mknod(path, 0o600 | stat.S_IFCHR, rdev)


def test_dev_nodes_without_an_nvml_gpu_are_missing(tmp_path: Path, fake_nvml: Path) -> None:
    require_root()
    dev = tmp_path / "devnodes"
    dev.mkdir()
    for minor in range(3):
        _mknod(dev / f"nvidia{minor}", "/dev/null")
    _mknod(dev / "nvidiactl", "/dev/null")
    run = run_probe(tmp_path, fake_nvml.parent, device_config({}, {"minor": 2}), dev_dir=dev)
    missing = run.finding("gpu.health", "nvidia1")
    assert (missing["status"], missing["reason"]) == ("fail", "GpuMissing")
    assert [f["subject"] for f in run.findings if f["reason"] == "GpuMissing"] == ["nvidia1"]


def test_init_failure_without_nvidia_smi(tmp_path: Path, fake_nvml: Path) -> None:
    text = device_config(init_error=9)  # NVML_ERROR_DRIVER_NOT_LOADED
    expected = run_probe(tmp_path, fake_nvml.parent, text, {"expected_gpus": 2})
    health = expected.finding("gpu.health", "")
    assert (health["status"], health["reason"]) == ("fail", "GpuMissing")
    assert "Driver Not Loaded" in health["message"] and "not found" in health["message"]
    assert expected.finding("gpu.memory", "")["status"] == "unknown"
    not_expected = run_probe(tmp_path, fake_nvml.parent, text)
    # No GPU expected and no nvidia-smi: nothing says this host should have GPUs.
    assert {f["status"] for f in not_expected.findings} == {"skip"}


def test_no_library_no_smi_no_nodes_skips_without_importing_pynvml(tmp_path: Path) -> None:
    run = run_probe(tmp_path, None, "", {"nvml_library": str(tmp_path / "absent" / LIBRARY_NAME)})
    assert run.result == "skip"
    assert {f["message"] for f in run.findings} == {"no NVIDIA driver on this host"}
    assert not run.pynvml_imported


def test_nvml_library_path_from_config(tmp_path: Path, fake_nvml: Path) -> None:
    run = run_probe(tmp_path, None, device_config({}), {"nvml_library": str(fake_nvml)})
    assert run.result == "ok"
    assert run.finding("gpu.health", "gpu0")["status"] == "ok"


# --- holders ---------------------------------------------------------------------------------------


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Real processes: A (host cgroup) holds dev/nvidia0; B (a pod's container cgroup) holds dev/nvidia1;
    C holds nothing (NVML will list it on GPU 0); D, named nvidia-persistenced, holds dev/nvidia0."""
    dev = tmp_path / "holderdev"
    dev.mkdir()
    for name, node in zip(("nvidia0", "nvidia1"), idle_devices(2), strict=True):
        _mknod(dev / name, node)
    hold = 'exec 3<"$0"; exec sleep 60'
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with pod_cgroups(1) as (pod,):
        try:
            procs["A"] = subprocess.Popen(["bash", "-c", hold, str(dev / "nvidia0")])
            procs["B"] = subprocess.Popen(["bash", "-c", hold, str(dev / "nvidia1")])
            procs["C"] = subprocess.Popen(["sleep", "60"])
            procs["D"] = subprocess.Popen(
                ["bash", "-c", 'exec 3<"$0"; exec -a nvidia-persistenced sleep 60', str(dev / "nvidia0")]
            )
            pod.add(procs["B"].pid)
            _wait_exec(procs[k] for k in "ABD")
            yield {"dev": dev, "pids": {k: p.pid for k, p in procs.items()}, "pod": pod}
        finally:
            for proc in procs.values():
                proc.kill()
                proc.wait(timeout=10)


def _wait_exec(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """Until the bash wrappers have opened their node and exec'ed sleep."""
    pids = [proc.pid for proc in procs]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if all(len(os.listdir(f"/proc/{pid}/fd")) > 3 for pid in pids) and all(
            Path(f"/proc/{pid}/comm").read_text().strip() == "sleep" for pid in pids
        ):
            return
        time.sleep(0.02)


def test_holders_fd_scan_merged_with_nvml_processes_classified_by_cgroup(
    tmp_path: Path, fake_nvml: Path, holders: dict[str, Any]
) -> None:
    pids = holders["pids"]
    text = device_config(
        {"compute_process": f"{pids['C']} 100", "memory_used_mib": 100},
        {"compute_process": f"{pids['B']} 2048", "memory_used_mib": 2048},
    )
    run = run_probe(tmp_path, fake_nvml.parent, text, dev_dir=holders["dev"])
    gpu0 = run.finding("gpu.holders", "gpu0")
    assert (gpu0["status"], gpu0["reason"], gpu0["device"]) == ("fail", "GpuHeldOutOfBand", 0)
    out_of_band = {h["pid"]: h for h in gpu0["observed"]["out_of_band"]}
    assert set(out_of_band) == {pids["A"], pids["C"]}
    assert out_of_band[pids["A"]]["sources"] == ["fd"]
    assert out_of_band[pids["C"]]["sources"] == ["nvml"]
    assert out_of_band[pids["A"]]["owner"].startswith("host cgroup")
    assert out_of_band[pids["A"]]["executable"] == "sleep" and "command" not in out_of_band[pids["A"]]
    assert pids["D"] in {h["pid"] for h in gpu0["observed"]["allowed"]}
    assert f"PID {pids['A']} (sleep)" in gpu0["message"] and f"PID {pids['C']} (sleep)" in gpu0["message"]
    assert f"kill {pids['A']} {pids['C']}" in gpu0["hint"]
    gpu1 = run.finding("gpu.holders", "gpu1")
    assert (gpu1["status"], gpu1["observed"]["pods"]) == ("ok", 1)
    in_pods = {h["pid"]: h for h in gpu1["observed"]["in_pods"]}
    assert in_pods[pids["B"]]["sources"] == ["fd", "nvml"]
    assert holders["pod"].uid in in_pods[pids["B"]]["owner"]
    assert run.sample("nodehealth_gpu_out_of_band_holders", gpu="0") == 2
    assert run.sample("nodehealth_gpu_out_of_band_holders", gpu="1") == 0
    # Memory in use on GPU 0 with NVML listing a process: not a leak.
    assert run.finding("gpu.memory", "gpu0")["status"] == "ok"


@pytest.fixture
def two_pods(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Processes of two pods hold dev/nvidia0 (pod P0 also runs an MPS server); dev/nvidia1 has only P0's."""
    dev = tmp_path / "sharedev"
    dev.mkdir()
    for name, node in zip(("nvidia0", "nvidia1"), idle_devices(2), strict=True):
        _mknod(dev / name, node)
    hold = 'exec 3<"$0"; exec sleep 60'
    mps = 'exec 3<"$0"; exec -a nvidia-cuda-mps-server sleep 60'
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with pod_cgroups(3) as pods:
        try:
            procs["P0"] = subprocess.Popen(["bash", "-c", hold, str(dev / "nvidia0")])
            procs["P1"] = subprocess.Popen(["bash", "-c", hold, str(dev / "nvidia0")])
            procs["P0b"] = subprocess.Popen(["bash", "-c", hold, str(dev / "nvidia1")])
            procs["MPS"] = subprocess.Popen(["bash", "-c", mps, str(dev / "nvidia1")])
            for key, pod in (("P0", pods[0]), ("P1", pods[1]), ("P0b", pods[0]), ("MPS", pods[2])):
                pod.add(procs[key].pid)
            _wait_exec(procs.values())
            yield {"dev": dev, "pids": {k: p.pid for k, p in procs.items()}, "pods": pods}
        finally:
            for proc in procs.values():
                proc.kill()
                proc.wait(timeout=10)


def test_two_pods_on_one_gpu_fail_unless_sharing_is_allowed(
    tmp_path: Path, fake_nvml: Path, two_pods: dict[str, Any]
) -> None:
    pids, pods = two_pods["pids"], two_pods["pods"]
    run = run_probe(tmp_path, fake_nvml.parent, device_config({}, {}), dev_dir=two_pods["dev"])
    shared = run.finding("gpu.holders", "gpu0")
    assert (shared["status"], shared["reason"], shared["device"]) == ("fail", "GpuSharedByPods", 0)
    assert shared["message"].startswith("gpu0 is held by 2 pods: ")
    assert f"pod {pods[0].uid}: PID {pids['P0']} (sleep)" in shared["message"]
    assert f"pod {pods[1].uid}: PID {pids['P1']} (sleep)" in shared["message"]
    assert f"io.kubernetes.pod.uid={pods[1].uid}" in shared["hint"] and "gpu.shared_ok" in shared["hint"]
    assert shared["observed"]["device_ids"] == ["GPU-00000000-0000-0000-0000-000000000000"]
    # GPU 1: one pod's process and the MPS server (in a pod of its own): two holders, so shared.
    mps = run.finding("gpu.holders", "gpu1")
    assert (mps["status"], mps["reason"]) == ("fail", "GpuSharedByPods")
    assert f"MPS server: PID {pids['MPS']} (nvidia-cuda-mps-server)" in mps["message"]
    # Sharing on purpose: for every GPU, or for the listed ones.
    allowed = run_probe(tmp_path, fake_nvml.parent, device_config({}, {}), {"shared_ok": [0]}, two_pods["dev"])
    assert allowed.finding("gpu.holders", "gpu0")["status"] == "ok"
    assert allowed.finding("gpu.holders", "gpu0")["observed"]["sharing_allowed"] is True
    assert allowed.finding("gpu.holders", "gpu1")["reason"] == "GpuSharedByPods"
    everywhere = run_probe(tmp_path, fake_nvml.parent, device_config({}, {}), {"shared_ok": True}, two_pods["dev"])
    assert {everywhere.finding("gpu.holders", f"gpu{i}")["status"] for i in (0, 1)} == {"ok"}


def test_mps_servers_count_as_one_holder(tmp_path: Path, fake_nvml: Path) -> None:
    """Two MPS server processes in two pods hold one GPU with nothing else: one holder, not two pods."""
    dev = tmp_path / "mpsdev"
    dev.mkdir()
    _mknod(dev / "nvidia0", idle_devices(1)[0])
    mps = 'exec 3<"$0"; exec -a nvidia-cuda-mps-server sleep 60'
    with pod_cgroups(2) as pods:
        procs = [subprocess.Popen(["bash", "-c", mps, str(dev / "nvidia0")]) for _ in pods]
        try:
            for proc, pod in zip(procs, pods, strict=True):
                pod.add(proc.pid)
            _wait_exec(procs)
            run = run_probe(tmp_path, fake_nvml.parent, device_config({}), dev_dir=dev)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=10)
    held = run.finding("gpu.holders", "gpu0")
    assert (held["status"], held["observed"]["pods"], len(held["observed"]["in_pods"])) == ("ok", 1, 2)


def test_gpu_identity_in_findings_metrics_and_the_device_inventory(tmp_path: Path, fake_nvml: Path) -> None:
    """Every finding about a GPU carries its UUID and its MIG devices' UUIDs (so /ready?devices=GPU-… and
    MIG-… work); metrics carry pci_bus_id and UUID (dcgm-exporter's names); the Bus-Ids go to the host's device
    inventory."""
    mig = ["MIG-11111111-2222-3333-4444-555555555555", "MIG-66666666-7777-8888-9999-000000000000"]
    text = device_config({"mig_uuid": mig, "ecc_uncorrected_volatile": 1}, {"error": "nvmlDeviceGetMigMode 3"})
    run = run_probe(tmp_path, fake_nvml.parent, text)
    gpu0 = "GPU-00000000-0000-0000-0000-000000000000"
    for check in ("gpu.health", "gpu.throttle", "gpu.memory", "gpu.holders"):
        assert run.finding(check, "gpu0")["observed"]["device_ids"] == [gpu0, *mig]
        assert run.finding(check, "gpu1")["observed"]["device_ids"] == ["GPU-00000000-0000-0000-0000-000000000001"]
    assert run.finding("gpu.health", "gpu0")["reason"] == "GpuEccUncorrectable"
    assert "mig_mode" not in run.finding("gpu.health", "gpu1")["observed"].get("not_supported", [])
    labels = {"gpu": "0", "UUID": gpu0, "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:18:00.0"}
    assert run.sample("nodehealth_gpu_temperature_celsius", **labels) == 35
    assert sorted(run.devices) == [["gpu", 0, "gpu0", "0000:18:00.0"], ["gpu", 1, "gpu1", "0000:19:00.0"]]
    assert {"nvmlDeviceGetMigMode", "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex"} <= set(
        run.calls
    )


def test_command_lines_of_holders_only_when_not_redacted(tmp_path: Path, fake_nvml: Path) -> None:
    """NVML lists a process outside any pod: it is named by PID and executable; its argv (which may hold another
    tenant's secrets) appears only with redact_cmdlines: false."""
    secret = subprocess.Popen(["sleep", "60"])
    try:
        text = device_config({"compute_process": f"{secret.pid} 10", "memory_used_mib": 10})
        redacted = run_probe(tmp_path, fake_nvml.parent, text)
        shown = run_probe(tmp_path, fake_nvml.parent, text, top={"redact_cmdlines": False})
    finally:
        secret.kill()
        secret.wait(timeout=10)
    held = redacted.finding("gpu.holders", "gpu0")
    assert held["reason"] == "GpuHeldOutOfBand" and f"PID {secret.pid} (sleep)" in held["message"]
    assert "sleep 60" not in json.dumps(redacted.findings)
    assert f"PID {secret.pid} (sleep 60)" in shown.finding("gpu.holders", "gpu0")["message"]
    assert shown.finding("gpu.holders", "gpu0")["observed"]["out_of_band"][0]["command"] == "sleep 60"
