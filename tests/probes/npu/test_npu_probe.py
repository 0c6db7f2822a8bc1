"""The npu probe end to end: a fake `npu-smi` on PATH answering from captured outputs (every layout, failures,
health details, HBM), device nodes made with mknod in a temp dev dir, and the CLI. Holders: test_npu_holders.py."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from support.fake_npu_smi import FakeSmi, context, make_dev, npu_fixture, run_probe, sample, table
from support.system import REPO, require_root, require_tool

from probes.base import (
    OBSERVED_DEVICE_MINOR,
    OBSERVED_HBM_FREE_MIB,
    OBSERVED_PCI_BUS_ID,
    OBSERVED_PHYSICAL_ID,
    Status,
)
from probes.npu.npu import NpuProbe
from probes.runtime.host import Host


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSmi:
    smi = FakeSmi(tmp_path / "fake")
    monkeypatch.setenv("PATH", f"{smi.bin}{os.pathsep}{os.environ.get('PATH', '')}")
    return smi


# --- tables ---------------------------------------------------------------------------------------


def test_a3_table_through_npu_smi_on_path(tmp_path: Path, fake: FakeSmi) -> None:
    fake.answer({"info": table("a3-910_93-2card-4chip-1proc-info-25.2.0.txt")})  # -m: usage error
    findings, samples = run_probe(context(tmp_path))
    smi = findings[("npu.smi", "")]
    assert smi.status == Status.OK and "4 chips on 2 cards" in smi.message
    assert "info -m" in smi.observed["mapping_error"]  # a failed detail query is noted, not fatal
    for chip in range(4):
        health = findings[("npu.health", f"npu{chip}")]
        assert (health.status, health.device, health.observed["physical_id"]) == (Status.OK, chip, chip)
    hbm = findings[("npu.hbm", "npu3")]
    assert (hbm.status, hbm.device, hbm.observed[OBSERVED_HBM_FREE_MIB]) == (Status.OK, 3, 65536 - 10568)
    assert findings[("npu.hbm", "npu0")].observed[OBSERVED_HBM_FREE_MIB] == 65536 - 3133
    assert sample(samples, "nodehealth_npu_hbm_used_bytes", 3) == 10568 * 1024 * 1024
    assert sample(samples, "nodehealth_npu_hbm_total_bytes", 0) == 65536 * 1024 * 1024
    assert sample(samples, "nodehealth_npu_processes", 3) == 1
    assert sample(samples, "nodehealth_npu_power_watts", 0) == 162.8
    assert sample(samples, "nodehealth_npu_power_watts", 1) is None  # die 1 prints "-"
    assert sample(samples, "nodehealth_npu_temperature_celsius", 2) == 38
    assert sample(samples, "nodehealth_npu_health", 1) == 0
    labels = next(s.labels for s in samples if s.name == "nodehealth_npu_health" and s.labels["chip"] == "3")
    assert labels == {"chip": "3", "card": "1", "name": "Ascend910", "pci_bus_id": "0000:39:00.0", "id": "3"} | {
        "pod": "",
        "namespace": "",
        "container": "",
    }
    assert fake.calls() == ["info", "info -m"]


def test_every_chip_finding_carries_the_ids_the_cluster_knows_it_by(tmp_path: Path, fake: FakeSmi) -> None:
    """The A3 table prints Phy-ID: physical id, Bus-Id and /dev/davinciN on every finding about a chip (what a DRA
    slice's physicId and a public fault's deviceIds are); node-wide findings carry none."""
    fake.answer({"info": table("a3-910_93-2card-4chip-1proc-info-25.2.0.txt")})
    findings, _ = run_probe(context(tmp_path))
    buses = ["0000:9C:00.0", "0000:9E:00.0", "0000:37:00.0", "0000:39:00.0"]
    for chip in range(4):
        for check in ("npu.health", "npu.hbm"):
            observed = findings[(check, f"npu{chip}")].observed
            ids = (observed[OBSERVED_PHYSICAL_ID], observed[OBSERVED_PCI_BUS_ID], observed[OBSERVED_DEVICE_MINOR])
            assert ids == (chip, buses[chip], chip), (check, chip)
    assert OBSERVED_PHYSICAL_ID not in findings[("npu.smi", "")].observed


def test_mapping_gives_logical_ids_and_is_kept_between_runs(tmp_path: Path, fake: FakeSmi) -> None:
    fake.answer(
        {
            "info": table("910a-atlas800-9010-8card-healthy-info-22.0.3.1.txt"),
            "info -m": table("910a-atlas800-9010-8card-m-mapping-22.0.3.1.txt"),
        }
    )
    probe = NpuProbe()
    findings, _ = run_probe(context(tmp_path), probe)
    assert "mapping_error" not in findings[("npu.smi", "")].observed
    assert [findings[("npu.health", f"npu{i}")].observed["card"] for i in range(8)] == list(range(8))
    run_probe(context(tmp_path), probe)
    assert fake.calls() == ["info", "info -m", "info"]


def test_device_memory_of_310p_is_its_ddr(tmp_path: Path, fake: FakeSmi) -> None:
    fake.answer({"info": table("310p3-duo-1card-2chip-cardid1792-info-24.1.rc2.txt")})
    findings, samples = run_probe(context(tmp_path))
    assert fake.calls() == ["info"]  # the Device column has the logical ids: no -m
    hbm = findings[("npu.hbm", "npu1")]
    assert hbm.observed["memory"] == "ddr" and hbm.observed[OBSERVED_HBM_FREE_MIB] == 43693 - 1041
    assert findings[("npu.health", "npu1")].observed["card"] == 1792
    assert sample(samples, "nodehealth_npu_memory_used_bytes", 0) == 1821 * 1024 * 1024
    assert sample(samples, "nodehealth_npu_hbm_used_bytes", 0) is None


# --- npu-smi failures -----------------------------------------------------------------------------


def test_8020_says_the_device_is_held_elsewhere(tmp_path: Path, fake: FakeSmi) -> None:
    text = "dcmi model initialized failed, because the device is used. ret is -8020\n"
    fake.answer({"info": {"stdout": text, "rc": 255}})
    findings, _ = run_probe(context(tmp_path))
    smi = findings[("npu.smi", "")]
    assert (smi.status, smi.reason, smi.observed["ret"]) == (Status.FAIL, "NpuSmiFailed", -8020)
    assert "held by another container or process" in smi.message
    assert findings[("npu.health", "")].status == Status.UNKNOWN
    assert findings[("npu.hbm", "")].status == Status.UNKNOWN


def test_8005_dcmi_initialisation_failure(tmp_path: Path, fake: FakeSmi) -> None:
    fixture = npu_fixture("error-dcmi-init-failed-8005-in-container-vllm-ascend-issue2698.txt")
    fake.answer({"info": {"stdout_file": str(fixture), "rc": 1}})
    findings, _ = run_probe(context(tmp_path))
    smi = findings[("npu.smi", "")]
    assert (smi.status, smi.reason, smi.observed["ret"]) == (Status.FAIL, "NpuSmiFailed", -8005)
    assert "dcmi module initialize failed" in smi.message


def _fake_processes(spec: Path) -> list[int]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if str(spec) in " ".join(process.info["cmdline"] or ()):
                found.append(process.pid)
    return found


def test_hung_npu_smi_is_killed_at_its_deadline(tmp_path: Path, fake: FakeSmi) -> None:
    fake.answer({"info": {"sleep": 30}})
    started = time.monotonic()
    findings, _ = run_probe(context(tmp_path, {"smi_timeout_seconds": 1.0}))
    assert time.monotonic() - started < 6
    smi = findings[("npu.smi", "")]
    assert (smi.status, smi.reason, smi.observed["failure"]) == (Status.FAIL, "NpuSmiFailed", "timeout")
    assert _fake_processes(fake.spec) == []  # the whole process group went


def test_no_npu_smi_on_path_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert NpuProbe().applicable(context(tmp_path)) == "no npu-smi on this host"


@pytest.mark.system
def test_nsenter_prefix_without_npu_smi_on_the_host(tmp_path: Path) -> None:
    nsenter = require_tool("nsenter")
    argv = [nsenter, "--", "npu-smi-not-installed-here"]
    # No npu-smi and no /dev/davinci*: skip before running anything.
    assert NpuProbe().applicable(context(tmp_path, {"smi_command": argv})) == "no npu-smi on this host"
    # With a davinci node the probe runs; nsenter's exit status 127 means "not installed": the chips are unknown.
    dev = make_dev(tmp_path / "dev", {"davinci0": (240, 0)})
    findings, _ = run_probe(context(tmp_path, {"smi_command": argv}, dev=dev))
    smi = findings[("npu.smi", "")]
    assert (smi.status, smi.reason) == (Status.UNKNOWN, "NpuToolMissing")


@pytest.mark.system
def test_davinci_nodes_without_npu_smi_anywhere_are_unknown_not_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The field variant: /dev/davinci0-7 present, npu-smi nowhere (not on PATH, not in the host's bin
    directories, not in the driver's tools directory): every chip check is unknown, npu.holders still runs."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    dev = make_dev(tmp_path / "dev", {f"davinci{n}": (240, n) for n in range(8)})
    ctx = context(tmp_path, dev=dev)
    assert NpuProbe().applicable(ctx) is None
    findings, _ = run_probe(ctx)
    for check in ("npu.smi", "npu.health", "npu.hbm"):
        missing = findings[(check, "")]
        assert (missing.status, missing.reason) == (Status.UNKNOWN, "NpuToolMissing"), missing
        assert "8 /dev/davinciN nodes (davinci0…davinci7) but no npu-smi" in missing.message
        assert "/usr/local/Ascend/driver/tools" in missing.message
        assert "install the Ascend driver's tools" in missing.hint and "npu.smi_command" in missing.hint
    assert not any(f.reason == "NpuMissing" for f in findings.values())
    assert findings[("npu.holders", "npu0")].status == Status.OK  # the fd scan ran without npu-smi
    # No davinci node: no NPU here, the probe skips.
    (tmp_path / "other").mkdir()
    assert NpuProbe().applicable(context(tmp_path / "other")) == "no npu-smi on this host"


@pytest.mark.system
def test_npu_smi_only_in_the_drivers_tools_directory_is_named_in_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    root = tmp_path / "host"
    tools = root / "usr/local/Ascend/driver/tools"
    tools.mkdir(parents=True)
    (tools / "npu-smi").write_text("#!/bin/sh\nexit 0\n")
    (tools / "npu-smi").chmod(0o755)
    dev = make_dev(tmp_path / "dev", {"davinci0": (240, 0)})
    ctx = context(tmp_path, dev=dev)
    ctx = type(ctx)(Host(proc=ctx.host.proc, dev=dev, root=root), ctx.config, 10.0)
    findings, _ = run_probe(ctx)
    smi = findings[("npu.smi", "")]
    assert (smi.status, smi.reason) == (Status.UNKNOWN, "NpuToolMissing")
    assert smi.observed["found_elsewhere"] == ["/usr/local/Ascend/driver/tools/npu-smi"]
    assert f"under host.root {root}" in smi.message
    assert smi.hint.startswith("point npu.smi_command at it, e.g. [nsenter, -t, 1, -m, --, ")
    assert "/usr/local/Ascend/driver/tools/npu-smi]" in smi.hint


@pytest.mark.system
def test_permission_denied_on_exec(tmp_path: Path) -> None:
    require_root()
    binary = tmp_path / "npu-smi"
    binary.write_text("#!/bin/sh\necho never\n")
    binary.chmod(0o644)  # no execute bit at all: even root gets EACCES
    findings, _ = run_probe(context(tmp_path, {"smi_command": [str(binary)]}))
    smi = findings[("npu.smi", "")]
    assert (smi.status, smi.reason, smi.observed["failure"]) == (Status.FAIL, "NpuSmiFailed", "permission_denied")


def test_unreadable_table_is_unknown_not_a_crash(tmp_path: Path, fake: FakeSmi) -> None:
    garbled = npu_fixture("910b1-8card-healthy-1proc-info-24.1.0.txt").read_text().replace("| OK ", "| O|K", 1)
    fake.answer({"info": {"stdout": garbled}})
    findings, _ = run_probe(context(tmp_path))
    smi = findings[("npu.smi", "")]
    assert (smi.status, smi.reason) == (Status.UNKNOWN, "ParseError")


# --- health ---------------------------------------------------------------------------------------

ALARM_TABLE = "310b4-devkit-ALARM-noproc-info-23.0.0.txt"
ALARM_DETAIL = "910a-t-health-ALARM-errorcodes-heartbeat-lost-i0-c0-faultdiag.txt"


def test_alarm_with_error_codes(tmp_path: Path, fake: FakeSmi) -> None:
    fake.answer({"info": table(ALARM_TABLE), "info -t health -i 0 -c 0": table(ALARM_DETAIL)})
    findings, samples = run_probe(context(tmp_path))
    health = findings[("npu.health", "npu0")]
    assert (health.status, health.reason, health.device) == (Status.FAIL, "NpuHealthAlarm", 0)
    assert "A4025021 8C03A000 8C084E00" in health.message and "heart beat lost" in health.message
    assert health.observed["error_codes"] == ["A4025021", "8C03A000", "8C084E00"]
    assert len(health.observed["error_information"]) == 3
    assert "npu-smi set -t reset -i 0 -c 0" in health.hint
    assert sample(samples, "nodehealth_npu_health", 0) == 2


def test_alarm_status_is_configurable(tmp_path: Path, fake: FakeSmi) -> None:
    fake.answer({"info": table(ALARM_TABLE), "info -t health -i 0 -c 0": table(ALARM_DETAIL)})
    status_map = {"OK": "ok", "Warning": "warn", "Alarm": "warn", "Critical": "fail"}
    findings, _ = run_probe(context(tmp_path, {"health_status": status_map}))
    assert (findings[("npu.health", "npu0")].status, findings[("npu.health", "npu0")].reason) == (
        Status.WARN,
        "NpuHealthAlarm",
    )


def test_failed_health_detail_leaves_the_table_standing(tmp_path: Path, fake: FakeSmi) -> None:
    unsupported = {"stdout": "This device does not support querying health.\n", "rc": 255}
    fake.answer({"info": table(ALARM_TABLE), "info -t health -i 0 -c 0": unsupported})
    findings, _ = run_probe(context(tmp_path))
    health = findings[("npu.health", "npu0")]
    assert (health.status, health.reason) == (Status.FAIL, "NpuHealthAlarm")
    assert "not supported" in health.observed["health_detail_error"]
    assert findings[("npu.smi", "")].status == Status.OK


def test_warning_and_critical(tmp_path: Path, fake: FakeSmi) -> None:
    text = npu_fixture("910b1-8card-healthy-1proc-info-24.1.0.txt").read_text()
    text = text.replace("| 1     910B1               | OK     ", "| 1     910B1               | Warning")
    text = text.replace("| 2     910B1               | OK      ", "| 2     910B1               | Critical")
    fake.answer({"info": {"stdout": text}})
    findings, samples = run_probe(context(tmp_path))
    assert (findings[("npu.health", "npu1")].status, findings[("npu.health", "npu1")].reason) == (
        Status.WARN,
        "NpuHealthWarning",
    )
    assert (findings[("npu.health", "npu2")].status, findings[("npu.health", "npu2")].reason) == (
        Status.FAIL,
        "NpuHealthCritical",
    )
    assert "info -t health -i 1 -c 0" in fake.calls() and "info -t health -i 2 -c 0" in fake.calls()
    assert [sample(samples, "nodehealth_npu_health", i) for i in range(3)] == [0, 1, 3]


def test_950_detail_query_has_no_chip_flag(tmp_path: Path, fake: FakeSmi) -> None:
    text = npu_fixture("950-docexample-info-1card.txt").read_text().replace("| OK            |", "| Alarm         |")
    fake.answer({"info": {"stdout": text}, "info -t health -i 0": table("950-docexample-t-health-i0.txt")})
    findings, _ = run_probe(context(tmp_path))
    assert "info -t health -i 0" in fake.calls()
    assert findings[("npu.health", "npu0")].observed["error_codes"] == []


@pytest.mark.system
def test_chip_with_a_davinci_node_but_not_listed_is_missing(tmp_path: Path, fake: FakeSmi) -> None:
    fake.answer({"info": table("910b1-8card-healthy-1proc-info-24.1.0.txt")})
    dev = make_dev(tmp_path / "dev", {f"davinci{n}": (240, n) for n in range(9)})
    findings, _ = run_probe(context(tmp_path, dev=dev))
    missing = findings[("npu.health", "npu8")]
    assert (missing.status, missing.reason, missing.device) == (Status.FAIL, "NpuMissing", 8)
    assert findings[("npu.health", "npu7")].status == Status.OK
    assert findings[("npu.health", "")].status == Status.OK
    findings, _ = run_probe(context(tmp_path, {"expected_chips": 10}, dev=dev))
    node = findings[("npu.health", "")]
    assert (node.status, node.reason, node.observed["expected_chips"]) == (Status.FAIL, "NpuMissing", 10)


def _cut_after_chip(name: str, chip: int, rows: int = 3) -> str:
    """A captured table up to chip `chip`'s two rows and, with rows=3, its border: as npu-smi leaves it when it
    is killed, or its output is lost, part-way."""
    lines = npu_fixture(name).read_text().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.startswith(f"| {chip}     "))
    return "".join(lines[: first + rows])


@pytest.mark.system
def test_a_table_cut_in_its_process_section_tells_its_chips(tmp_path: Path, fake: FakeSmi) -> None:
    """The chip section is complete and closed, the output cut after the process header (and after the first
    process row): every chip's health and HBM are told; the processes the cut took are unknown, said by npu.smi,
    and no chip is called leaked for want of them (each uses 3.4 GiB with a 1 GiB leak threshold)."""
    lines = npu_fixture("910b1-8card-healthy-1proc-info-24.1.0.txt").read_text().splitlines(keepends=True)
    header = next(i for i, line in enumerate(lines) if "Process id" in line)
    dev = make_dev(tmp_path / "dev", {f"davinci{n}": (240, n) for n in range(8)})
    for end in (header + 1, header + 3):
        fake.answer({"info": {"stdout": "".join(lines[:end])}})
        findings, _ = run_probe(context(tmp_path, {"hbm_leak_min_mib": 1000}, dev=dev))
        smi = findings[("npu.smi", "")]
        assert smi.status is Status.OK and "in its process section" in smi.message, smi
        assert "the processes of NPU 0, 1, 2, 3, 4, 5, 6, 7 are unknown" in smi.observed["processes_cut"]
        for chip in range(8):
            assert findings[("npu.health", f"npu{chip}")].status is Status.OK
            hbm = findings[("npu.hbm", f"npu{chip}")]
            assert hbm.status is Status.OK and hbm.observed["used_mib"] > 3000, hbm
        assert not any(f.reason in ("NpuTableTruncated", "NpuMissing") for f in findings.values())
    # The same table whole: the chips with no process and 3.4 GiB in use are leaks at that threshold.
    fake.answer({"info": table("910b1-8card-healthy-1proc-info-24.1.0.txt")})
    findings, _ = run_probe(context(tmp_path, {"hbm_leak_min_mib": 1000}, dev=dev))
    assert findings[("npu.hbm", "npu1")].reason == "NpuHbmLeaked"


@pytest.mark.system
def test_a_table_cut_short_is_a_tool_problem_never_missing_chips(tmp_path: Path, fake: FakeSmi) -> None:
    """The field variant: `npu-smi info` printed four of the eight chips. The chips it left out did not fall off
    the bus: nothing is judged from the table, and the fix is about the tool, not the card."""
    cut = _cut_after_chip("910b1-8card-healthy-1proc-info-24.1.0.txt", 3)
    dev = make_dev(tmp_path / "dev", {f"davinci{n}": (240, n) for n in range(8)})
    fake.answer({"info": {"stdout": cut}, "info -l": table("910b-l-list-8card-25.5.1-yunion-telegraf.txt")})
    findings, _ = run_probe(context(tmp_path, dev=dev))
    assert "info -l" in fake.calls()
    for check in ("npu.smi", "npu.health", "npu.hbm"):
        truncated = findings[(check, "")]
        assert (truncated.status, truncated.reason) == (Status.UNKNOWN, "NpuTableTruncated"), truncated
        assert "`npu-smi info -l` counts 8 NPUs (8 chips), the table lists 4 NPUs (4 chips)" in truncated.message
        assert "/dev/davinci4, /dev/davinci5, /dev/davinci6, /dev/davinci7 not judged" in truncated.message
        assert "not a card problem" in truncated.hint and "reseat" not in truncated.hint
    assert not any(f.reason == "NpuMissing" for f in findings.values())
    assert not any(f.subject.startswith("npu") for f in findings.values() if f.check in ("npu.health", "npu.hbm"))

    # Cut inside a chip's rows (the table ends in a row): told from the table itself, without asking -l.
    fake.answer({"info": {"stdout": _cut_after_chip("910b1-8card-healthy-1proc-info-24.1.0.txt", 3, rows=2)}})
    findings, _ = run_probe(context(tmp_path, dev=dev))
    smi = findings[("npu.smi", "")]
    assert (smi.status, smi.reason) == (Status.UNKNOWN, "NpuTableTruncated")
    assert "the table ends in a row, without its closing border, before its process section" in smi.message
    assert fake.calls() == ["info"]

    # -l cannot count and the table has no process section to show it is whole: still not known, not missing.
    fake.answer({"info": {"stdout": cut}})
    findings, _ = run_probe(context(tmp_path, dev=dev))
    health = findings[("npu.health", "")]
    assert (health.status, health.reason) == (Status.UNKNOWN, "NpuTableTruncated")
    assert "its process section is absent, and `npu-smi info -l` could not count them" in health.message

    # Chips expected by npu.expected_chips (no davinci node visible): the same.
    fake.answer({"info": {"stdout": cut}, "info -l": table("910b-l-list-8card-25.5.1-yunion-telegraf.txt")})
    findings, _ = run_probe(context(tmp_path, {"expected_chips": 8}))
    assert findings[("npu.health", "")].reason == "NpuTableTruncated"


@pytest.mark.system
def test_a_whole_table_that_misses_a_chip_the_driver_counts_the_same_is_npu_missing(
    tmp_path: Path, fake: FakeSmi
) -> None:
    fake.answer(
        {
            "info": table("910b1-8card-healthy-1proc-info-24.1.0.txt"),
            "info -l": table("910b-l-list-8card-25.5.1-yunion-telegraf.txt"),
        }
    )
    dev = make_dev(tmp_path / "dev", {f"davinci{n}": (240, n) for n in range(9)})
    findings, _ = run_probe(context(tmp_path, dev=dev))
    missing = findings[("npu.health", "npu8")]
    assert (missing.status, missing.reason) == (Status.FAIL, "NpuMissing")
    assert "fell off the bus" in missing.hint


# --- hbm ------------------------------------------------------------------------------------------


def test_hbm_low_and_leaked(tmp_path: Path, fake: FakeSmi) -> None:
    fake.answer({"info": table("910b2c-2card-1proc-info-23.0.2.1-trailing-spaces.txt")})
    findings, _ = run_probe(context(tmp_path, {"min_hbm_free_mib": 50000}))
    low = findings[("npu.hbm", "npu0")]
    assert (low.status, low.reason, low.device, low.observed[OBSERVED_HBM_FREE_MIB]) == (
        Status.FAIL,
        "NpuHbmLow",
        0,
        65536 - 20701,
    )
    assert "124528" in low.message
    leaked = findings[("npu.hbm", "npu1")]
    assert (leaked.status, leaked.reason, leaked.device) == (Status.FAIL, "NpuHbmLeaked", 1)
    assert leaked.observed["processes"] == 0 and leaked.observed["used_mib"] == 20687
    findings, _ = run_probe(context(tmp_path, {"hbm_leak_min_mib": 30000}))
    assert findings[("npu.hbm", "npu1")].status == Status.OK


def test_idle_chips_are_not_leaks(tmp_path: Path, fake: FakeSmi) -> None:
    # Every idle 910B chip shows ~3.4 GiB in use (firmware reservation): not a leak at the default.
    fake.answer({"info": table("910b3-8card-1proc-info-26.1.0-WIDE-layout-testfixture.txt")})
    findings, _ = run_probe(context(tmp_path))
    assert all(findings[("npu.hbm", f"npu{i}")].status == Status.OK for i in range(8))


EIGHT_ROW = "| 1       1                 | 990711        | python                   | 7746                    |"


def _a3_with_eight_processes() -> str:
    text = npu_fixture("a3-910_93-2card-4chip-1proc-info-25.2.0.txt").read_text()
    return text.replace(EIGHT_ROW, "\n".join(EIGHT_ROW.replace("990711", str(990711 + i)) for i in range(8)))


def test_eight_processes_ask_proc_mem_for_the_rest(tmp_path: Path, fake: FakeSmi) -> None:
    lines = "".join(f"\tProcess id:{900000 + i}  Process name:python  Process memory(MB):700\n" for i in range(10))
    fake.answer({"info": {"stdout": _a3_with_eight_processes()}, "info -t proc-mem -i 1 -c 1": {"stdout": lines}})
    findings, samples = run_probe(context(tmp_path))
    assert "info -t proc-mem -i 1 -c 1" in fake.calls()
    assert sample(samples, "nodehealth_npu_processes", 3) == 10
    assert findings[("npu.hbm", "npu3")].observed["processes"] == 10


def test_failed_proc_mem_keeps_the_eight(tmp_path: Path, fake: FakeSmi) -> None:
    fake.answer({"info": {"stdout": _a3_with_eight_processes()}})
    findings, samples = run_probe(context(tmp_path))
    assert sample(samples, "nodehealth_npu_processes", 3) == 8
    assert "proc-mem" in findings[("npu.hbm", "npu3")].observed["proc_mem_error"]
    assert findings[("npu.smi", "")].status == Status.OK


# --- the CLI --------------------------------------------------------------------------------------


def _check_json(tmp_path: Path, fake: FakeSmi, config: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    config_file = tmp_path / "config.yaml"
    config_file.write_text(json.dumps(config))  # JSON is YAML
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", "check", "--json", "--config", str(config_file), "--only", "npu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": f"{fake.bin}{os.pathsep}{os.environ['PATH']}"},
    )
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def _cli_config(tmp_path: Path) -> dict[str, Any]:
    if not (REPO / "agent" / "cli.py").exists():
        pytest.skip("agent/cli.py not there yet")
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    proc.mkdir()
    dev.mkdir()
    return {"host": {"proc": str(proc), "dev": str(dev)}, "npu": {"smi_timeout_seconds": 1.0}}


def test_cli_check_json_ready(tmp_path: Path, fake: FakeSmi) -> None:
    fake.answer({"info": table("910b3-8card-1proc-info-26.1.0-WIDE-layout-testfixture.txt")})
    code, document = _check_json(tmp_path, fake, _cli_config(tmp_path))
    by_key = {(f["check"], f["subject"]): f for f in document["findings"]}
    assert code == 0 and document["ready"] is True
    assert by_key[("npu.smi", "")]["status"] == "ok"
    assert by_key[("npu.health", "npu7")]["status"] == "ok"
    assert by_key[("npu.hbm", "npu0")]["observed"][OBSERVED_HBM_FREE_MIB] == 65536 - 8676
    assert by_key[("npu.hbm", "npu0")]["device"] == 0


@pytest.mark.parametrize(
    ("answer", "failure", "words"),
    [
        (
            {"stdout": "dcmi model initialized failed, because the device is used. ret is -8020\n", "rc": 255},
            "device_busy",
            "held by another container or process",
        ),
        (
            {"stdout_file": "error-dcmi-init-failed-8005-in-container-vllm-ascend-issue2698.txt", "rc": 1},
            "dcmi_init_failed",
            "dcmi module initialize failed",
        ),
        ({"sleep": 30}, "timeout", "did not answer within 1s"),
    ],
)
def test_cli_check_json_npu_smi_failures(
    tmp_path: Path, fake: FakeSmi, answer: dict[str, Any], failure: str, words: str
) -> None:
    if "stdout_file" in answer:
        answer = {**answer, "stdout_file": str(npu_fixture(answer["stdout_file"]))}
    fake.answer({"info": answer})
    code, document = _check_json(tmp_path, fake, _cli_config(tmp_path))
    by_key = {(f["check"], f["subject"]): f for f in document["findings"]}
    assert code == 1 and document["ready"] is False
    smi = by_key[("npu.smi", "")]
    assert (smi["status"], smi["reason"], smi["observed"]["failure"]) == ("fail", "NpuSmiFailed", failure)
    assert words in smi["message"]
    assert smi["hint"]
