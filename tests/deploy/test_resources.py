"""The DaemonSet's requests and limits are the measured ones, and its CPU limit lets the holder scan finish.

- deploy/daemonset.yaml asks for what docs/deployment.md (Resources) quotes; the memory limit there is at least
  twice the heaviest measured profile's peak RSS, and the scan quoted at the CPU limit was complete within its
  deadline (benchmarks/footprint.py and scan_quota.py measure; their results/ are not kept in git).
- The npu probe's scan deadline grows with the fds open on the host and stays within 40% of the probe's
  timeout, so npu-smi keeps its own timeout.
- The npu probe, run as the agent runs it, in a cgroup whose CPU quota is the DaemonSet's CPU limit, on a host
  with 2,000 more processes holding 50 open files each: its holder scan reads every process within the deadline
  the probe gives it and finds the holder planted outside any pod. A correctness bound, not a timing benchmark.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import yaml
from support.fake_npu_smi import FakeSmi, context, make_dev, run_probe, table
from support.system import REPO, require, require_root

from probes.npu.config import NpuConfig
from probes.npu.npu import NpuProbe, holder_scan_seconds, host_fds_seen
from probes.runtime.holders import DeviceScan
from probes.runtime.procfs import ScanResult, UnreadableProcess

sys.path.insert(0, str(REPO / "benchmarks"))  # the helpers the benchmarks use: one farm, one cgroup, one probe run

import footprint
import scan_quota

DOC = REPO / "docs" / "deployment.md"
MIB_PER_GIB = 1024


def daemonset_resources() -> dict[str, dict[str, str]]:
    for document in yaml.safe_load_all((REPO / "deploy" / "daemonset.yaml").read_text()):
        if document and document.get("kind") == "DaemonSet":
            container = document["spec"]["template"]["spec"]["containers"][0]
            return dict(container["resources"])
    raise AssertionError("deploy/daemonset.yaml has no DaemonSet")


def resources_section() -> str:
    text = DOC.read_text()
    match = re.search(r"^## Resources\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, "docs/deployment.md has no Resources section"
    return match.group(1)


def mebibytes(quantity: str) -> float:
    units = {"Mi": 1, "Gi": MIB_PER_GIB}
    match = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    assert match, f"memory {quantity!r} is not in Mi or Gi"
    return int(match.group(1)) * units[match.group(2)]


def documented_table(section: str, first_column: str) -> dict[str, list[str]]:
    """Rows of the Markdown table whose header starts with `first_column`: first cell → the other cells."""
    rows: dict[str, list[str]] = {}
    in_table = False
    for line in section.splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_column:
            in_table = True
        elif in_table and line.startswith("|") and not set(cells[0]) <= {"-", ":"}:
            rows[cells[0]] = cells[1:]
        elif in_table and not line.startswith("|"):
            break
    assert rows, f"no table headed {first_column!r} in the Resources section"
    return rows


# --- the figures -----------------------------------------------------------------------------------


def test_daemonset_asks_for_what_the_docs_quote() -> None:
    resources = daemonset_resources()
    documented = documented_table(resources_section(), "")
    for kind in ("requests", "limits"):
        assert documented[kind] == [resources[kind]["cpu"], resources[kind]["memory"]], kind


def test_every_profile_is_quoted_and_the_memory_limit_doubles_the_heaviest_peak() -> None:
    documented = documented_table(resources_section(), "profile")
    assert set(documented) == set(footprint.PROFILES), "every profile of benchmarks/footprint.py is quoted"
    # profile | what | window | peak RSS | RSS at end | with children, PSS peak | average CPU
    peak = {name: mebibytes_quoted(cells[2]) for name, cells in documented.items()}
    steady = {name: mebibytes_quoted(cells[3]) for name, cells in documented.items()}
    heaviest = max(peak.values())
    limit = mebibytes(daemonset_resources()["limits"]["memory"])
    assert limit >= 2 * heaviest, f"memory limit {limit} MiB under twice the peak RSS {heaviest} MiB"
    request = mebibytes(daemonset_resources()["requests"]["memory"])
    assert max(steady.values()) <= request < limit, "the memory request covers the steady state, below the limit"


def test_the_scan_at_the_daemonsets_cpu_limit_is_quoted_complete_within_its_deadline() -> None:
    cpu_limit = daemonset_resources()["limits"]["cpu"]
    documented = documented_table(resources_section(), "CPU limit")
    assert cpu_limit in documented, "the Resources section quotes the scan at the DaemonSet's CPU limit"
    # CPU limit | slowest scan, alone | CPU per run | complete | slowest scan beside another | complete | deadline
    alone, _, alone_complete, beside, beside_complete, deadline = documented[cpu_limit]
    assert alone_complete == beside_complete == "yes", documented[cpu_limit]
    assert seconds_quoted(alone) <= seconds_quoted(beside) <= seconds_quoted(deadline), documented[cpu_limit]


def mebibytes_quoted(cell: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?) MiB", cell)
    assert match, f"{cell!r} is not a figure like 90.5 MiB"
    return float(match.group(1))


def seconds_quoted(cell: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?) s", cell)
    assert match, f"{cell!r} is not a figure like 0.89 s"
    return float(match.group(1))


# --- the scan deadline -----------------------------------------------------------------------------


def test_scan_deadline_grows_with_the_hosts_fds_within_40_percent_of_the_run() -> None:
    settings = NpuConfig(holder_scan_timeout_seconds=5.0, holder_scan_seconds_per_1000_fds=0.04)
    assert holder_scan_seconds(settings, 20.0, None) == pytest.approx(8.0)  # no scan yet: the whole share
    assert holder_scan_seconds(settings, 20.0, 10_000) == pytest.approx(5.4)
    assert holder_scan_seconds(settings, 20.0, 110_000) == pytest.approx(8.0)  # 9.4 s, bounded by the share
    assert holder_scan_seconds(settings, 0.0, 1_000) == pytest.approx(0.1)
    # What is left of the default timeout after the longest scan still covers one npu-smi call.
    assert NpuProbe.default_timeout * 0.6 >= NpuConfig().smi_timeout_seconds


def test_fds_of_an_incomplete_scan_are_extrapolated_over_the_processes_it_missed() -> None:
    def scan(fds: int, processes: int, unscanned: int = 0, unreadable: int = 0) -> DeviceScan:
        stuck = tuple(UnreadableProcess(pid, "x", "stuck") for pid in range(unreadable))
        return DeviceScan({}, ScanResult((), 0, 0, processes, fds, 1.0, stuck, unscanned))

    assert host_fds_seen(scan(50_000, 1_000)) == 50_000
    assert host_fds_seen(scan(50_000, 1_000, unscanned=900, unreadable=100)) == 100_000
    assert host_fds_seen(scan(0, 0, unscanned=10)) is None
    assert host_fds_seen(DeviceScan({}, None, "no /proc")) is None
    assert host_fds_seen(None) is None


@pytest.mark.system
def test_the_probe_takes_its_next_scan_deadline_from_the_fds_it_saw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_root()
    fake = FakeSmi(tmp_path / "fake")
    fake.answer({"info": table("910b1-8card-healthy-1proc-info-24.1.0.txt")})
    monkeypatch.setenv("PATH", f"{fake.bin}{os.pathsep}{os.environ.get('PATH', '')}")
    dev = make_dev(tmp_path / "dev", {"davinci0": (240, 0)})
    probe = NpuProbe()
    ctx = context(tmp_path, {"holder_scan_seconds_per_1000_fds": 0.5}, Path("/proc"), dev, timeout=20.0)
    settings = ctx.settings(NpuConfig)
    assert probe.scan_deadline(settings, 20.0) == pytest.approx(8.0)
    findings, _ = run_probe(ctx, probe)
    assert findings[("npu.holders", "")].observed["processes_scanned"] > 0
    # 5 s and half a second per 1,000 fds the host had open: more than the base, within the share.
    assert 5.0 < probe.scan_deadline(settings, 20.0) <= 8.0
    # The count it keeps is the host's (read back through the deadline with 1 s per 1,000 fds and no bound).
    per_fd = NpuConfig(holder_scan_timeout_seconds=1.0, holder_scan_seconds_per_1000_fds=1.0)
    kept = (probe.scan_deadline(per_fd, 1e9) - 1.0) * 1000
    now = scan_quota.host_fds()
    assert now / 2 <= kept <= now * 2, (kept, now)


# --- the scan under the CPU limit ------------------------------------------------------------------

PROCESSES, FDS = 2000, 50


@pytest.mark.system
def test_npu_holder_scan_completes_under_the_daemonsets_cpu_limit(tmp_path: Path) -> None:
    """2,000 processes x 50 fds; the npu probe run twice (the second with the deadline the first one's count
    gives) in a cgroup with the DaemonSet's CPU quota, each time beside another whole-/proc scan, as the gpu
    probe's or network.ports' would be."""
    require_root()
    why_not = scan_quota.cgroup_support()
    require(not why_not, f"a cgroup with a CPU quota ({why_not})")
    limit = scan_quota.millicores(daemonset_resources()["limits"]["cpu"])
    dev, spec = scan_quota.prepare_npu_node(tmp_path / "node")
    with scan_quota.HolderFarm(tmp_path / "farm", PROCESSES, FDS) as farm, scan_quota.CpuQuota(limit) as quota:
        runs = scan_quota.run_npu_probe(quota, dev, spec, repeat=2, rivals=1)
        throttling = quota.throttling()
    assert throttling["periods"] > 0, "the probe ran inside the cgroup"
    for run in runs:
        assert run["result"] == "ok", run
        assert run["complete"] and run["unscanned"] == 0, run
        assert run["processes_scanned"] >= PROCESSES, run
        assert run["scan_seconds"] <= run["scan_deadline"] and run["probe_seconds"] <= run["probe_timeout"], run
        held = run["held"].get("davinci0", {})
        assert farm.holder_pid in held.get("pids", []), run
        assert (held["status"], held["reason"]) == ("fail", "NpuHeldOutOfBand"), run
        assert run["node_wide"] == ["ok", "OK"], run  # nothing unread, nothing else outside a pod
        assert run["confinement"]["mode"] == "quota", run  # the scanners ran in the work cgroup, as in the agent


@pytest.mark.system
def test_a_scan_the_limit_cannot_fit_is_unknown_and_names_the_limit(tmp_path: Path) -> None:
    """At 100m the scanners get 25m (probes/runtime/cpulimit.py): 2,000 processes x 50 fds do not fit in the
    deadline. The scan is reported unknown with the limit in its message, never complete, never ok."""
    require_root()
    why_not = scan_quota.cgroup_support()
    require(not why_not, f"a cgroup with a CPU quota ({why_not})")
    dev, spec = scan_quota.prepare_npu_node(tmp_path / "node")
    with scan_quota.HolderFarm(tmp_path / "farm", PROCESSES, FDS), scan_quota.CpuQuota(100) as quota:
        (run,) = scan_quota.run_npu_probe(quota, dev, spec, repeat=1)
        work = quota.path / "work"
        assert (work / "cgroup.procs").is_file(), "the probe's process made its work cgroup"
    assert not run["complete"] and run["unscanned"] > 0, run
    assert run["node_wide"] == ["unknown", "NpuHolderScanFailed"], run
    assert "CPU limit of 100m, 25m of it for the probes' children" in run["message"], run
