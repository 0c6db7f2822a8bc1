"""npu.roce, npu.grade and npu.ecc end to end: a fake `hccn_tool` serving the sourced outputs per chip, a fake
`npu-smi`, /dev/davinciN made with mknod: every reason raised and cleared on the chip it is about, a hung or
missing tool, a node without NPUs."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.fake_hccn_tool import FakeHccn
from support.fake_npu_smi import FakeSmi, context, make_dev, npu_fixture

from probes.base import OBSERVED_DEVICE_MINOR, OBSERVED_PHYSICAL_ID, Finding, Probe, ProbeContext, Sample, Status
from probes.npu.ecc import EccProbe
from probes.npu.grade import GradeProbe
from probes.npu.roce import RoceProbe

pytestmark = pytest.mark.system
CHIPS = 16
# Every read every run, no cap: a fault raised in one run is cleared in the next.
EVERY_RUN: dict[str, Any] = {
    "link_stat_interval_seconds": 0,
    "net_health_interval_seconds": 0,
    "address_interval_seconds": 0,
    "optical_interval_seconds": 0,
    "hccn_max_calls_per_run": 1000,
}


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[FakeHccn, FakeSmi, Path]:
    hccn = FakeHccn(tmp_path / "hccn")
    smi = FakeSmi(tmp_path / "smi")
    monkeypatch.setenv("PATH", f"{hccn.bin}{os.pathsep}{smi.bin}{os.pathsep}{os.environ.get('PATH', '')}")
    dev = make_dev(tmp_path / "dev", {f"davinci{n}": (236, n) for n in range(CHIPS)})
    return hccn, smi, dev


def ctx_for(tmp_path: Path, dev: Path, timeout: float = 30.0, **npu: Any) -> ProbeContext:
    settings = {"state_dir": str(tmp_path / "state"), "hccn_conf": str(tmp_path / "hccn.conf"), **npu}
    return context(tmp_path, settings, dev=dev, timeout=timeout)


def run(probe: Probe, ctx: ProbeContext) -> tuple[dict[tuple[str, str], Finding], list[Sample]]:
    assert probe.applicable(ctx) is None
    findings: dict[tuple[str, str], Finding] = {}
    samples: list[Sample] = []
    for item in probe.run(ctx):
        if isinstance(item, Finding):
            assert item.key not in findings
            assert item.message and "\n" not in item.message
            if item.status in (Status.WARN, Status.FAIL):
                assert item.hint
            findings[item.key] = item
        else:
            samples.append(item)
    return findings, samples


def bad(findings: dict[tuple[str, str], Finding]) -> dict[tuple[str, str], str]:
    return {key: f.reason for key, f in findings.items() if f.status != Status.OK}


def test_a_healthy_16_npu_node(tmp_path: Path, node: tuple[FakeHccn, FakeSmi, Path]) -> None:
    hccn, _smi, dev = node
    findings, samples = run(RoceProbe(), ctx_for(tmp_path, dev))
    assert bad(findings) == {}
    assert len(findings) == 5 * CHIPS
    link = findings[("npu.roce.link", "npu7")]
    assert (link.device, link.observed[OBSERVED_PHYSICAL_ID], link.observed[OBSERVED_DEVICE_MINOR]) == (7, 7, 7)
    assert {c.split()[1] for c in hccn.calls()} == {str(n) for n in range(CHIPS)}
    up = [s for s in samples if s.name == "nodehealth_npu_link_up"]
    assert len(up) == CHIPS and all(s.value == 1 for s in up) and up[0].labels["id"] == "0"


@pytest.mark.parametrize(
    ("verb", "response", "check", "reason", "status"),
    [
        ("link", {"file": "link-down-hccn_tool-go.txt"}, "npu.roce.link", "NpuLinkDown", Status.FAIL),
        ("net_health", {"file": "net_health-fault-doc.txt"}, "npu.roce.net_health", "NpuNetUnhealthy", Status.FAIL),
        (
            "net_health",
            {"file": "net_health-socket-failed-faultdiag.txt"},
            "npu.roce.net_health",
            "NpuNetUnhealthy",
            Status.FAIL,
        ),
        ("net_health", {"file": "net_health-init-doc.txt"}, "npu.roce.net_health", "NpuNetHealthInit", Status.UNKNOWN),
        (
            "optical",
            {"file": "optical-not-present-rx-los-faultdiag.txt"},
            "npu.roce.optical",
            "NpuOpticalAbsent",
            Status.FAIL,
        ),
        (
            "optical",
            {"file": "optical-present-rx-los-DERIVED.txt"},
            "npu.roce.optical",
            "NpuOpticalSignalLost",
            Status.FAIL,
        ),
        ("ip", {"file": "ip-empty-faultdiag.txt"}, "npu.roce.address", "NpuAddressMissing", Status.FAIL),
        ("link", {"file": "unparseable.txt"}, "npu.roce.link", "ParseError", Status.UNKNOWN),
        ("optical", {"file": "unparseable.txt"}, "npu.roce.optical", "ParseError", Status.UNKNOWN),
        ("link", {"stdout": "", "rc": 1}, "npu.roce.link", "HccnToolFailed", Status.UNKNOWN),
    ],
)
def test_each_fault_is_raised_on_its_chip_and_cleared(
    tmp_path: Path,
    node: tuple[FakeHccn, FakeSmi, Path],
    verb: str,
    response: dict[str, Any],
    check: str,
    reason: str,
    status: Status,
) -> None:
    hccn, _smi, dev = node
    probe = RoceProbe()
    ctx = ctx_for(tmp_path, dev, **EVERY_RUN)
    hccn.serve({5: {verb: response}})
    findings, _ = run(probe, ctx)
    assert bad(findings) == {(check, "npu5"): reason}
    finding = findings[(check, "npu5")]
    assert finding.status == status and finding.device == 5 and finding.observed[OBSERVED_PHYSICAL_ID] == 5
    hccn.serve({})
    findings, _ = run(probe, ctx_for(tmp_path, dev, **EVERY_RUN))
    assert bad(findings) == {}


def test_optical_power_and_temperature_thresholds(tmp_path: Path, node: tuple[FakeHccn, FakeSmi, Path]) -> None:
    _hccn, _smi, dev = node
    findings, _ = run(RoceProbe(), ctx_for(tmp_path, dev, optical_rx_power_min_mw=0.995))
    optical = findings[("npu.roce.optical", "npu0")]
    assert (optical.reason, optical.status) == ("NpuOpticalPower", Status.FAIL)
    assert "RX power lane 1 0.9907 mW below 0.995 mW" in optical.message
    findings, _ = run(RoceProbe(), ctx_for(tmp_path, dev, optical_rx_power_min_mw=0.95))
    assert findings[("npu.roce.optical", "npu0")].status == Status.WARN  # within 10% of the floor
    findings, _ = run(RoceProbe(), ctx_for(tmp_path, dev, optical_temperature_max_celsius=45))
    assert findings[("npu.roce.optical", "npu3")].reason == "NpuOpticalHot"  # 47 C


def test_optics_are_read_on_their_slower_interval(tmp_path: Path, node: tuple[FakeHccn, FakeSmi, Path]) -> None:
    hccn, _smi, dev = node
    probe = RoceProbe()
    run(probe, ctx_for(tmp_path, dev))
    assert sum("-optical" in c for c in hccn.calls()) == CHIPS
    hccn.serve({2: {"optical": {"file": "optical-present-rx-los-DERIVED.txt"}}})
    findings, _ = run(probe, ctx_for(tmp_path, dev))  # within optical_interval_seconds: not read again
    assert not any("-optical" in c for c in hccn.calls())
    assert findings[("npu.roce.optical", "npu2")].status == Status.OK
    findings, _ = run(probe, ctx_for(tmp_path, dev, optical_interval_seconds=0.001))
    assert findings[("npu.roce.optical", "npu2")].reason == "NpuOpticalSignalLost"


def test_the_calls_of_a_run_are_capped_once_everything_was_read(
    tmp_path: Path, node: tuple[FakeHccn, FakeSmi, Path]
) -> None:
    hccn, _smi, dev = node
    probe = RoceProbe()
    settings = {**EVERY_RUN, "hccn_max_calls_per_run": 32}
    run(probe, ctx_for(tmp_path, dev, **settings))
    assert len(hccn.calls()) == 6 * CHIPS == probe.spawned  # the first run reads everything once
    hccn.serve({})
    run(probe, ctx_for(tmp_path, dev, **settings))
    calls = hccn.calls()
    assert len(calls) == 32 == probe.spawned
    assert sum(c.endswith("-link -g") for c in calls) == CHIPS  # link of every chip, then the most overdue
    hccn.serve({})
    findings, _ = run(probe, ctx_for(tmp_path, dev))  # default intervals: nothing else is due yet
    assert len(hccn.calls()) == CHIPS and len(findings) == 5 * CHIPS


def test_flapping_survives_a_restart_and_a_driver_reload_is_not_a_burst(
    tmp_path: Path, node: tuple[FakeHccn, FakeSmi, Path]
) -> None:
    hccn, _smi, dev = node
    hccn.serve({4: {"link_stat": {"file": "link_stat-devid-faultdiag.txt", "count": 2}}})
    run(RoceProbe(), ctx_for(tmp_path, dev))
    hccn.serve({4: {"link_stat": {"file": "link_stat-flapping-DERIVED.txt"}}})  # 2 → 9
    findings, samples = run(RoceProbe(), ctx_for(tmp_path, dev))  # a new probe: the agent restarted
    flaps = findings[("npu.roce.flaps", "npu4")]
    assert (flaps.reason, flaps.device, flaps.observed["increase"]) == ("NpuLinkFlapping", 4, 7)
    assert bad(findings) == {("npu.roce.flaps", "npu4"): "NpuLinkFlapping"}
    assert [s.value for s in samples if s.name == "nodehealth_npu_link_flaps" and s.labels["id"] == "4"] == [7]
    hccn.serve({4: {"link_stat": {"file": "link_stat-devid-faultdiag.txt", "count": 1}}})  # driver reload
    findings, _ = run(RoceProbe(), ctx_for(tmp_path, dev))
    assert findings[("npu.roce.flaps", "npu4")].status == Status.OK
    assert findings[("npu.roce.flaps", "npu4")].observed["counter_reset"] is True


def test_addresses_against_hccn_conf(tmp_path: Path, node: tuple[FakeHccn, FakeSmi, Path]) -> None:
    _hccn, _smi, dev = node
    lines = [f"address_{n}=192.161.200.10\nnetmask_{n}=255.255.255.0\ngateway_{n}=192.161.200.1" for n in range(16)]
    (tmp_path / "hccn.conf").write_text("\n".join(lines).replace("address_6=192.161.200.10", "address_6=10.0.0.6"))
    findings, _ = run(RoceProbe(), ctx_for(tmp_path, dev))
    assert bad(findings) == {("npu.roce.address", "npu6"): "NpuAddressMismatch"}
    assert "address 192.161.200.10 (hccn.conf: 10.0.0.6)" in findings[("npu.roce.address", "npu6")].message


def test_no_hccn_tool_and_no_npus(tmp_path: Path, node: tuple[FakeHccn, FakeSmi, Path]) -> None:
    hccn, _smi, dev = node
    hccn.tool.unlink()
    findings, _ = run(RoceProbe(), ctx_for(tmp_path, dev))
    assert {f.reason for f in findings.values()} == {"HccnToolMissing"}
    assert all(f.status == Status.UNKNOWN for f in findings.values())
    empty = tmp_path / "nodev"
    empty.mkdir()
    assert "no NPUs" in (RoceProbe().applicable(ctx_for(tmp_path, empty)) or "")
    assert "no NPUs" in (GradeProbe().applicable(ctx_for(tmp_path, empty)) or "")
    assert "no NPUs" in (EccProbe().applicable(ctx_for(tmp_path, empty)) or "")


def test_a_hung_hccn_tool_costs_its_deadline_once_and_holds_nothing_else(
    tmp_path: Path, node: tuple[FakeHccn, FakeSmi, Path]
) -> None:
    hccn, _smi, dev = node
    hccn.serve({}, default={verb: {"sleep": 60} for verb in ("link", "link_stat", "net_health", "optical", "ip")})
    ticks: list[float] = []
    stop = threading.Event()

    def other_probe() -> None:  # a probe running meanwhile must keep its pace
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.05)

    beside = threading.Thread(target=other_probe)
    beside.start()
    started = time.monotonic()
    try:
        findings, _ = run(RoceProbe(), ctx_for(tmp_path, dev, timeout=20.0, hccn_timeout_seconds=1.0, hccn_parallel=4))
    finally:
        stop.set()
        beside.join()
    elapsed = time.monotonic() - started
    assert elapsed < 15.0, "4 workers x 1 s deadline, then nothing more asked (not 80 calls x 1 s)"
    assert {f.reason for f in findings.values()} == {"HccnToolFailed"}
    assert sum(1 for c in hccn.calls()) <= 4 + 4  # at most one deadline per worker, then the rest skipped
    assert len(ticks) >= elapsed / 0.05 * 0.3


# --- grade and ecc -----------------------------------------------------------------------------------


def smi_for(smi: FakeSmi, health: dict[int, str], ecc: dict[int, str] | None = None) -> None:
    ok = npu_fixture("910a-t-health-OK-i0-c0-faultdiag.txt").read_text()
    zero = npu_fixture("910a-t-ecc-i1-ddr-and-hbm-docexample-mindcluster.txt").read_text()
    responses: dict[str, dict[str, Any]] = {"info -m": {"stdout": mapping()}}
    for n in range(CHIPS):
        responses[f"info -t health -i {n} -c 0"] = {"stdout": health.get(n, ok)}
        responses[f"info -t ecc -i {n} -c 0"] = {"stdout": (ecc or {}).get(n, zero)}
    smi.answer(responses)


def mapping() -> str:
    rows = "".join(f"{n:<31}0{'':<30}{n:<31}Ascend 910B\n" for n in range(CHIPS))
    return f"{'NPU ID':<31}{'Chip ID':<31}{'Chip Logic ID':<31}Chip Name\n" + rows


def health_with(word: str, codes: str) -> str:
    return (
        f"\tHealth Status                  : {word}\n\tError Code                     : {codes}\n"
        "\tError Information              : NA\n"
    )


@pytest.mark.parametrize(
    ("codes", "reason", "status", "level"),
    [
        ("80E18402", "NpuFaultSeparate", Status.FAIL, "SeparateNPU"),
        ("8118043C", "NpuFaultSeparate", Status.FAIL, "PreSeparateNPU"),
        ("80CB8009", "NpuFaultReset", Status.FAIL, "RestartRequest"),
        ("8C03A000", "NpuFaultReset", Status.FAIL, "RestartNPU"),
        ("80E21007", "NpuFaultMinor", Status.WARN, "NotHandleFault"),
        ("81A3880C", "NpuFaultMinor", Status.WARN, "SubHealthFault"),
    ],
)
def test_grades_from_the_builtin_table(
    tmp_path: Path, node: tuple[FakeHccn, FakeSmi, Path], codes: str, reason: str, status: Status, level: str
) -> None:
    _hccn, smi, dev = node
    smi_for(smi, {9: health_with("OK", codes)})
    probe = GradeProbe()
    ctx = ctx_for(tmp_path, dev, fault_code_files=[str(tmp_path / "none.json")])
    findings, _ = run(probe, ctx)
    assert bad(findings) == {("npu.grade", "npu9"): reason}
    finding = findings[("npu.grade", "npu9")]
    assert finding.status == status and finding.device == 9 and finding.observed[OBSERVED_PHYSICAL_ID] == 9
    assert codes in finding.message and level in finding.message and "mind-cluster" in finding.message
    smi_for(smi, {})
    assert bad(run(probe, ctx)[0]) == {}


def test_grades_from_a_fault_code_file_and_a_malformed_one(
    tmp_path: Path, node: tuple[FakeHccn, FakeSmi, Path]
) -> None:
    _hccn, smi, dev = node
    smi_for(smi, {1: health_with("Warning", "80E21007")})
    path = tmp_path / "faultCode.json"
    path.write_text(json.dumps({"SeparateNPUCodes": ["80E21007"]}))
    findings, _ = run(GradeProbe(), ctx_for(tmp_path, dev, fault_code_files=[str(path)]))
    assert findings[("npu.grade", "npu1")].reason == "NpuFaultSeparate"
    assert str(path) in findings[("npu.grade", "npu1")].message
    path.write_text("{broken")
    findings, _ = run(GradeProbe(), ctx_for(tmp_path, dev, fault_code_files=[str(path)]))
    assert [(f.reason, f.status) for f in findings.values()] == [("NpuFaultCodesInvalid", Status.UNKNOWN)]
    assert str(path) in findings[("npu.grade", "")].message


def test_hbm_ecc(tmp_path: Path, node: tuple[FakeHccn, FakeSmi, Path]) -> None:
    _hccn, smi, dev = node
    zero = npu_fixture("910a-t-ecc-i1-ddr-and-hbm-docexample-mindcluster.txt").read_text()
    double = zero.replace(
        "HBM Double Bit Error Count               : 0", "HBM Double Bit Error Count               : 2"
    )
    isolated = zero.replace(
        "HBM Single Bit Isolated Pages Count      : 0", "HBM Single Bit Isolated Pages Count      : 40"
    )
    pending = (
        npu_fixture("950-docexample-t-ecc-i0.txt")
        .read_text()
        .replace("HBM Single Bit Next-Isolated Pages Count : 0", "HBM Single Bit Next-Isolated Pages Count : 1")
    )
    smi_for(smi, {}, {3: double, 4: isolated, 5: pending})
    probe = EccProbe()
    ctx = ctx_for(tmp_path, dev)
    findings, samples = run(probe, ctx)
    assert bad(findings) == {
        ("npu.ecc", "npu3"): "NpuEccDoubleBit",
        ("npu.ecc", "npu4"): "NpuEccIsolatedPages",
        ("npu.ecc", "npu5"): "NpuEccPendingPages",
    }
    assert findings[("npu.ecc", "npu4")].status == Status.WARN
    assert [
        s.value for s in samples if s.name == "nodehealth_npu_hbm_ecc_double_bit_errors" and s.labels["id"] == "3"
    ] == [2]
    rising = zero.replace(
        "HBM Single Bit Error Count               : 0", "HBM Single Bit Error Count               : 500"
    )
    smi_for(smi, {}, {6: rising})
    findings, _ = run(probe, ctx)
    assert bad(findings) == {("npu.ecc", "npu6"): "NpuEccSingleBitRate"}
