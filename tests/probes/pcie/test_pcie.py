"""probes/pcie on temporary sysfs trees in the kernel's formats: symlinked functions under bus/pci/devices,
ports above them, AER counters that change between runs, trained-down links, and the accelerators the npu and
gpu probes publish, whose findings carry their device index."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.system import REPO

from agent.config import parse_config
from agent.ready import ReadyQuery, judge
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes.base import Finding, ProbeContext, ProbeParseError, Sample, Status
from probes.pcie.aer import parse_aer_counters
from probes.pcie.pcie import PcieProbe
from probes.pcie.sysfs import discover_functions, parse_link_speed
from probes.runtime.host import Host

COR_NAMES = ["RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF"]
UNCOR_NAMES = [
    "Undefined",
    "DLP",
    "SDES",
    "TLP",
    "FCP",
    "CmpltTO",
    "CmpltAbrt",
    "UnxCmplt",
    "RxOF",
    "MalfTLP",
    "ECRC",
    "UnsupReq",
    "ACSViol",
    "UncorrIntErr",
    "BlockedTLP",
    "AtomicOpBlocked",
    "TLPBlockedErr",
    "PoisonTLPBlocked",
]


def aer_text(names: list[str], total_name: str, counts: dict[str, int] | None = None) -> str:
    """What drivers/pci/pcie/aer.c aer_stats_dev_attr() prints: `%s %llu` per named bit, then TOTAL_."""
    counts = counts or {}
    lines = [f"{name} {counts.get(name, 0)}" for name in names]
    return "\n".join([*lines, f"{total_name} {sum(counts.values())}"]) + "\n"


class SysTree:
    """A /sys with devices/pci<domain:bus>/... directories and bus/pci/devices/<bdf> relative symlinks."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "bus" / "pci" / "devices").mkdir(parents=True)

    def add(
        self,
        chain: list[str],
        vendor: str,
        device: str,
        pci_class: str,
        link: tuple[int, int, str, str] | None = (16, 16, "16.0 GT/s PCIe", "16.0 GT/s PCIe"),
        aer: bool = True,
    ) -> Path:
        """chain: host bridge dir then BDFs down to the function, e.g. ["pci0000:00", "0000:00:01.0", ...]."""
        path = self.root / "devices" / Path(*chain)
        path.mkdir(parents=True, exist_ok=True)
        (path / "vendor").write_text(vendor + "\n")
        (path / "device").write_text(device + "\n")
        (path / "class").write_text(pci_class + "\n")
        if link is not None:
            self.set_link(path, *link)
        if aer:
            self.set_aer(path)
        name = chain[-1]
        target = os.path.relpath(path, self.root / "bus" / "pci" / "devices")
        (self.root / "bus" / "pci" / "devices" / name).symlink_to(target)
        return path

    @staticmethod
    def set_link(path: Path, width: int, max_width: int, speed: str, max_speed: str) -> None:
        (path / "current_link_width").write_text(f"{width}\n")
        (path / "max_link_width").write_text(f"{max_width}\n")
        (path / "current_link_speed").write_text(f"{speed}\n")
        (path / "max_link_speed").write_text(f"{max_speed}\n")

    @staticmethod
    def set_aer(
        path: Path,
        fatal: dict[str, int] | None = None,
        nonfatal: dict[str, int] | None = None,
        correctable: dict[str, int] | None = None,
    ) -> None:
        (path / "aer_dev_fatal").write_text(aer_text(UNCOR_NAMES, "TOTAL_ERR_FATAL", fatal))
        (path / "aer_dev_nonfatal").write_text(aer_text(UNCOR_NAMES, "TOTAL_ERR_NONFATAL", nonfatal))
        (path / "aer_dev_correctable").write_text(aer_text(COR_NAMES, "TOTAL_ERR_COR", correctable))


NPU0 = ["pci0000:00", "0000:00:01.0", "0000:01:00.0"]
# An NPU behind a switch: root port 80:00.0 → switch upstream 81:00.0 → downstream 82:00.0 → NPU 83:00.0
NPU1 = ["pci0000:80", "0000:80:00.0", "0000:81:00.0", "0000:82:00.0", "0000:83:00.0"]


@pytest.fixture
def tree(tmp_path: Path) -> SysTree:
    t = SysTree(tmp_path / "sys")
    # Kunpeng root port: Huawei vendor too, but a bridge, so only checked as the port above NPU0.
    t.add(NPU0[:2], "0x19e5", "0xa120", "0x060400")
    t.add(NPU0, "0x19e5", "0xd802", "0x120000")
    t.add(NPU1[:2], "0x8086", "0x347a", "0x060400")
    t.add(NPU1[:3], "0x10b5", "0x9781", "0x060400")
    t.add(NPU1[:4], "0x10b5", "0x9781", "0x060400")
    t.add(NPU1, "0x19e5", "0xd802", "0x120000")
    # another vendor's GPU-less NIC: not ours
    t.add(["pci0000:00", "0000:00:02.0", "0000:02:00.0"], "0x15b3", "0x1021", "0x020000")
    return t


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ctx_for(tree: SysTree, **pcie: object) -> ProbeContext:
    return ProbeContext(Host(sys=tree.root), parse_config({"pcie": pcie}), 5.0)


def findings(output: list[Finding | Sample], check: str) -> dict[str, Finding]:
    out: dict[str, Finding] = {}
    for item in output:
        if isinstance(item, Finding) and item.check == check:
            assert item.subject not in out, f"two {check} findings for {item.subject}"
            out[item.subject] = item
    return out


def samples(output: list[Finding | Sample], name: str) -> dict[tuple[tuple[str, str], ...], Sample]:
    return {tuple(sorted(s.labels.items())): s for s in output if isinstance(s, Sample) and s.name == name}


# --- parsers ---------------------------------------------------------------------------------------


def test_parse_aer_kernel_format() -> None:
    counts = parse_aer_counters(aer_text(COR_NAMES, "TOTAL_ERR_COR", {"RxErr": 3, "BadTLP": 2}))
    assert counts.total == 5
    assert counts.counts["RxErr"] == 3
    assert counts.counts["BadTLP"] == 2
    assert len(counts.counts) == len(COR_NAMES)


def test_parse_aer_names_with_spaces_unnamed_bits_and_no_total() -> None:
    text = "Receiver Error 2\nBad TLP 0\nRELAY_NUM Rollover 1\ndev_cor_errs_bit[9] 4\nTOTAL_ERR_COR 7\n"
    counts = parse_aer_counters(text)
    assert dict(counts.counts) == {"Receiver Error": 2, "Bad TLP": 0, "RELAY_NUM Rollover": 1, "dev_cor_errs_bit[9]": 4}
    assert counts.total == 7
    assert parse_aer_counters("RxErr 1\nBadTLP 2\n").total == 3


@pytest.mark.parametrize("text", ["", "RxErr\n", "RxErr x\n", "TOTAL_ERR_COR -1\n", " 5\n"])
def test_parse_aer_malformed(text: str) -> None:
    with pytest.raises(ProbeParseError):
        parse_aer_counters(text)


@pytest.mark.parametrize(
    ("text", "gts"),
    [
        ("16.0 GT/s PCIe\n", 16.0),
        ("8 GT/s\n", 8.0),
        ("2.5 GT/s PCIe\n", 2.5),
        ("32.0 GT/s PCIe\n", 32.0),
        ("Unknown\n", None),
        ("Unknown speed\n", None),
        ("", None),
    ],
)
def test_parse_link_speed(text: str, gts: float | None) -> None:
    assert parse_link_speed(text) == gts


# --- discovery -------------------------------------------------------------------------------------


def test_discover_functions_and_their_ports(tree: SysTree) -> None:
    functions = discover_functions(tree.root, {0x19E5}, set())
    roles = {f.address: (f.role, f.upstream, tuple(f.below)) for f in functions}
    assert roles == {
        "0000:01:00.0": ("endpoint", "0000:00:01.0", ()),
        "0000:83:00.0": ("endpoint", "0000:82:00.0", ()),
        "0000:00:01.0": ("port", None, ("0000:01:00.0",)),
        "0000:82:00.0": ("port", None, ("0000:83:00.0",)),
    }
    assert [f.address for f in discover_functions(tree.root, {0x19E5}, {0xD500})] == []
    assert {f.address for f in discover_functions(tree.root, {0x19E5}, set(), upstream_ports=False)} == {
        "0000:01:00.0",
        "0000:83:00.0",
    }


def test_no_matching_function_skips_with_reason(tree: SysTree, tmp_path: Path) -> None:
    probe = PcieProbe()
    reason = probe.applicable(ctx_for(tree, vendors=["0x1d17"]))
    assert reason is not None and "0x1d17" in reason
    out = probe.run(ctx_for(tree, vendors=["0x1d17"]))
    assert {(f.check, f.status) for f in out if isinstance(f, Finding)} == {
        ("pcie.aer", Status.SKIP),
        ("pcie.link", Status.SKIP),
    }
    empty = ProbeContext(Host(sys=tmp_path / "nosys"), parse_config({}), 5.0)
    assert "no PCI bus" in (probe.applicable(empty) or "")
    assert probe.applicable(ctx_for(tree)) is None


# --- pcie.aer --------------------------------------------------------------------------------------


def test_clean_counters_are_ok_and_exported(tree: SysTree) -> None:
    out = PcieProbe(Clock()).run(ctx_for(tree))
    aer = findings(out, "pcie.aer")
    assert set(aer) == {"0000:01:00.0", "0000:83:00.0", "0000:00:01.0", "0000:82:00.0"}
    assert all(f.status == Status.OK for f in aer.values())
    assert aer["0000:01:00.0"].category == "npu"
    assert aer["0000:00:01.0"].category == "npu"  # the port above an NPU
    counters = samples(out, "nodehealth_pcie_aer_errors_total")
    assert len(counters) == 4 * 3
    assert all(s.kind == "counter" and s.value == 0 for s in counters.values())


def test_new_fatal_fails_and_holds_then_becomes_history(tree: SysTree) -> None:
    clock = Clock()
    probe = PcieProbe(clock)
    ctx = ctx_for(tree, hold_seconds=600)
    npu = tree.root / "devices" / Path(*NPU0)
    assert findings(probe.run(ctx), "pcie.aer")["0000:01:00.0"].status == Status.OK

    clock.now += 30
    tree.set_aer(npu, fatal={"SDES": 1})
    out = probe.run(ctx)
    finding = findings(out, "pcie.aer")["0000:01:00.0"]
    assert (finding.status, finding.reason) == (Status.FAIL, "PcieFatalErrors")
    assert finding.observed["new_fatal"] == 1
    assert "SDES 1" in finding.observed["fatal_errors"]
    assert finding.hint
    fatal = (("pci_bus_id", "0000:01:00.0"), ("severity", "fatal"))
    assert samples(out, "nodehealth_pcie_aer_errors_total")[fatal].value == 1
    # the other NPU and its ports stay ok
    assert findings(out, "pcie.aer")["0000:83:00.0"].status == Status.OK

    clock.now += 300  # no new errors, still within the hold
    assert findings(probe.run(ctx), "pcie.aer")["0000:01:00.0"].reason == "PcieFatalErrors"
    clock.now += 301  # hold over: the count since boot remains, as a warning
    finding = findings(probe.run(ctx), "pcie.aer")["0000:01:00.0"]
    assert (finding.status, finding.reason) == (Status.WARN, "PcieErrorHistory")


def test_counts_present_at_start_are_history_not_failure(tree: SysTree) -> None:
    npu = tree.root / "devices" / Path(*NPU1)
    tree.set_aer(npu, fatal={"CmpltTO": 2}, nonfatal={"UnsupReq": 1}, correctable={"RxErr": 5000})
    probe = PcieProbe(Clock())
    finding = findings(probe.run(ctx_for(tree)), "pcie.aer")["0000:83:00.0"]
    assert (finding.status, finding.reason) == (Status.WARN, "PcieErrorHistory")
    assert finding.observed["fatal_total"] == 2
    assert finding.observed["nonfatal_total"] == 1


def test_new_nonfatal_on_upstream_port_warns(tree: SysTree) -> None:
    """The ABI doc: errors may be counted at the link partner while the endpoint shows zeros."""
    clock = Clock()
    probe = PcieProbe(clock)
    ctx = ctx_for(tree)
    probe.run(ctx)
    port = tree.root / "devices" / Path(*NPU1[:4])
    tree.set_aer(port, nonfatal={"CmpltTO": 3})
    clock.now += 30
    aer = findings(probe.run(ctx), "pcie.aer")
    assert (aer["0000:82:00.0"].status, aer["0000:82:00.0"].reason) == (Status.WARN, "PcieNonFatalErrors")
    assert "0000:83:00.0" in aer["0000:82:00.0"].message
    assert aer["0000:83:00.0"].status == Status.OK


def test_correctable_burst_rate(tree: SysTree) -> None:
    clock = Clock()
    probe = PcieProbe(clock)
    ctx = ctx_for(tree, correctable_burst_per_minute=10, hold_seconds=120)
    npu = tree.root / "devices" / Path(*NPU0)
    probe.run(ctx)
    # 8 in a minute: below the rate
    clock.now += 60
    tree.set_aer(npu, correctable={"RxErr": 8})
    assert findings(probe.run(ctx), "pcie.aer")["0000:01:00.0"].status == Status.OK
    # 12 more within 5 s: counted over at least a minute → 12/min, above 10
    clock.now += 5
    tree.set_aer(npu, correctable={"RxErr": 15, "BadTLP": 5})
    finding = findings(probe.run(ctx), "pcie.aer")["0000:01:00.0"]
    assert (finding.status, finding.reason) == (Status.WARN, "PcieCorrectableBurst")
    assert finding.observed["correctable_per_minute"] == 12.0
    # corrected errors alone never leave a history warning
    clock.now += 121
    assert findings(probe.run(ctx), "pcie.aer")["0000:01:00.0"].status == Status.OK


def test_counter_reset_is_a_new_baseline(tree: SysTree) -> None:
    clock = Clock()
    probe = PcieProbe(clock)
    ctx = ctx_for(tree)
    npu = tree.root / "devices" / Path(*NPU0)
    tree.set_aer(npu, correctable={"RxErr": 500})
    probe.run(ctx)
    clock.now += 30
    tree.set_aer(npu, correctable={"RxErr": 2})  # the device was re-enumerated
    assert findings(probe.run(ctx), "pcie.aer")["0000:01:00.0"].status == Status.OK
    clock.now += 60
    tree.set_aer(npu, correctable={"RxErr": 40})
    assert findings(probe.run(ctx), "pcie.aer")["0000:01:00.0"].reason == "PcieCorrectableBurst"


def test_missing_aer_files_are_unsupported_and_malformed_are_unknown(tree: SysTree) -> None:
    sas = tree.add(["pci0000:74", "0000:74:02.0"], "0x19e5", "0xa222", "0x010700", link=None, aer=False)
    npu = tree.root / "devices" / Path(*NPU0)
    (npu / "aer_dev_fatal").write_text("TOTAL_ERR_FATAL lots\n")
    out = PcieProbe(Clock()).run(ctx_for(tree))
    aer = findings(out, "pcie.aer")
    link = findings(out, "pcie.link")
    assert (aer["0000:74:02.0"].status, aer["0000:74:02.0"].reason) == (Status.SKIP, "Unsupported")
    assert (link["0000:74:02.0"].status, link["0000:74:02.0"].reason) == (Status.SKIP, "Unsupported")
    assert "0000:74:02.0" not in {dict(s.labels).get("pci_bus_id") for s in out if isinstance(s, Sample)}
    assert (aer["0000:01:00.0"].status, aer["0000:01:00.0"].reason) == (Status.UNKNOWN, "ParseError")
    assert aer["0000:83:00.0"].status == Status.OK
    assert sas.is_dir()


# --- pcie.link -------------------------------------------------------------------------------------


def test_link_degraded_width_and_speed(tree: SysTree) -> None:
    npu0 = tree.root / "devices" / Path(*NPU0)
    port0 = tree.root / "devices" / Path(*NPU0[:2])
    tree.set_link(npu0, 8, 16, "16.0 GT/s PCIe", "16.0 GT/s PCIe")
    tree.set_link(port0, 8, 16, "16.0 GT/s PCIe", "16.0 GT/s PCIe")
    npu1 = tree.root / "devices" / Path(*NPU1)
    tree.set_link(npu1, 16, 16, "8.0 GT/s PCIe", "16.0 GT/s PCIe")
    out = PcieProbe(Clock()).run(ctx_for(tree))
    link = findings(out, "pcie.link")
    assert (link["0000:01:00.0"].status, link["0000:01:00.0"].reason) == (Status.WARN, "PcieLinkDegraded")
    assert "x8 of x16" in link["0000:01:00.0"].message
    assert "0000:01:00.0" in link["0000:01:00.0"].hint
    assert link["0000:00:01.0"].reason == "PcieLinkDegraded"
    assert link["0000:83:00.0"].reason == "PcieLinkDegraded"
    assert "8 GT/s of 16 GT/s" in link["0000:83:00.0"].message
    widths = samples(out, "nodehealth_pcie_link_width_lanes")
    assert widths[(("pci_bus_id", "0000:01:00.0"),)].value == 8
    assert samples(out, "nodehealth_pcie_link_max_width_lanes")[(("pci_bus_id", "0000:01:00.0"),)].value == 16
    speeds = samples(out, "nodehealth_pcie_link_speed_transfers_per_second")
    assert speeds[(("pci_bus_id", "0000:83:00.0"),)].value == 8e9
    max_speeds = samples(out, "nodehealth_pcie_link_max_speed_transfers_per_second")
    assert max_speeds[(("pci_bus_id", "0000:83:00.0"),)].value == 16e9
    # speed may drop for power saving on some devices: the speed comparison can be turned off
    link = findings(PcieProbe(Clock()).run(ctx_for(tree, link_speed_check=False)), "pcie.link")
    assert link["0000:83:00.0"].status == Status.OK
    assert link["0000:01:00.0"].status == Status.WARN


def test_link_expectation_is_what_both_ends_support(tree: SysTree) -> None:
    """A x16 Gen5 card in a x8 Gen4 slot trained x8 Gen4 is as good as it gets: ok."""
    npu0 = tree.root / "devices" / Path(*NPU0)
    port0 = tree.root / "devices" / Path(*NPU0[:2])
    tree.set_link(npu0, 8, 16, "16.0 GT/s PCIe", "32.0 GT/s PCIe")
    tree.set_link(port0, 8, 8, "16.0 GT/s PCIe", "16.0 GT/s PCIe")
    link = findings(PcieProbe(Clock()).run(ctx_for(tree)), "pcie.link")
    assert link["0000:01:00.0"].status == Status.OK, link["0000:01:00.0"].message
    assert link["0000:01:00.0"].observed["expected_width"] == 8
    assert link["0000:00:01.0"].status == Status.OK
    # the same without checking ports still takes the slot's capability into account
    link = findings(PcieProbe(Clock()).run(ctx_for(tree, upstream_ports=False)), "pcie.link")
    assert set(link) == {"0000:01:00.0", "0000:83:00.0"}
    assert link["0000:01:00.0"].status == Status.OK


def test_link_down_is_degraded(tree: SysTree) -> None:
    npu1 = tree.root / "devices" / Path(*NPU1)
    tree.set_link(npu1, 0, 16, "Unknown", "16.0 GT/s PCIe")
    link = findings(PcieProbe(Clock()).run(ctx_for(tree)), "pcie.link")
    assert link["0000:83:00.0"].reason == "PcieLinkDegraded"
    assert "link down" in link["0000:83:00.0"].message


def test_device_ids_filter(tree: SysTree) -> None:
    tree.add(["pci0000:90", "0000:90:00.0", "0000:91:00.0"], "0x19e5", "0x1822", "0x020000")
    out = PcieProbe(Clock()).run(ctx_for(tree, device_ids=["0xd802"], upstream_ports=False))
    assert set(findings(out, "pcie.aer")) == {"0000:01:00.0", "0000:83:00.0"}
    out = PcieProbe(Clock()).run(ctx_for(tree, upstream_ports=False))
    assert "0000:91:00.0" in findings(out, "pcie.aer")


# --- end to end --------------------------------------------------------------------------------------


def test_cli_check_json_on_a_sysfs_tree(tree: SysTree, tmp_path: Path) -> None:
    """`node-health check --json --only pcie` with host.sys pointing at the tree: a fatal count found at start
    is a warning (ready), a trained-down link too; a bad vendor id in the config exits 2 naming the key."""
    tree.set_aer(tree.root / "devices" / Path(*NPU0), fatal={"DLP": 1})
    for chain in (NPU1, NPU1[:4]):  # both ends of one link report its width
        tree.set_link(tree.root / "devices" / Path(*chain), 4, 16, "16.0 GT/s PCIe", "16.0 GT/s PCIe")
    config = tmp_path / "config.yaml"
    config.write_text(f"host: {{sys: {tree.root}}}\npcie: {{vendors: ['0x19e5']}}\nkubernetes: {{enabled: false}}\n")
    cli = [sys.executable, "-m", "agent.cli", "check", "--json", "--config", str(config), "--only", "pcie"]
    result = subprocess.run(cli, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)
    assert document["ready"] is True
    got = {(f["check"], f["subject"]): (f["status"], f["reason"]) for f in document["findings"]}
    assert got[("pcie.aer", "0000:01:00.0")] == ("warn", "PcieErrorHistory")
    assert got[("pcie.link", "0000:83:00.0")] == ("warn", "PcieLinkDegraded")
    assert got[("pcie.link", "0000:82:00.0")] == ("warn", "PcieLinkDegraded")  # the port sees the same link
    assert got[("pcie.aer", "0000:83:00.0")] == ("ok", "OK")
    assert {f["category"] for f in document["findings"]} == {"npu"}

    config.write_text("pcie: {vendors: [huawei]}\n")
    result = subprocess.run(cli, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2
    assert "pcie.vendors" in result.stderr


# --- findings tied to the accelerator on the bus ---------------------------------------------------------


def ready(output: list[Finding | Sample], devices: set[int] | None) -> bool:
    """What /ready?devices= answers for this output, through the agent's own state and verdict."""
    state = HealthState("node-a", HealthSettings(fail_threshold=1, recovery_threshold=1))
    state.configure([ProbeSpec("pcie", PcieProbe.checks, 30.0, 5.0)])
    state.record("pcie", [item for item in output if isinstance(item, Finding)])
    query = ReadyQuery(device_indices=None if devices is None else frozenset(devices))
    return judge(state.current(), query).ready


def test_errors_on_an_npu_or_the_port_above_it_carry_the_device(tree: SysTree) -> None:
    """Field failure: an error on npu1's bus named only the PCI address and refused /ready?devices=2,3."""
    clock = Clock()
    probe = PcieProbe(clock)
    ctx = ctx_for(tree)
    # as the npu probe publishes them: logical id, name and npu-smi's Bus-Id
    ctx.host.devices.publish("npu", [(0, "npu0", "0000:01:00.0"), (1, "npu1", "0000:83:00.0")])
    probe.run(ctx)
    tree.set_aer(tree.root / "devices" / Path(*NPU1[:4]), fatal={"SDES": 1})
    clock.now += 30
    out = probe.run(ctx)
    aer = findings(out, "pcie.aer")
    port = aer["0000:82:00.0"]
    assert (port.status, port.reason, port.device, port.category) == (Status.FAIL, "PcieFatalErrors", 1, "npu")
    assert port.message.startswith("npu1 (0000:83:00.0), port 0000:82:00.0 above it: 1 new fatal PCIe error")
    assert port.observed["accelerator"] == "npu1"
    assert port.observed["pci_bus_id"] == "0000:83:00.0", "the device's own Bus-Id, not the port's: what DRA matches"
    npu1 = aer["0000:83:00.0"]
    assert (npu1.status, npu1.device) == (Status.OK, 1)
    assert npu1.message.startswith("npu1 (0000:83:00.0): no uncorrectable PCIe errors")
    assert (aer["0000:01:00.0"].device, aer["0000:00:01.0"].device) == (0, 0)
    link = findings(out, "pcie.link")
    assert link["0000:82:00.0"].device == 1 and link["0000:83:00.0"].message.startswith("npu1 (0000:83:00.0): link")
    assert ready(out, {0})  # a job on the node's other device is not refused
    assert not ready(out, {0, 2, 3})  # devices 2 and 3 are not this node's: NoSuchDevice, never ready on a guess
    assert not ready(out, {1}) and not ready(out, None)


def test_a_port_above_several_accelerators_reports_for_each(tree: SysTree) -> None:
    """Two NPU functions of one card below one port: one finding per device, so each device's jobs see it."""
    card = ["pci0000:90", "0000:90:00.0"]
    tree.add(card, "0x8086", "0x347a", "0x060400")
    tree.add([*card, "0000:91:00.0"], "0x19e5", "0xd500", "0x120000")
    tree.add([*card, "0000:91:00.1"], "0x19e5", "0xd500", "0x120000")
    tree.set_link(tree.root / "devices" / Path(*card), 4, 16, "16.0 GT/s PCIe", "16.0 GT/s PCIe")
    ctx = ctx_for(tree)
    ctx.host.devices.publish("npu", [(2, "npu2", "0000:91:00.0"), (3, "npu3", "0000:91:00.1")])
    out = PcieProbe(Clock()).run(ctx)
    link = findings(out, "pcie.link")
    assert "0000:90:00.0" not in link
    for subject, device in (("0000:90:00.0/npu2", 2), ("0000:90:00.0/npu3", 3)):
        finding = link[subject]
        assert (finding.status, finding.reason, finding.device) == (Status.WARN, "PcieLinkDegraded", device)
        assert finding.message.startswith(f"npu{device} (0000:91:00.{device - 2}), port 0000:90:00.0 above it:")
    # samples stay one set per function: 3 AER severities and 4 link gauges
    assert len([s for s in out if isinstance(s, Sample) and s.labels.get("pci_bus_id") == "0000:90:00.0"]) == 7
    assert findings(out, "pcie.aer")["0000:91:00.1"].device == 3


def test_a_gpu_published_in_nvml_spelling_ties_its_findings(tree: SysTree) -> None:
    gpu = ["pci0000:3a", "0000:3a:00.0", "0000:3b:00.0"]
    tree.add(gpu[:2], "0x8086", "0x347a", "0x060400")
    tree.add(gpu, "0x10de", "0x2330", "0x030200")
    tree.set_link(tree.root / "devices" / Path(*gpu), 8, 16, "32.0 GT/s PCIe", "32.0 GT/s PCIe")
    ctx = ctx_for(tree, vendors=["0x10de"])
    # NVML's Bus-Id has an 8-digit domain and capitals; a published device absent from this sysfs is ignored
    ctx.host.devices.publish("gpu", [(5, "gpu5", "00000000:3B:00.0"), (6, "gpu6", "00000000:DB:00.0")])
    link = findings(PcieProbe(Clock()).run(ctx), "pcie.link")
    degraded = link["0000:3b:00.0"]
    assert (degraded.reason, degraded.device, degraded.category) == ("PcieLinkDegraded", 5, "gpu")
    assert degraded.message == "gpu5 (0000:3b:00.0): PCIe link degraded: x8 of x16 lanes"
    assert link["0000:3a:00.0"].device == 5


def test_without_a_published_device_findings_are_node_wide(tree: SysTree) -> None:
    out = PcieProbe(Clock()).run(ctx_for(tree))
    assert all(f.device is None for f in out if isinstance(f, Finding))
    assert findings(out, "pcie.aer")["0000:83:00.0"].message.startswith("0000:83:00.0 (endpoint): ")


def test_series_name_the_address_pci_bus_id_as_npu_smi_prints_it() -> None:
    """The NPU series' and npu-exporter's form (upper-case hex), so the PCIe series join them without
    label_replace; findings keep the kernel's lower-case form."""
    from probes.pcie.pcie import link_samples, series_labels
    from probes.pcie.sysfs import LinkState

    assert series_labels("0000:c1:00.0") == {"pci_bus_id": "0000:C1:00.0"}
    assert {s.labels["pci_bus_id"] for s in link_samples("0000:3b:00.0", LinkState(16, 16, 16.0, 16.0))} == {
        "0000:3B:00.0"
    }
