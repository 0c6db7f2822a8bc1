"""The npu probe end to end: a fake `npu-smi` on PATH answering from captured outputs, device nodes made with
mknod in a temp dev dir, real child processes holding them, and real cgroups."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from support.system import REPO, require, require_fixtures, require_root, require_tool

from agent.config import parse_config
from probes.base import OBSERVED_HBM_FREE_MIB, Finding, ProbeContext, Sample, Status
from probes.npu.npu import NpuProbe
from probes.runtime.host import Host
from probes.runtime.procfs import classify_cgroup

FAKE = REPO / "tests" / "support" / "fake_npu_smi.py"


def npu_fixture(name: str) -> Path:
    return require_fixtures() / "npu-smi" / name


class FakeSmi:
    """A fake `npu-smi` executable on PATH, answering from a JSON spec the test writes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir(parents=True)
        self.spec = root / "spec.json"
        self.log = root / "calls.log"
        script = self.bin / "npu-smi"
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "{self.spec}" "$@"\n')
        script.chmod(0o755)
        self.answer({})

    def answer(self, responses: dict[str, dict[str, Any]], default: dict[str, Any] | None = None) -> None:
        spec: dict[str, Any] = {"responses": responses, "log": str(self.log)}
        if default is not None:
            spec["default"] = default
        self.spec.write_text(json.dumps(spec))
        self.log.write_text("")

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines()


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSmi:
    smi = FakeSmi(tmp_path / "fake")
    monkeypatch.setenv("PATH", f"{smi.bin}{os.pathsep}{os.environ.get('PATH', '')}")
    return smi


def table(name: str) -> dict[str, Any]:
    return {"stdout_file": str(npu_fixture(name))}


def make_dev(root: Path, nodes: dict[str, tuple[int, int]]) -> Path:
    """A temp dev dir with character device nodes name → (major, minor)."""
    require_root()
    root.mkdir(parents=True, exist_ok=True)
    for name, (major, minor) in nodes.items():
        os.mknod(root / name, stat.S_IFCHR | 0o600, os.makedev(major, minor))
    return root


def context(
    tmp: Path, npu: dict[str, Any] | None = None, proc: Path | None = None, dev: Path | None = None, timeout=10.0
) -> ProbeContext:
    """A real ProbeContext. By default /proc is an empty temp dir, so the PIDs of captured outputs can never
    match a process of this machine; holder tests pass the real /proc."""
    if proc is None:
        proc = tmp / "empty-proc"
        proc.mkdir(exist_ok=True)
    if dev is None:
        dev = tmp / "empty-dev"
        dev.mkdir(exist_ok=True)
    config = parse_config({"npu": npu or {}})
    return ProbeContext(Host(proc=proc, dev=dev), config, timeout)


def run_probe(ctx: ProbeContext, probe: NpuProbe | None = None) -> tuple[dict[tuple[str, str], Finding], list[Sample]]:
    probe = probe or NpuProbe()
    assert probe.applicable(ctx) is None
    output = probe.run(ctx)
    findings: dict[tuple[str, str], Finding] = {}
    samples: list[Sample] = []
    for item in output:
        if isinstance(item, Finding):
            assert item.key not in findings, f"two findings for {item.key}"
            assert item.message and "\n" not in item.message
            if item.status in (Status.WARN, Status.FAIL):
                assert item.hint, f"{item.key} has no hint"
            findings[item.key] = item
        else:
            assert isinstance(item, Sample) and item.name.startswith("nodehealth_npu_")
            samples.append(item)
    return findings, samples


def sample(samples: list[Sample], name: str, chip: int) -> float | None:
    values = [s.value for s in samples if s.name == name and s.labels.get("chip") == str(chip)]
    assert len(values) <= 1
    return values[0] if values else None


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
    assert labels == {"chip": "3", "card": "1", "name": "Ascend910"}
    assert fake.calls() == ["info", "info -m"]


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


def test_nsenter_prefix_without_npu_smi_on_the_host(tmp_path: Path) -> None:
    nsenter = require_tool("nsenter")
    argv = [nsenter, "--", "npu-smi-not-installed-here"]
    # No npu-smi and no /dev/davinci*: skip before running anything.
    assert NpuProbe().applicable(context(tmp_path, {"smi_command": argv})) == "no npu-smi on this host"
    # With a davinci node the probe runs; nsenter's exit status 127 then means "not installed": skip.
    dev = make_dev(tmp_path / "dev", {"davinci0": (240, 0)})
    findings, _ = run_probe(context(tmp_path, {"smi_command": argv}, dev=dev))
    assert findings[("npu.smi", "")].status == Status.SKIP
    assert findings[("npu.smi", "")].message == "no npu-smi on this host"


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


# --- holders: real processes holding mknod'ed nodes ---------------------------------------------


@contextlib.contextmanager
def holding(path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real child process that keeps `path` open until the block ends."""
    code = "import os, sys, time; os.open(sys.argv[1], os.O_RDONLY); print('ready', flush=True); time.sleep(120)"
    child = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        yield child
    finally:
        child.kill()
        child.wait()


FULL = (1, 7)  # /dev/full: a real character device that opens anywhere and that almost nothing holds


def _table_listing(pid: int) -> dict[str, Any]:
    text = npu_fixture("910b1-8card-healthy-1proc-info-24.1.0.txt").read_text()
    return {"stdout": text.replace("| 641248        |", f"| {pid:<13} |")}


def _holder(finding: Finding, pid: int) -> dict[str, Any]:
    return next(h for h in finding.observed["holders"] if h["pid"] == pid)


def test_holder_outside_kubernetes_of_a_container_copy(tmp_path: Path, fake: FakeSmi) -> None:
    host_dev = make_dev(tmp_path / "dev", {"davinci0": FULL, "davinci1": (240, 1)})
    # A container's /dev is its own tmpfs with its own inode for the same major:minor.
    container_dev = make_dev(tmp_path / "container-dev", {"davinci0": FULL})
    with holding(container_dev / "davinci0") as child:
        fake.answer({"info": _table_listing(child.pid)})
        findings, samples = run_probe(context(tmp_path, proc=Path("/proc"), dev=host_dev))
        cgroup = classify_cgroup(Path(f"/proc/{child.pid}/cgroup").read_text())
    require(not cgroup.in_pod, "a test process outside any Kubernetes pod cgroup")
    held = findings[("npu.holders", "npu0")]
    assert (held.status, held.reason, held.device) == (Status.FAIL, "NpuHeldOutOfBand", 0)
    assert f"PID {child.pid}" in held.message and "/dev/davinci0" in held.message
    assert cgroup.describe() in held.message
    assert "kill" in held.hint or "stop" in held.hint
    holder = _holder(held, child.pid)
    assert holder["sources"] == ["fd", "npu-smi"] and holder["devices"] == ["davinci0"]
    assert holder["kind"] == cgroup.kind and holder["cgroup_path"] == cgroup.path
    assert findings[("npu.holders", "npu1")].status == Status.OK
    assert sample(samples, "nodehealth_npu_out_of_band_holders", 0) >= 1
    assert sample(samples, "nodehealth_npu_out_of_band_holders", 1) == 0
    assert findings[("npu.hbm", "npu0")].reason != "NpuHbmLeaked"


def test_vanished_npu_smi_pid_is_counted(tmp_path: Path, fake: FakeSmi) -> None:
    host_dev = make_dev(tmp_path / "dev", {"davinci0": (240, 0)})
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its PID names no process now
    fake.answer({"info": _table_listing(gone.pid)})
    findings, _ = run_probe(context(tmp_path, proc=Path("/proc"), dev=host_dev))
    held = findings[("npu.holders", "npu0")]
    assert held.status == Status.OK and held.observed["vanished"] >= 1
    assert all(h["pid"] != gone.pid for h in held.observed["holders"])


def test_failed_scan_is_unknown_not_fatal(tmp_path: Path, fake: FakeSmi) -> None:
    host_dev = make_dev(tmp_path / "dev", {"davinci0": (240, 0)})
    fake.answer({"info": table("910b3-container-only-card3-visible-info-25.2.3-IRREGULAR-ALIGNMENT.txt")})
    findings, _ = run_probe(context(tmp_path, proc=tmp_path / "no-such-proc", dev=host_dev))
    held = findings[("npu.holders", "npu0")]
    assert (held.status, held.reason) == (Status.UNKNOWN, "NpuHolderScanFailed")
    assert held.observed["scan_error"]
    assert findings[("npu.smi", "")].status == Status.OK and findings[("npu.health", "npu0")].status == Status.OK


def _pod_cgroup_dir() -> Path | None:
    """A cgroup directory this test may create, in the hierarchy /proc/PID/cgroup reports first."""
    for root in (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")):
        if (root / "cgroup.procs").exists() and os.access(root, os.W_OK):
            if root.name != "memory" and not (root / "cgroup.controllers").exists():
                continue
            return root
    return None


def test_holder_in_a_pod_is_fine(tmp_path: Path, fake: FakeSmi) -> None:
    host_dev = make_dev(tmp_path / "dev", {"davinci0": FULL})
    root = _pod_cgroup_dir()
    require(root is not None, "a writable cgroup hierarchy (memory v1 or v2)")
    assert root is not None
    pod_uid = str(uuid.uuid4())
    top = root / f"node-health-test-{uuid.uuid4().hex[:8]}"
    leaf = top / "kubepods" / "burstable" / f"pod{pod_uid}" / ("ab" * 32)
    try:
        leaf.mkdir(parents=True)
    except OSError as exc:
        require(False, f"creating a cgroup: {exc}")
    try:
        with holding(host_dev / "davinci0") as child:
            try:
                (leaf / "cgroup.procs").write_text(str(child.pid))
            except OSError as exc:
                require(False, f"moving a process into a cgroup: {exc}")
            fake.answer({"info": _table_listing(child.pid)})
            findings, samples = run_probe(context(tmp_path, proc=Path("/proc"), dev=host_dev))
    finally:
        for directory in (leaf, *leaf.parents):
            if directory == root:
                break
            with contextlib.suppress(OSError):
                directory.rmdir()
    held = findings[("npu.holders", "npu0")]
    holder = _holder(held, child.pid)
    assert holder["kind"] == "pod" and pod_uid in holder["cgroup"]
    assert held.observed["holders_in_pods"] >= 1
    # Another process of this machine may hold /dev/full too: only those may make the chip fail.
    others = [h for h in held.observed["holders"] if h["kind"] != "pod"]
    assert child.pid not in [h["pid"] for h in others]
    assert held.status == (Status.FAIL if others else Status.OK)
    assert sample(samples, "nodehealth_npu_out_of_band_holders", 0) == len(others)


def test_holder_of_only_the_shared_node_warns(tmp_path: Path, fake: FakeSmi) -> None:
    host_dev = make_dev(tmp_path / "dev", {"davinci0": (240, 0), "davinci_manager": FULL})
    with holding(host_dev / "davinci_manager") as child:
        fake.answer({"info": table("910b3-container-only-card3-visible-info-25.2.3-IRREGULAR-ALIGNMENT.txt")})
        findings, samples = run_probe(context(tmp_path, proc=Path("/proc"), dev=host_dev))
        comm = Path(f"/proc/{child.pid}/comm").read_text().strip()
        shared = findings[("npu.holders", "")]
        assert (shared.status, shared.reason) == (Status.WARN, "NpuHeldOutOfBand")
        assert _holder(shared, child.pid)["devices"] == ["davinci_manager"]
        assert findings[("npu.holders", "npu0")].status == Status.OK
        assert next(s.value for s in samples if s.name == "nodehealth_npu_shared_out_of_band_holders") >= 1
        # A node daemon that must keep the node open can be allowed by name.
        findings, _ = run_probe(context(tmp_path, {"holder_ignore_commands": [comm]}, proc=Path("/proc"), dev=host_dev))
        assert all(h["pid"] != child.pid for h in findings[("npu.holders", "")].observed["holders"])


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
