"""kernel.log: /dev/kmsg records, the non-blocking reader, the rule engine and the probe."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.system import require, require_root, require_tool

from agent.config import ConfigError, parse_config
from probes.base import ProbeContext, Sample, Status
from probes.kernel.config import KernelLogRule
from probes.kernel.log import (
    DEFAULT_RULES,
    KernelLogProbe,
    KmsgReader,
    RuleEngine,
    parse_kmsg_record,
    split_records,
)
from probes.runtime.host import Host

# --- parsing -------------------------------------------------------------------------------------------


def test_parse_kernel_record() -> None:
    record = parse_kmsg_record(b"6,339,5140900,-;NET: Registered protocol family 10\n")
    assert record is not None
    assert (record.facility, record.level, record.sequence, record.timestamp_usec) == (0, 6, 339, 5140900)
    assert record.flags == "-"
    assert record.message == "NET: Registered protocol family 10"
    assert record.from_kernel
    assert record.properties == {}


def test_parse_continuation_lines() -> None:
    # The example of Documentation/ABI/testing/dev-kmsg.
    raw = (
        b"7,160,424069,-;pci_root PNP0A03:00: host bridge window [io  0x0000-0x0cf7] (ignored)\n"
        b" SUBSYSTEM=acpi\n"
        b" DEVICE=+acpi:PNP0A03:00\n"
    )
    record = parse_kmsg_record(raw)
    assert record is not None
    assert record.message == "pci_root PNP0A03:00: host bridge window [io  0x0000-0x0cf7] (ignored)"
    assert record.properties == {"SUBSYSTEM": "acpi", "DEVICE": "+acpi:PNP0A03:00"}
    assert record.level == 7 and record.facility == 0


def test_parse_escapes_and_extra_prefix_fields() -> None:
    record = parse_kmsg_record(b"4,5,6,c,caller=T12;first\\x0asecond \\x5c end \\xe2\\x9c\\x93\n DEVICE=k\\x3d1\n")
    assert record is not None
    assert record.message == "first\nsecond \\ end \u2713"
    assert record.flags == "c"
    assert record.properties == {"DEVICE": "k=1"}


def test_parse_user_facility_is_not_kernel() -> None:
    # What a write of "<3>text" to /dev/kmsg becomes: the kernel forces facility 1 (user) on it.
    record = parse_kmsg_record(b"11,1203,98765,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n")
    assert record is not None
    assert record.facility == 1 and record.level == 3
    assert not record.from_kernel


@pytest.mark.parametrize(
    "raw",
    [b"", b"garbage", b"x,1,2,-;msg\n", b"6,1;msg\n", b"6,1,2;msg\n", b"-6,1,2,-;msg\n", b"6,1,2,-\n"],
)
def test_parse_malformed_is_none(raw: bytes) -> None:
    assert parse_kmsg_record(raw) is None


def test_split_records_keeps_partial_tail() -> None:
    stream = b"6,1,10,-;one\n SUBSYSTEM=pci\n6,2,20,-;two\n6,3,3"
    records, rest = split_records(stream)
    assert records == [b"6,1,10,-;one\n SUBSYSTEM=pci", b"6,2,20,-;two"]
    assert rest == b"6,3,3"
    records, rest = split_records(rest + b"0,-;three\n")
    assert [parse_kmsg_record(r).message for r in records] == ["three"]  # type: ignore[union-attr]
    assert rest == b""


def test_parse_every_record_of_the_real_kernel_log() -> None:
    require(os.access("/dev/kmsg", os.R_OK), "readable /dev/kmsg")
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    records = []
    try:
        for _ in range(2000):
            try:
                raw = os.read(fd, 16384)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue
                raise
            records.append((raw, parse_kmsg_record(raw)))
    finally:
        os.close(fd)
    assert records, "the kernel log is empty"
    for raw, record in records:
        assert record is not None, raw
    sequences = [record.sequence for _, record in records]  # type: ignore[union-attr]
    assert sequences == sorted(sequences)
    assert any(record.from_kernel for _, record in records)  # type: ignore[union-attr]


# --- the reader ----------------------------------------------------------------------------------------


def _append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def test_reader_regular_file_starts_at_end_and_filters_facility(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_bytes(b"3,1,100,-;EXT4-fs error (device sda1): written before the reader opened\n")
    reader = KmsgReader(log)
    try:
        first = reader.read_available()
        assert (first.records, first.read) == ([], 0)
        _append(log, b"6,2,200,-;kernel line\n SUBSYSTEM=pci\n14,3,300,-;user line\n6,4,4")
        second = reader.read_available()
        assert [r.message for r in second.records] == ["kernel line"]
        assert second.records[0].properties == {"SUBSYSTEM": "pci"}
        assert (second.read, second.ignored) == (2, 1)
        _append(log, b"00,-;completed later\n")  # the unterminated tail is kept until its newline arrives
        third = reader.read_available()
        assert [(r.sequence, r.timestamp_usec, r.message) for r in third.records] == [(4, 400, "completed later")]
    finally:
        reader.close()


def test_reader_bounds_one_run(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_bytes(b"")
    reader = KmsgReader(log)
    try:
        reader.open()
        _append(log, b"".join(b"6,%d,1,-;line %d\n" % (i, i) for i in range(50)))
        bounded = reader.read_available(max_records=10)
        assert bounded.truncated
        assert bounded.read >= 10
        rest = reader.read_available()
        assert not rest.truncated
        assert bounded.read + rest.read == 50
    finally:
        reader.close()


def test_reader_fifo_never_blocks(tmp_path: Path) -> None:
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)
    reader = KmsgReader(fifo)
    writer = -1
    try:
        reader.open()  # O_NONBLOCK: opening a FIFO for reading does not wait for a writer
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        started = time.monotonic()
        empty = reader.read_available()  # a writer is connected and silent: EAGAIN, not a hang
        assert empty.records == [] and time.monotonic() - started < 1.0
        os.write(writer, b"2,10,5,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n")
        os.write(writer, b"10,11,6,-;NVRM: Xid (PCI:0000:3b:00): 79, injected from userspace\n")
        got = reader.read_available()
        assert [r.sequence for r in got.records] == [10]
        assert got.ignored == 1
        assert time.monotonic() - started < 2.0
    finally:
        if writer >= 0:
            os.close(writer)
        reader.close()


def test_reader_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        KmsgReader(tmp_path / "absent").open()


# A FUSE file that answers reads the way /dev/kmsg does after an overrun: EPIPE once, then the oldest
# record still present, then EAGAIN. The reader must count the overrun and carry on.
_EPIPE_FS = textwrap.dedent(
    """
    import errno, stat, sys, time
    import mfusepy as fuse

    SCRIPT = [errno.EPIPE, b"6,900,1,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\\n",
              errno.EPIPE, b"6,950,2,-;oom-kill:constraint=CONSTRAINT_NONE\\n", errno.EAGAIN]

    class KmsgLike(fuse.Operations):
        use_ns = True
        def __init__(self):
            self.step = 0
        def getattr(self, path, fh=None):
            now = time.time_ns()
            times = {"st_atime": now, "st_mtime": now, "st_ctime": now}
            if path == "/":
                return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2, **times}
            if path == "/kmsg":
                return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": 0, **times}
            raise fuse.FuseOSError(errno.ENOENT)
        def readdir(self, path, fh):
            return [".", "..", "kmsg"]
        def open(self, path, flags):
            return 0
        def read(self, path, size, offset, fh):
            if self.step >= len(SCRIPT):
                raise fuse.FuseOSError(errno.EAGAIN)
            item = SCRIPT[self.step]
            self.step += 1
            if isinstance(item, int):
                raise fuse.FuseOSError(item)
            return item

    fuse.FUSE(KmsgLike(), sys.argv[1], foreground=True, direct_io=True, nothreads=True)
    """
)


@contextlib.contextmanager
def _epipe_fuse(mountpoint: Path) -> Iterator[Path]:
    require_root()
    require(Path("/dev/fuse").exists(), "/dev/fuse")
    fusermount = require_tool("fusermount3")
    mountpoint.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _EPIPE_FS, str(mountpoint)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"FUSE server did not mount: {proc.stderr.read() if proc.stderr else ''!r}")
            time.sleep(0.05)
        yield mountpoint / "kmsg"
    finally:
        subprocess.run([fusermount, "-u", "-z", str(mountpoint)], check=False, capture_output=True)
        proc.kill()
        proc.wait(timeout=10)


def test_reader_survives_epipe(tmp_path: Path) -> None:
    with _epipe_fuse(tmp_path / "mnt") as kmsg:
        reader = KmsgReader(kmsg)
        try:
            result = reader.read_available()
        finally:
            reader.close()
    assert result.overwritten == 2
    assert [r.sequence for r in result.records] == [900, 950]


def test_real_dev_kmsg_ignores_userspace_lines() -> None:
    require_root()
    require(os.path.exists("/dev/kmsg"), "/dev/kmsg")
    marker = f"node-health-test-{uuid.uuid4().hex}"
    injected = f"<2>NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name={marker}, GPU has fallen off the bus.\n"
    reader = KmsgReader("/dev/kmsg")
    raw_fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    try:
        reader.open()
        os.lseek(raw_fd, 0, os.SEEK_END)
        started = time.monotonic()
        before = reader.read_available()  # whatever the kernel logged meanwhile; must not block
        assert time.monotonic() - started < 1.0
        assert all(r.from_kernel for r in before.records)
        writer = os.open("/dev/kmsg", os.O_WRONLY)
        try:
            os.write(writer, injected.encode())
        finally:
            os.close(writer)
        # The line really is in the kernel log, with the user facility the kernel forces on writers.
        ours = []
        for _ in range(1000):
            try:
                record = parse_kmsg_record(os.read(raw_fd, 16384))
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue
                raise
            if record is not None and marker in record.message:
                ours.append(record)
        require(bool(ours), "/dev/kmsg accepting userspace lines (kernel.printk_devkmsg not off, not rate limited)")
        assert ours[0].facility == 1 and not ours[0].from_kernel
        started = time.monotonic()
        after = reader.read_available()
        assert time.monotonic() - started < 1.0
        assert after.read >= 1 and after.ignored >= 1
        assert not any(marker in r.message for r in after.records)
        engine = RuleEngine([KernelLogRule.model_validate(rule) for rule in DEFAULT_RULES], 60.0)
        engine.observe_all(r.message for r in after.records)
        assert engine.matches_total("GpuXid") == 0
    finally:
        os.close(raw_fd)
        reader.close()


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


# --- the probe -----------------------------------------------------------------------------------------


def _ctx(tmp_path: Path, **kernel_log: object) -> ProbeContext:
    config = parse_config({"kernel_log": kernel_log})
    return ProbeContext(Host(dev=tmp_path), config, 5.0)


def _samples(out: list[object]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in out if isinstance(s, Sample)}


def test_probe_end_to_end_on_a_kmsg_format_file(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"  # default path: <host dev>/kmsg
    log.write_bytes(b"3,1,1,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, before the agent started\n")
    clock = FakeClock()
    probe = KernelLogProbe(clock=clock)
    ctx = _ctx(tmp_path, quiet_period_seconds=300)
    assert probe.applicable(ctx) is None
    first = probe.run(ctx)
    findings = [f for f in first if not isinstance(f, Sample)]
    assert {f.subject for f in findings} == {r["reason"] for r in DEFAULT_RULES}
    assert all(f.status is Status.OK for f in findings)  # the backlog is skipped
    _append(
        log,
        b"3,2,2,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n"
        b" SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n"
        b"11,3,3,-;EXT4-fs error (device sda1): injected by a user process\n"
        b"6,4,4,-;Out of memory: Killed process 4321 (python3) total-vm:1234kB\n",
    )
    clock.now += 10
    second = probe.run(ctx)
    by_subject = {f.subject: f for f in second if not isinstance(f, Sample)}
    xid = by_subject["GpuXid"]
    assert xid.status is Status.FAIL and xid.reason == "GpuXid" and xid.category == "gpu"
    assert xid.observed["xid"] == "79"
    assert "GPU has fallen off the bus" in xid.message and xid.hint
    assert by_subject["OomKill"].status is Status.WARN
    assert by_subject["Ext4Error"].status is Status.OK  # the user-facility line is ignored
    samples = _samples(second)
    assert samples[("nodehealth_kernel_log_matches_total", (("reason", "GpuXid"),))] == 1
    assert samples[("nodehealth_kernel_log_matches_total", (("reason", "Ext4Error"),))] == 0
    assert samples[("nodehealth_kernel_log_records_read_total", ())] == 3
    assert samples[("nodehealth_kernel_log_records_ignored_total", ())] == 1
    assert samples[("nodehealth_kernel_log_overwritten_total", ())] == 0
    clock.now += 301
    third = probe.run(ctx)
    assert all(f.status is Status.OK for f in third if not isinstance(f, Sample))  # nothing sticks forever


def test_probe_skips_when_kmsg_is_missing(tmp_path: Path) -> None:
    probe = KernelLogProbe()
    ctx = _ctx(tmp_path, path=str(tmp_path / "absent"))
    reason = probe.applicable(ctx)
    assert reason is not None and "does not exist" in reason
    out = probe.run(ctx)
    assert [(f.status, f.reason) for f in out] == [(Status.SKIP, "KernelLogUnavailable")]  # type: ignore[union-attr]


def _applicable_as_nobody(dev_dir: str) -> str | None:
    """Runs in a forked child: drop root, then ask the probe whether it applies."""
    os.setgid(65534)
    os.setuid(65534)
    ctx = ProbeContext(Host(dev=dev_dir), parse_config({}), 5.0)
    return KernelLogProbe().applicable(ctx)


def test_probe_skips_when_kmsg_is_unreadable(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_bytes(b"")
    log.chmod(0o600)
    tmp_path.chmod(0o755)
    if os.geteuid() == 0:
        result = Host().child_call("kernel-log-test", _applicable_as_nobody, str(tmp_path), timeout=10)
        assert result.ok, result.error
        reason = result.value
    else:
        log.chmod(0)
        reason = KernelLogProbe().applicable(_ctx(tmp_path))
    assert reason is not None and "cannot open" in reason and "Permission denied" in reason


def test_probe_skips_a_directory(tmp_path: Path) -> None:
    (tmp_path / "kmsg").mkdir()
    reason = KernelLogProbe().applicable(_ctx(tmp_path))
    assert reason is not None and "cannot open" in reason


def test_probe_on_real_dev_kmsg() -> None:
    require_root()
    require(os.path.exists("/dev/kmsg"), "/dev/kmsg")
    probe = KernelLogProbe()
    ctx = ProbeContext(Host(), parse_config({}), 5.0)
    assert probe.applicable(ctx) is None
    started = time.monotonic()
    out = probe.run(ctx)
    assert time.monotonic() - started < 2.0
    assert any(isinstance(o, Sample) and o.name == "nodehealth_kernel_log_records_read_total" for o in out)
    assert {o.subject for o in out if not isinstance(o, Sample)} >= {"GpuXid", "OomKill"}
