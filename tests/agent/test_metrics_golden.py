"""The full /metrics exposition of a fake node, compared with a committed file: any metric change is a diff.

The node is the agent itself (`Agent`, without Kubernetes) with every probe configured; its state is fed what
the probes' own parsers and builders make of captured tool output (an Ascend 910B1 and an A100 node's
fixtures), of a /proc/meminfo, a statvfs, a PCIe link and an adjtimex result, plus a failing DNS check, a probe
that timed out and one that raised; the other checks are still warming up. Its CPU cgroup is a 500m container
with a work cgroup for the probes' children, read from cgroup v2 files the test writes (`cpu_cgroups`).
The exposition is what /metrics serves (`Agent.metrics.render()`), with two things taken out because no run
repeats them: the agent's process metrics (CPU, memory, fds) and the wall-clock value of each
`*_timestamp_seconds` sample.

Regenerate after an intended change, then review the diff of tests/data/metrics.golden.txt:

    NODE_HEALTH_REGENERATE_GOLDEN=1 PYTHONPATH=$PWD python3 -m pytest -q tests/agent/test_metrics_golden.py
"""

from __future__ import annotations

import difflib
import os
import re
import tempfile
from pathlib import Path

from support.system import REPO

from agent.config import parse_config
from agent.daemon import Agent
from agent.reasons import PROBE_ERROR, PROBE_TIMEOUT
from probes import all_probes
from probes.base import Check, Finding, Sample
from probes.gpu.config import GpuConfig
from probes.gpu.findings import health_finding, memory_finding, throttle_finding
from probes.gpu.metrics import gpu_samples
from probes.gpu.nvidia_smi import parse_query
from probes.host.config import HostMemoryConfig
from probes.host.host import memory_findings, memory_samples, parse_meminfo
from probes.network.dns import DNS, DNS_FAILED
from probes.npu.chipmap import ChipRef
from probes.npu.config import NpuConfig
from probes.npu.details import resolve_ids
from probes.npu.ecc import EccProbe
from probes.npu.fault_codes import FaultTable
from probes.npu.findings import hbm_findings, health_findings
from probes.npu.grade import grade_finding
from probes.npu.hccn import Call
from probes.npu.info_table import parse_info
from probes.npu.link_window import Flaps
from probes.npu.metrics import chip_samples
from probes.npu.reasons import SMI
from probes.npu.roce_findings import (
    address_finding,
    flaps_finding,
    link_finding,
    net_health_finding,
    optical_finding,
)
from probes.pcie.pcie import AER, LINK, link_samples
from probes.pcie.sysfs import LinkState
from probes.runtime.cpulimit import Confinement, CpuCgroup
from probes.storage.config import SpaceSpec
from probes.storage.space import space_finding, space_samples
from probes.time.kernel_clock import KernelClock
from probes.time.time import SYNC, kernel_samples

GOLDEN = REPO / "tests" / "data" / "metrics.golden.txt"
REGENERATE_ENV = "NODE_HEALTH_REGENERATE_GOLDEN"
FIXTURES = REPO / "tests" / "fixtures"
HCCN = FIXTURES / "hccn_tool"
NPU_INFO = FIXTURES / "npu-smi" / "910b1-8card-healthy-1proc-info-24.1.0.txt"
GPU_QUERY = FIXTURES / "nvidia-smi" / "a100-sxm4-40gb-8gpu-q-full-460.32.03-healthy.txt"
DEVICES = 2  # of each kind: enough to show per-device labels, few enough to read the file

MEMINFO = """\
MemTotal:       1056456988 kB
MemFree:        801234560 kB
MemAvailable:   1001234560 kB
HugePages_Total:    1024
HugePages_Free:      512
Hugepagesize:       2048 kB
"""
# statvfs of /data: 4 KiB blocks, 90% used (above the default warn watermark of 85%)
DATA_STATVFS = {"frsize": 4096, "blocks": 1_000_000, "bfree": 100_000, "bavail": 100_000}
DATA_STATVFS |= {"files": 65_536, "ffree": 60_000, "favail": 60_000}
# adjtimex: TIME_OK, synchronised, 1.5 ms max error, 0.2 ms estimated error
CLOCK = KernelClock(state=0, status=0x2001, maxerror_us=1500, esterror_us=200, offset=12, freq=0, tai=37)

PROCESS_METRIC = re.compile(r"^(# (HELP|TYPE) )?nodehealth_agent_process_")
TIMESTAMP_SAMPLE = re.compile(r"^(\w+_timestamp_seconds(\{[^}]*\})?) \S+$")
FIXED_TIMESTAMP = "1.8e+09"


def npu_run() -> tuple[list[Finding], list[Sample]]:
    chips = resolve_ids(parse_info(NPU_INFO.read_text()).chips[:DEVICES], None)
    settings = NpuConfig()
    findings = [SMI.ok("", f"npu-smi 24.1.0: {len(chips)} chips on {len(chips)} cards")]
    findings += health_findings(chips, {}, settings.health_status, [], None)
    # A floor between the chips' free HBM (65536 - 3437 and 65536 - 3378 MiB): npu0 is below it, npu1 is not.
    findings += hbm_findings(chips, 62_120, settings.hbm_leak_min_mib, set(), {})
    return findings, chip_samples(chips, {})


def npu_links_run() -> tuple[list[Finding], list[Sample]]:
    """npu.roce, npu.grade and npu.ecc on two chips from the sourced hccn_tool and npu-smi outputs: npu1's port
    DOWN and its optical module without signal, npu0's HBM with a double-bit error."""
    settings, samples = NpuConfig(), []
    chips = [ChipRef(n, n, n, 0, "Ascend 910B1", bus) for n, bus in ((0, "0000:C1:00.0"), (1, "0000:01:00.0"))]
    findings: list[Finding] = []
    for chip, link, optical in (
        (chips[0], "link-up-doc.txt", "optical-present-healthy-DERIVED.txt"),
        (chips[1], "link-down-hccn_tool-go.txt", "optical-present-rx-los-DERIVED.txt"),
    ):

        def call(verb: str, name: str, chip: ChipRef = chip) -> Call:
            return Call(chip.physical_id, verb, (HCCN / name).read_text())

        findings.append(link_finding(chip, call("link", link), samples))
        findings.append(flaps_finding(chip, 2, Flaps(0, 1.8e9, False), settings, 1.8e9, samples))
        findings.append(net_health_finding(chip, "Success", samples))
        findings.append(optical_finding(chip, call("optical", optical), settings, samples))
        findings.append(address_finding(chip, call("ip", "ip-configured-faultdiag.txt"), None, None, "/etc/hccn.conf"))
        health = (FIXTURES / "npu-smi" / "910a-t-health-OK-i0-c0-faultdiag.txt").read_text()
        findings.append(grade_finding(chip, health, "", FaultTable({}, "built-in")))
        ecc = (FIXTURES / "npu-smi" / "910a-t-ecc-i1-ddr-and-hbm-docexample-mindcluster.txt").read_text()
        if chip.logical_id == 0:
            ecc = ecc.replace(
                "HBM Double Bit Error Count               : 0", "HBM Double Bit Error Count               : 1"
            )
        for item in EccProbe().judge(chip, ecc, "", settings, 0.0):
            (findings if isinstance(item, Finding) else samples).append(item)  # type: ignore[arg-type]
    return findings, samples


def gpu_run() -> tuple[list[Finding], list[Sample]]:
    gpus = parse_query(GPU_QUERY.read_text()).gpus[:DEVICES]
    settings = GpuConfig()
    findings = [make(gpu, settings) for gpu in gpus for make in (health_finding, throttle_finding)]
    findings += [memory_finding(gpu, settings, set()) for gpu in gpus]
    return findings, [sample for gpu in gpus for sample in gpu_samples(gpu, 0)]


def host_run() -> tuple[list[Finding], list[Sample]]:
    meminfo = parse_meminfo(MEMINFO)
    return memory_findings(meminfo, HostMemoryConfig()), memory_samples(meminfo)


def cpu_cgroups(root: Path) -> Confinement:
    """A 500m container that was throttled in 3 of 600 periods, its work cgroup (400m) in 240 of 3000."""
    container, work = CpuCgroup(root, v1=False), CpuCgroup(root / "work", v1=False)
    work.path.mkdir(parents=True)
    (root / "cpu.max").write_text("50000 100000\n")
    (root / "cpu.stat").write_text("usage_usec 30000000\nnr_periods 600\nnr_throttled 3\nthrottled_usec 41000\n")
    (work.path / "cpu.max").write_text("8000 20000\n")
    (work.path / "cpu.stat").write_text(
        "usage_usec 20000000\nnr_periods 3000\nnr_throttled 240\nthrottled_usec 2400000\n"
    )
    return Confinement(container, work, "quota")


def fake_node(cpu: Confinement) -> Agent:
    """The agent of a fake node, fed one run of each probe the docstring names."""
    config = parse_config({"node_name": "golden-node"})
    agent = Agent(None, config, no_kube=True, probe_classes=all_probes(), cpu=cpu)
    state = agent.state
    for probe, (findings, samples) in (("npu", npu_run()), ("gpu", gpu_run()), ("host", host_run())):
        state.record(probe, findings, samples, duration=0.25)
    links, link_samples_ = npu_links_run()
    for probe in ("npu.roce", "npu.grade", "npu.ecc"):
        own = [f for f in links if f.check.startswith(probe)]
        state.record(
            probe,
            own,
            [s for s in link_samples_ if ("_ecc_" in s.name) == (probe == "npu.ecc")],
            duration=0.25,
        )
    space = (space_finding("/data", DATA_STATVFS, SpaceSpec(path="/data")),)
    state.record("storage.space", space, space_samples("/data", DATA_STATVFS, 0.002), duration=0.01)
    link = LinkState(width=16, max_width=16, speed=32.0, max_speed=32.0)
    pcie = [AER.ok("0000:c1:00.0", "no AER errors"), LINK.ok("0000:c1:00.0", "x16 at 32 GT/s")]
    state.record("pcie", pcie, link_samples("0000:c1:00.0", link), duration=0.05)
    state.record("time", [SYNC.ok("kernel", "synchronised")], kernel_samples(CLOCK), duration=0.5)
    state.record("network.dns", [DNS.report(DNS_FAILED, "kubernetes.default.svc", "SERVFAIL")], duration=1.5)
    timeout = Check("storage.mounts").report(PROBE_TIMEOUT, "", "still running after 10.0s")
    state.record("storage.mounts", [timeout], result="timeout", duration=10.0, still_running=True)
    error = Check("network.links").report(PROBE_ERROR, "", "probe network.links failed: OSError: boom")
    state.record("network.links", [error], result="error", duration=0.01)
    return agent


def exposition() -> str:
    lines = []
    with tempfile.TemporaryDirectory() as cgroups:
        rendered = fake_node(cpu_cgroups(Path(cgroups))).metrics.render().decode()
    for line in rendered.splitlines():
        if PROCESS_METRIC.match(line):
            continue
        lines.append(TIMESTAMP_SAMPLE.sub(rf"\1 {FIXED_TIMESTAMP}", line))
    return "\n".join(lines) + "\n"


def test_the_metrics_exposition_is_the_committed_one() -> None:
    rendered = exposition()
    if os.environ.get(REGENERATE_ENV) == "1":
        GOLDEN.write_text(rendered)
    assert GOLDEN.is_file(), f"no {GOLDEN.relative_to(REPO)}: run with {REGENERATE_ENV}=1 to write it"
    golden = GOLDEN.read_text()
    diff = difflib.unified_diff(golden.splitlines(), rendered.splitlines(), "golden", "rendered", lineterm="")
    assert rendered == golden, f"/metrics changed; if intended, regenerate with {REGENERATE_ENV}=1:\n" + "\n".join(
        list(diff)[:60]
    )


def test_the_golden_file_covers_every_kind_of_series() -> None:
    """What the file must show, so that a change in any of these is a diff in it."""
    golden = GOLDEN.read_text()
    for needle in (
        "nodehealth_ready 0.0",
        'nodehealth_check_status{check="npu.hbm",subject="npu0"} 2.0',  # below the floor this test sets
        'nodehealth_check_status{check="npu.hbm",subject="npu1"} 0.0',
        'nodehealth_check_status{check="storage.locks",subject=""} 3.0',  # still warming up
        'nodehealth_problem{check="network.dns",reason="DnsFailed",subject="kubernetes.default.svc"} 1.0',
        'problem_gauge{reason="DiskLow",type="StorageHealthy"} 1.0',
        'problem_counter{reason="DnsFailed"} 1.0',
        'nodehealth_probe_runs_total{probe="storage.mounts",result="timeout"} 1.0',
        'nodehealth_probe_runs_total{probe="network.links",result="error"} 1.0',
        f'nodehealth_probe_last_success_timestamp_seconds{{probe="npu"}} {FIXED_TIMESTAMP}',
        'nodehealth_npu_hbm_used_bytes{card="0",chip="0",container="",id="0",name="910B1",namespace="",'
        'pci_bus_id="0000:C1:00.0",pod=""}',
        "nodehealth_gpu_memory_total_bytes{",
        "nodehealth_host_hugepages_free 512.0",
        'nodehealth_storage_free_bytes{path="/data"}',
        'nodehealth_pcie_link_width_lanes{pci_bus_id="0000:C1:00.0"} 16.0',
        "nodehealth_time_synced 1.0",
        'nodehealth_config_reloads_total{result="ok"} 0.0',
        "nodehealth_child_processes_in_flight 0.0",
        "nodehealth_http_connections 0.0",
    ):
        assert needle in golden, needle
    assert "nodehealth_agent_process_" not in golden
