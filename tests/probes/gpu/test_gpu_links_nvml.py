"""gpu.nvlink and gpu.fabric through NVML: nvidia-ml-py's real ctypes code against the fake libnvidia-ml.so.1
(tests/support/fake_nvml/fake_nvml.c: nvmlDeviceGetNvLinkState, nvmlDeviceGetNvLinkErrorCounter,
nvmlDeviceGetGpuFabricInfoV/-Info with nvml.h's return codes and struct layouts) on an 8-GPU H100 node with 18
NVLinks per GPU. Each run is a fresh process (pynvml's global state, LD_LIBRARY_PATH); the counter window is kept
in a state file between runs, its clock given to each run."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from support.fake_gpu_links import Node, fabric_proc, fake_smi
from support.fake_nvml.build import build_fake_nvml, device_config
from support.fake_nvml.runner import Run, run_probe
from support.system import require

pytestmark = pytest.mark.system  # builds the fake NVML with gcc

GPUS = 8
LINKS = 18
T0 = 1_700_000_000.0
PROBE = "probes.gpu.links:GpuLinksProbe"
# nvml.h nvmlNvLinkErrorCounter_t
REPLAY, RECOVERY, CRC_FLIT = 0, 1, 2


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require(shutil.which("gcc") is not None or shutil.which("cc") is not None, "gcc to build the fake NVML")
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml-links"))


def hgx(**per_gpu: dict[str, Any]) -> list[dict[str, Any]]:
    """8 H100s, 18 NVLinks each, fabric Completed/Success; `gpuN={...}` adds or replaces keys of GPU N."""
    gpus: list[dict[str, Any]] = []
    for index in range(GPUS):
        gpu: dict[str, Any] = {"nvlinks": LINKS, "fabric_state": 3, "fabric_status": 0, "fabric_health_mask": 0}
        gpu.update(per_gpu.get(f"gpu{index}", {}))
        gpus.append(gpu)
    return gpus


def links(
    tmp: Path,
    fake_nvml: Path,
    gpus: list[dict[str, Any]],
    now: float = T0,
    fabric_manager: bool = True,
    smi: str = "",
    init_error: int = 0,
    **section: Any,
) -> Run:
    section.setdefault("state_dir", str(tmp / "state"))
    gpu_config: dict[str, Any] = {"expected_gpus": len(gpus) or GPUS, "smi_timeout_seconds": 5}
    if smi:
        gpu_config["smi_command"] = [smi]
    return run_probe(
        tmp,
        fake_nvml.parent,
        device_config(*gpus, init_error=init_error),
        gpu_config,
        top={"interconnect": section},
        probe=PROBE,
        proc=fabric_proc(tmp, fabric_manager),
        now=now,
    )


def bad(run: Run, check: str) -> dict[str, str]:
    return {f["subject"]: f["reason"] for f in run.findings if f["check"] == check and f["status"] != "ok"}


def test_a_healthy_hgx_node_is_read_through_nvml_with_each_gpus_identity(tmp_path: Path, fake_nvml: Path) -> None:
    run = links(tmp_path, fake_nvml, hgx())
    assert not bad(run, "gpu.nvlink") and not bad(run, "gpu.fabric")
    gpu3 = run.finding("gpu.nvlink", "gpu3")
    assert gpu3["device"] == 3 and gpu3["observed"]["source"] == "nvml"
    assert gpu3["observed"]["active_links"] == LINKS and gpu3["observed"]["expected_links"] == LINKS
    assert gpu3["observed"]["device_ids"] == ["GPU-00000000-0000-0000-0000-000000000003"]
    assert gpu3["observed"]["pci_bus_id"] == "00000000:1B:00.0" and gpu3["observed"]["device_minor"] == 3
    fabric = run.finding("gpu.fabric", "gpu3")
    assert fabric["observed"]["state"] == "Completed" and fabric["observed"]["status"] == "Success"
    assert fabric["observed"]["health_mask"] == 0
    assert run.sample("nodehealth_gpu_nvlink_active", gpu="3", link="17") == 1
    assert run.sample("nodehealth_gpu_nvlink_errors_total", gpu="3", link="0", counter="crc_errors") == 0
    assert run.sample("nodehealth_gpu_fabric_completed", gpu="7") == 1
    # NVML only: the versioned fabric call (v3 first), never nvidia-smi (none configured: NO_SMI)
    assert {"nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkErrorCounter", "nvmlDeviceGetGpuFabricInfoV"} <= set(
        run.calls
    )
    assert "nvmlDeviceGetGpuFabricInfo" not in run.calls
    assert run.calls[0] == "nvmlInitWithFlags" and run.calls[-1] == "nvmlShutdown"


def test_a_down_link_fails_that_gpu_only_and_clears(tmp_path: Path, fake_nvml: Path) -> None:
    run = links(tmp_path, fake_nvml, hgx(gpu5={"nvlink_down": [3, 11]}))
    assert bad(run, "gpu.nvlink") == {"gpu5": "NvlinkDown"}
    finding = run.finding("gpu.nvlink", "gpu5")
    assert finding["status"] == "fail" and finding["device"] == 5 and "[3, 11]" in finding["message"]
    assert finding["observed"]["active_links"] == LINKS - 2
    assert run.sample("nodehealth_gpu_nvlink_active", gpu="5", link="11") == 0
    assert not bad(links(tmp_path, fake_nvml, hgx()), "gpu.nvlink")


def test_counters_rising_within_the_window_warn_or_fail_and_clear(tmp_path: Path, fake_nvml: Path) -> None:
    # since the driver loaded: a baseline only, never a burst
    baseline = hgx(gpu2={"nvlink_counter": [f"4 {REPLAY} 500"]})
    assert not bad(links(tmp_path, fake_nvml, baseline, window_seconds=600), "gpu.nvlink")
    rising = hgx(gpu2={"nvlink_counter": [f"4 {REPLAY} 700", f"4 {CRC_FLIT} 3"]})
    run = links(tmp_path, fake_nvml, rising, now=T0 + 60, window_seconds=600, nvlink_error_threshold=100)
    finding = run.finding("gpu.nvlink", "gpu2")
    assert finding["reason"] == "NvlinkErrors" and finding["status"] == "warn"
    assert "replay_errors +200" in finding["message"] and "crc_errors +3" in finding["message"]
    assert finding["observed"]["replay_errors_in_window"] == 200
    recovery = hgx(gpu2={"nvlink_counter": [f"4 {REPLAY} 700", f"4 {CRC_FLIT} 3"]}, gpu6={"nvlink_counter": "0 1 1"})
    run = links(tmp_path, fake_nvml, recovery, now=T0 + 90, window_seconds=600)
    assert bad(run, "gpu.nvlink") == {"gpu2": "NvlinkErrors", "gpu6": "NvlinkErrors"}
    assert run.finding("gpu.nvlink", "gpu6")["status"] == "fail"  # a recovery error stalls collectives
    # the window passes quietly: cleared
    assert not bad(links(tmp_path, fake_nvml, recovery, now=T0 + 700, window_seconds=600), "gpu.nvlink")
    # a driver reload (counters back to 0) is a new baseline
    assert not bad(links(tmp_path, fake_nvml, hgx(), now=T0 + 730, window_seconds=600), "gpu.nvlink")


@pytest.mark.parametrize(
    ("state", "status", "shown"),
    [(1, 0, "Not Started"), (2, 0, "In Progress"), (3, 999, "NVML error 999")],
)
def test_a_fabric_not_completed_or_failed_fails_that_gpu_alone(
    tmp_path: Path, fake_nvml: Path, state: int, status: int, shown: str
) -> None:
    run = links(tmp_path, fake_nvml, hgx(gpu4={"fabric_state": state, "fabric_status": status}))
    assert bad(run, "gpu.fabric") == {"gpu4": "FabricNotReady"}
    finding = run.finding("gpu.fabric", "gpu4")
    assert finding["device"] == 4 and shown in finding["message"]
    assert run.sample("nodehealth_gpu_fabric_completed", gpu="4") == 0
    assert not bad(links(tmp_path, fake_nvml, hgx()), "gpu.fabric")


def test_fabric_manager_down_fails_every_gpu(tmp_path: Path, fake_nvml: Path) -> None:
    run = links(tmp_path, fake_nvml, hgx(), fabric_manager=False)
    assert bad(run, "gpu.fabric") == {f"gpu{i}": "FabricManagerDown" for i in range(GPUS)}


def test_older_drivers_fabric_calls(tmp_path: Path, fake_nvml: Path) -> None:
    # a driver that knows nvmlGpuFabricInfo_v2 only: ARGUMENT_VERSION_MISMATCH for v3, then v2
    v2 = hgx(**{f"gpu{i}": {"fabric_v_max": 2, "fabric_health_mask": 0x2} for i in range(GPUS)})
    run = links(tmp_path, fake_nvml, v2)
    assert not bad(run, "gpu.fabric") and run.finding("gpu.fabric", "gpu0")["observed"]["health_mask"] == 2
    # a driver without the versioned call (NVML_ERROR_FUNCTION_NOT_FOUND): the older nvmlDeviceGetGpuFabricInfo
    old = hgx(**{f"gpu{i}": {"error": "nvmlDeviceGetGpuFabricInfoV 13"} for i in range(GPUS)})
    old[1]["fabric_state"] = 2  # In Progress
    run = links(tmp_path, fake_nvml, old)
    assert "nvmlDeviceGetGpuFabricInfo" in run.calls
    assert bad(run, "gpu.fabric") == {"gpu1": "FabricNotReady"}
    assert "health_mask" not in run.finding("gpu.fabric", "gpu0")["observed"]


def test_not_supported_is_no_fault(tmp_path: Path, fake_nvml: Path) -> None:
    # PCIe GPUs: NvLink and fabric calls NOT_SUPPORTED on every GPU → both checks not applicable, nothing fails
    pcie = [{} for _ in range(GPUS)]
    run = links(tmp_path, fake_nvml, pcie, fabric_manager=False)
    assert {(f["check"], f["subject"], f["reason"]) for f in run.findings} == {
        ("gpu.nvlink", "", "NotApplicable"),
        ("gpu.fabric", "", "NotApplicable"),
    }
    # one GPU without NVLink beside HGX ones: not applicable to it, not NvlinkDown
    mixed = hgx(gpu7={"nvlinks": 0})
    run = links(tmp_path, fake_nvml, mixed)
    assert bad(run, "gpu.nvlink") == {"gpu7": "NotApplicable"}
    assert run.finding("gpu.nvlink", "gpu7")["status"] == "skip"
    assert run.finding("gpu.nvlink", "gpu6")["status"] == "ok"
    # ...unless the operator said every GPU must have its links
    run = links(tmp_path, fake_nvml, mixed, nvlink_expected_active_links=LINKS)
    assert bad(run, "gpu.nvlink") == {"gpu7": "NvlinkDown"}
    # error counters NOT_SUPPORTED (newer GPUs give them as field values): the states still count, no fault
    counters = hgx(**{f"gpu{i}": {"error": "nvmlDeviceGetNvLinkErrorCounter 3"} for i in range(GPUS)})
    run = links(tmp_path, fake_nvml, counters)
    assert not bad(run, "gpu.nvlink") and run.finding("gpu.nvlink", "gpu0")["observed"]["active_links"] == LINKS


def test_nvml_errors_are_unknown_for_that_gpu_with_the_reason(tmp_path: Path, fake_nvml: Path) -> None:
    gpus = hgx(
        gpu3={"error": "nvmlDeviceGetNvLinkState 999"},  # NVML_ERROR_UNKNOWN
        gpu1={"error": "nvmlDeviceGetGpuFabricInfoV 999"},
        gpu5={"error": "nvmlDeviceGetNvLinkErrorCounter 15"},  # NVML_ERROR_GPU_IS_LOST
        gpu7={"handle_error": 15},
    )
    run = links(tmp_path, fake_nvml, gpus)
    assert bad(run, "gpu.nvlink") == {f"gpu{i}": "GpuLinksUnreadable" for i in (3, 5, 7)}
    assert bad(run, "gpu.fabric") == {f"gpu{i}": "GpuLinksUnreadable" for i in (1, 5, 7)}
    gpu3 = run.finding("gpu.nvlink", "gpu3")
    assert gpu3["status"] == "unknown" and gpu3["device"] == 3
    assert "nvmlDeviceGetNvLinkState(link 0)" in gpu3["message"] and "NVML error 999" in gpu3["message"]
    assert "NVML error 15" in run.finding("gpu.nvlink", "gpu5")["message"]
    assert "nvmlDeviceGetHandleByIndex" in run.finding("gpu.fabric", "gpu7")["message"]
    assert "NVML error 999" in run.finding("gpu.fabric", "gpu1")["message"]
    # the other GPUs are still judged
    assert run.finding("gpu.nvlink", "gpu0")["status"] == "ok" and run.finding("gpu.fabric", "gpu0")["status"] == "ok"


def test_nvml_unavailable_falls_back_to_nvidia_smi_or_is_unknown(tmp_path: Path, fake_nvml: Path) -> None:
    smi = fake_smi(tmp_path, Node())
    run = links(tmp_path, fake_nvml, hgx(), smi=smi, init_error=9)  # NVML_ERROR_DRIVER_NOT_LOADED
    assert not bad(run, "gpu.nvlink") and run.finding("gpu.nvlink", "gpu0")["observed"]["source"] == "nvidia-smi"
    run = links(tmp_path, fake_nvml, hgx(), init_error=9)
    assert {(f["check"], f["reason"]) for f in run.findings} == {
        ("gpu.nvlink", "GpuLinksUnreadable"),
        ("gpu.fabric", "GpuLinksUnreadable"),
    }
    assert all("NVML init failed" in f["message"] and "no nvidia-smi" in f["message"] for f in run.findings)
