"""kernel.log rules: the rule engine's windows and quiet periods, the default rules against the kernel's own
spellings, and rule config validation (reasons that fit Kubernetes)."""

from __future__ import annotations

import pytest

from agent.config import ConfigError, parse_config
from probes.base import Status
from probes.kernel.config import RESERVED_REASONS, KernelLogRule
from probes.kernel.default_rules import DEFAULT_RULES
from probes.kernel.log import KernelLogProbe
from probes.kernel.rules import RuleEngine

# --- rules ---------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _rule(**kw: object) -> KernelLogRule:
    return KernelLogRule.model_validate({"reason": "Boom", "pattern": "boom", **kw})


def _by_reason(engine: RuleEngine) -> dict[str, object]:
    return {f.subject: f for f in engine.findings()}


def test_rule_fires_only_with_count_matches_within_window() -> None:
    clock = FakeClock()
    engine = RuleEngine([_rule(count=3, window_seconds=10)], quiet_period_seconds=100, clock=clock)
    engine.observe("boom 1")
    clock.now += 6
    engine.observe("boom 2")
    clock.now += 6  # the first match left the window
    engine.observe("boom 3")
    finding = _by_reason(engine)["Boom"]
    assert finding.status is Status.OK  # type: ignore[attr-defined]
    assert finding.observed["matches_in_window"] == 2  # type: ignore[attr-defined]
    assert "below the 3" in finding.message  # type: ignore[attr-defined]
    clock.now += 1
    engine.observe("boom 4")
    finding = _by_reason(engine)["Boom"]
    assert finding.status is Status.WARN  # type: ignore[attr-defined]
    assert finding.reason == "Boom"  # type: ignore[attr-defined]
    assert "boom 4" in finding.message  # type: ignore[attr-defined]
    assert finding.observed["matches_total"] == 4  # type: ignore[attr-defined]


def test_problem_clears_after_quiet_period_and_new_match_extends_it() -> None:
    clock = FakeClock()
    engine = RuleEngine([_rule(status="fail")], quiet_period_seconds=30, clock=clock)
    engine.observe("boom")
    assert _by_reason(engine)["Boom"].status is Status.FAIL  # type: ignore[attr-defined]
    clock.now += 20
    engine.observe("boom again")
    clock.now += 20  # 40 s after the first match, 20 s after the last: still active
    finding = _by_reason(engine)["Boom"]
    assert finding.status is Status.FAIL  # type: ignore[attr-defined]
    assert finding.observed["matches_while_active"] == 2  # type: ignore[attr-defined]
    assert finding.observed["clears_in_seconds"] == 10  # type: ignore[attr-defined]
    clock.now += 10
    assert _by_reason(engine)["Boom"].status is Status.OK  # type: ignore[attr-defined]


def test_permanent_rule_fails_and_still_clears() -> None:
    clock = FakeClock()
    engine = RuleEngine([_rule(type="permanent", status="warn", quiet_period_seconds=5)], 1000, clock=clock)
    engine.observe("boom")
    assert _by_reason(engine)["Boom"].status is Status.FAIL  # type: ignore[attr-defined]
    clock.now += 5
    assert _by_reason(engine)["Boom"].status is Status.OK  # type: ignore[attr-defined]


def test_recover_pattern_clears_at_once() -> None:
    clock = FakeClock()
    rules = [KernelLogRule.model_validate(r) for r in DEFAULT_RULES if r["reason"] == "NfsServerNotResponding"]
    engine = RuleEngine(rules, 3600, clock=clock)
    engine.observe("nfs: server 10.0.0.5 not responding, still trying")
    finding = _by_reason(engine)["NfsServerNotResponding"]
    assert finding.status is Status.WARN and finding.observed["server"] == "10.0.0.5"  # type: ignore[attr-defined]
    assert finding.category == "storage"  # type: ignore[attr-defined]
    clock.now += 1
    engine.observe("nfs: server 10.0.0.5 OK")
    assert _by_reason(engine)["NfsServerNotResponding"].status is Status.OK  # type: ignore[attr-defined]


def test_gpu_xid_fatal_values_fail_others_warn() -> None:
    clock = FakeClock()
    rules = [KernelLogRule.model_validate(r) for r in DEFAULT_RULES if r["reason"] == "GpuXid"]
    engine = RuleEngine(rules, 60, clock=clock)
    engine.observe("NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python, Graphics SM Warp Exception")
    finding = _by_reason(engine)["GpuXid"]
    assert finding.status is Status.WARN  # type: ignore[attr-defined]
    assert finding.observed["xid"] == "13" and finding.category == "gpu"  # type: ignore[attr-defined]
    engine.observe("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.")
    finding = _by_reason(engine)["GpuXid"]
    assert finding.status is Status.FAIL  # type: ignore[attr-defined]
    assert finding.observed["xid"] == "79"  # type: ignore[attr-defined]
    assert finding.observed["xid_values"] == ["13", "79"]  # type: ignore[attr-defined]
    assert finding.observed["pci"] == "0000:3b:00"  # type: ignore[attr-defined]
    clock.now += 60
    engine.observe("NVRM: Xid (0000:18:00): 31, pid=1, Ch 00000010, intr 10000000. MMU Fault")  # older spelling
    finding = _by_reason(engine)["GpuXid"]
    assert finding.status is Status.WARN and finding.observed["xid"] == "31"  # type: ignore[attr-defined]


def test_long_lines_are_truncated_in_the_message() -> None:
    engine = RuleEngine([_rule()], 60, clock=FakeClock(), max_line_chars=50)
    engine.observe("boom " + "x" * 500)
    finding = _by_reason(engine)["Boom"]
    assert len(finding.message) < 150  # type: ignore[attr-defined]


# Lines in the kernel's own formats (drivers/pci/pcie/aer.c old and new, NVRM, mm/oom_kill.c,
# kernel/hung_task.c, fs/nfs, fs/ext4, fs/xfs); the Ascend one follows the driver's printk prefix.
SAMPLE_LINES = [
    ("pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:01:00.0", {"PcieAerFatal"}),
    ("pcieport 0000:00:01.0: AER: Multiple Uncorrected (Fatal) error received: id=0010", {"PcieAerFatal"}),
    ("pcieport 0000:00:03.1: AER: Uncorrectable (Fatal) error message received from 0000:3b:00.0", {"PcieAerFatal"}),
    (
        "nvidia 0000:3b:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Inaccessible, (Unregistered Agent ID)",
        {"PcieAerFatal"},
    ),
    ("pcieport 0000:00:1c.0: AER: Uncorrected (Non-Fatal) error received: 0000:02:00.0", {"PcieAerNonFatal"}),
    ("pcieport 0000:00:1c.5: AER: Corrected error message received from 0000:00:1c.5", {"PcieCorrectableBurst"}),
    ("pcieport 0000:00:1c.5: AER: Multiple Corrected error received: 0000:00:1c.5", {"PcieCorrectableBurst"}),
    (
        "pcieport 0000:00:1c.5: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)",
        {"PcieCorrectableBurst"},
    ),
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.", {"GpuXid"}),
    (
        "[ascend] [drv_pcie] [devdrv_heartbeat_check 812] <swapper/0:0:0> dev_id 3 heartbeat lost",
        {"NpuDriverHeartbeatLost"},
    ),
    (
        "[ascend] [ERROR] [drv_pcie] [devdrv_dma_copy 455] <python3:1234:1234> dma copy timeout, dev_id=0",
        {"NpuDriverError"},
    ),
    ("Out of memory: Killed process 4321 (python3) total-vm:1234kB, anon-rss:999kB", {"OomKill"}),
    ("Memory cgroup out of memory: Killed process 77 (python) total-vm:10kB, anon-rss:5kB", {"OomKill"}),
    ("Out of memory: Kill process 4321 (python3) score 900 or sacrifice child", {"OomKill"}),
    ("INFO: task python3:1234 blocked for more than 120 seconds.", {"HungTask"}),
    ("INFO: task kworker/u16:2:87 blocked for more than 241 seconds.", {"HungTask"}),
    ("nfs: server 10.0.0.5 not responding, still trying", {"NfsServerNotResponding"}),
    ("nfs: server nas01 not responding, timed out", {"NfsServerNotResponding"}),
    ("EXT4-fs error (device sda1): ext4_find_entry:1455: inode #2: comm ls: reading directory lblock 0", {"Ext4Error"}),
    ("EXT4-fs (sdb1): Remounting filesystem read-only", {"Ext4Error"}),
    ('XFS (sdb1): metadata I/O error in "xfs_trans_read_buf_map" at daddr 0x2 len 1 error 5', {"XfsError"}),
    ("XFS (dm-0): Corruption detected. Unmount and run xfs_repair", {"XfsError"}),
    ("XFS (sdc): Filesystem has been shut down due to log error (0x2).", {"XfsError"}),
    # Healthy lines that must not match.
    ("XFS (sdb1): Mounting V5 Filesystem 1b2c-...", set()),
    ("XFS (sdb1): Ending clean mount", set()),
    ("EXT4-fs (sda1): mounted filesystem with ordered data mode. Quota mode: none.", set()),
    ("nfs: server 10.0.0.5 OK", set()),
    ("NET: Registered protocol family 10", set()),
    ("pcieport 0000:00:1c.5: AER: enabled with IRQ 122", set()),
    ("[ascend] [drv_pcie] [devdrv_probe 120] <modprobe:1:1> probe device 0 ok", set()),
]


@pytest.mark.parametrize(("line", "reasons"), SAMPLE_LINES)
def test_default_rules_match_kernel_spellings(line: str, reasons: set[str]) -> None:
    engine = RuleEngine([KernelLogRule.model_validate(rule) for rule in DEFAULT_RULES], 60, clock=FakeClock())
    assert set(engine.observe(line)) == reasons


def test_rule_config_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"kernel_log\.rules\[0\]\.pattern"):
        parse_config({"kernel_log": {"rules": [{"reason": "Bad", "pattern": "(unclosed"}]}})
    with pytest.raises(ConfigError, match=r"kernel_log\.rules\[0\]\.type"):
        parse_config({"kernel_log": {"rules": [{"reason": "Bad", "pattern": "x", "type": "sticky"}]}})
    config = parse_config({"kernel_log": {"extra_rules": [{"reason": "MyDriver", "pattern": "mydrv: fault"}]}})
    reasons = [r.reason for r in config.kernel_log.rules] + [r.reason for r in config.kernel_log.extra_rules]
    assert "GpuXid" in reasons and "MyDriver" in reasons


def test_rule_reason_must_fit_a_taint_value_and_a_condition_reason() -> None:
    longest = "A" + "b" * 62
    config = parse_config({"kernel_log": {"extra_rules": [{"reason": longest, "pattern": "x"}]}})
    assert config.kernel_log.extra_rules[0].reason == longest
    for bad in ["A" + "b" * 63, "lowerCase", "With Space", "Dotted.Reason", "Trailing\n", "Dash-Case", ""]:
        with pytest.raises(ConfigError, match=r"kernel_log\.extra_rules\[0\]\.reason") as raised:
            parse_config({"kernel_log": {"extra_rules": [{"reason": bad, "pattern": "x"}]}})
        assert "63 characters" in str(raised.value)
    with pytest.raises(ConfigError, match=r"kernel_log\.rules\[0\]\.reason.*kernel\.log probe itself"):
        parse_config({"kernel_log": {"rules": [{"reason": "OK", "pattern": "x"}]}})


def test_default_rule_reasons_are_declared_with_their_statuses() -> None:
    declared = {reason.code: reason for reason in KernelLogProbe.declared_reasons()}
    assert {rule["reason"] for rule in DEFAULT_RULES} <= set(declared)
    assert declared["GpuXid"].statuses == (Status.WARN, Status.FAIL)  # warn, fail for the fatal XIDs
    assert declared["Ext4Error"].statuses == (Status.FAIL,)  # permanent
    assert declared["OomKill"].statuses == (Status.WARN,)
    assert all(declared[rule["reason"]].meaning and declared[rule["reason"]].hint for rule in DEFAULT_RULES)
    own = {"KernelLogUnavailable", "KernelLogReadFailed", "OK", "NotApplicable", "ParseError"}
    assert own <= set(declared) and own == set(RESERVED_REASONS)
