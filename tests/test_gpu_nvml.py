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
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.fake_nvml.build import LIBRARY_NAME, build_fake_nvml, device_config
from support.system import REPO, require, require_root

RUNNER = r"""
import json, sys
from agent.config import parse_config
from probes.runtime.host import Host
from agent.scheduler import execute
from probes.gpu.gpu import GpuProbe

config = parse_config(json.loads(sys.argv[1]))
host = Host(proc="/proc", dev=sys.argv[2])
result, findings, samples = execute(GpuProbe(), host, config, 20.0)
print(json.dumps({
    "result": result,
    "findings": [f.to_dict() for f in findings],
    "samples": [{"name": s.name, "value": s.value, "labels": dict(s.labels), "kind": s.kind} for s in samples],
    "pynvml_imported": "pynvml" in sys.modules,
}))
"""

NO_SMI = ["/nonexistent/nvidia-smi"]
GIB_80 = 81559


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require(shutil.which("gcc") is not None or shutil.which("cc") is not None, "gcc to build the fake NVML")
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))


class Run:
    def __init__(self, data: dict[str, Any], calls: list[str]) -> None:
        self.result: str = data["result"]
        self.findings: list[dict[str, Any]] = data["findings"]
        self.samples: list[dict[str, Any]] = data["samples"]
        self.pynvml_imported: bool = data["pynvml_imported"]
        self.calls = calls

    def finding(self, check: str, subject: str) -> dict[str, Any]:
        found = [f for f in self.findings if f["check"] == check and f["subject"] == subject]
        assert len(found) == 1, (check, subject, self.findings)
        return found[0]

    def sample(self, metric: str, /, **labels: str) -> float:
        found = [
            s for s in self.samples if s["name"] == metric and all(s["labels"].get(k) == v for k, v in labels.items())
        ]
        assert len(found) == 1, (metric, labels, found)
        return found[0]["value"]


def run_probe(
    tmp_path: Path,
    library_dir: Path | None,
    config_text: str,
    gpu_config: dict[str, Any] | None = None,
    dev_dir: Path | None = None,
) -> Run:
    scenario = tmp_path / "fake-nvml.conf"
    scenario.write_text(config_text)
    log = tmp_path / "nvml-calls.log"
    log.unlink(missing_ok=True)
    dev = dev_dir or tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_NVML_CONFIG")}
    env.update(PYTHONPATH=str(REPO), FAKE_NVML_CONFIG=str(scenario), FAKE_NVML_LOG=str(log))
    if library_dir is not None:
        env["LD_LIBRARY_PATH"] = str(library_dir)
    config = {"gpu": {"smi_command": NO_SMI, **(gpu_config or {})}}
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(config), str(dev)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().split() if log.exists() else []
    return Run(json.loads(proc.stdout), calls)


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
    labels = {"gpu": "1", "uuid": "GPU-00000000-0000-0000-0000-000000000001", "name": "NVIDIA H100 80GB HBM3"}
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


def _mknod(path: Path, source: str) -> None:
    os.mknod(path, 0o600 | stat.S_IFCHR, os.stat(source).st_rdev)


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

POD_UID = "7d1c9e52-8a3b-4c6d-9e0f-1a2b3c4d5e6f"
CONTAINER_ID = "cd" * 32
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Real processes: A (host cgroup) holds dev/nvidia0; B (a pod's memory cgroup) holds dev/nvidia1;
    C holds nothing (NVML will list it on GPU 0); D, named nvidia-persistenced, holds dev/nvidia0."""
    require_root()
    dev = tmp_path / "holderdev"
    dev.mkdir()
    try:
        _mknod(dev / "nvidia0", "/dev/loop-control")
        _mknod(dev / "nvidia1", "/dev/btrfs-control")
        for name in ("nvidia0", "nvidia1"):
            os.close(os.open(dev / name, os.O_RDONLY))
    except OSError as exc:
        require(False, f"mknod and open of device copies in {dev} ({exc})")
    pod_cgroup = CGROUP_ROOT / "kubepods" / "burstable" / f"pod{POD_UID}" / CONTAINER_ID
    require((CGROUP_ROOT / "cgroup.procs").exists(), "cgroup v1 memory hierarchy")
    hold = 'exec 3<"$0"; exec sleep 60'
    procs: dict[str, subprocess.Popen[bytes]] = {}
    created: list[Path] = []
    try:
        procs["A"] = subprocess.Popen(["bash", "-c", hold, str(dev / "nvidia0")])
        procs["B"] = subprocess.Popen(["bash", "-c", hold, str(dev / "nvidia1")])
        procs["C"] = subprocess.Popen(["sleep", "60"])
        procs["D"] = subprocess.Popen(
            ["bash", "-c", 'exec 3<"$0"; exec -a nvidia-persistenced sleep 60', str(dev / "nvidia0")]
        )
        for parent in reversed([pod_cgroup, *pod_cgroup.parents]):
            if parent == CGROUP_ROOT or CGROUP_ROOT not in parent.parents:
                continue
            if not parent.exists():
                parent.mkdir()
                created.append(parent)
        (pod_cgroup / "cgroup.procs").write_text(str(procs["B"].pid))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # until both bash wrappers have opened and exec'ed sleep
            if all(len(os.listdir(f"/proc/{procs[k].pid}/fd")) > 3 for k in "ABD") and all(
                Path(f"/proc/{procs[k].pid}/comm").read_text().strip() == "sleep" for k in "ABD"
            ):
                break
            time.sleep(0.02)
        yield {"dev": dev, "pids": {k: p.pid for k, p in procs.items()}}
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(timeout=10)
        for path in reversed(created):
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)


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
    assert set(out_of_band) >= {pids["A"], pids["C"]}
    assert pids["D"] not in out_of_band
    assert out_of_band[pids["A"]]["sources"] == ["fd"]
    assert out_of_band[pids["C"]]["sources"] == ["nvml"]
    assert out_of_band[pids["A"]]["owner"].startswith("host cgroup")
    assert pids["D"] in {h["pid"] for h in gpu0["observed"]["allowed"]}
    assert f"pid {pids['A']}" in gpu0["message"] and gpu0["hint"]
    gpu1 = run.finding("gpu.holders", "gpu1")
    in_pods = {h["pid"]: h for h in gpu1["observed"]["in_pods"]}
    assert in_pods[pids["B"]]["sources"] == ["fd", "nvml"]
    assert POD_UID in in_pods[pids["B"]]["owner"]
    assert pids["B"] not in {h["pid"] for h in gpu1["observed"]["out_of_band"]}
    if not gpu1["observed"]["out_of_band"]:  # nothing else on this machine holds that device number
        assert gpu1["status"] == "ok"
    assert run.sample("nodehealth_gpu_out_of_band_holders", gpu="0") >= 2
    # Memory in use on GPU 0 with NVML listing a process: not a leak.
    assert run.finding("gpu.memory", "gpu0")["status"] == "ok"
