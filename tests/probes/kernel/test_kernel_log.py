"""kernel.log: /dev/kmsg records, the non-blocking reader and the probe (rules: test_kernel_log_rules.py)."""

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
from probes.base import CATEGORIES, ProbeContext, Sample, Status
from probes.kernel.config import KernelLogRule
from probes.kernel.default_rules import DEFAULT_RULES
from probes.kernel.kmsg import KmsgReader, parse_kmsg_record, split_records
from probes.kernel.log import KernelLogProbe
from probes.kernel.rules import RuleEngine
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
    assert record.message == "first\\x0asecond \\ end \u2713"  # a control character stays escaped
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


@pytest.mark.system
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


@pytest.mark.system
def test_reader_survives_epipe(tmp_path: Path) -> None:
    with _epipe_fuse(tmp_path / "mnt") as kmsg:
        reader = KmsgReader(kmsg)
        try:
            result = reader.read_available()
        finally:
            reader.close()
    assert result.overwritten == 2
    assert [r.sequence for r in result.records] == [900, 950]


@pytest.mark.system
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


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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


@pytest.mark.system
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


# --- reasons: declared from the rules, and fit for Kubernetes -------------------------------------------------


def test_a_configured_rule_reason_is_allowed_at_run_time(tmp_path: Path) -> None:
    """Under NODE_HEALTH_STRICT_REASONS=1 an undeclared reason raises: a configured rule's must not."""
    log = tmp_path / "kmsg"
    log.write_bytes(b"")
    extra = {"reason": "MlxLinkDown", "pattern": r"mlx5_core \S+: Port module event.*(?i:error)", "category": "network"}
    xid = {"reason": "GpuXidStrict", "pattern": r"NVRM: Xid \(PCI:\S+\): (?P<xid>\d+)", "fail_on": {"xid": ["13"]}}
    clock = FakeClock()
    probe = KernelLogProbe(clock=clock)
    ctx = _ctx(tmp_path, extra_rules=[extra, xid])
    probe.run(ctx)
    _append(
        log,
        b"3,1,1,-;mlx5_core 0000:5e:00.0: Port module event[error]: module 0, Cable error, Bad cable\n"
        b"3,2,2,-;NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python, Graphics SM Warp Exception\n",
    )
    clock.now += 1
    by_subject = {f.subject: f for f in probe.run(ctx) if not isinstance(f, Sample)}
    link = by_subject["MlxLinkDown"]
    assert (link.status, link.reason, link.category) == (Status.WARN, "MlxLinkDown", "network")
    strict = by_subject["GpuXidStrict"]
    assert (strict.status, strict.observed["xid"]) == (Status.FAIL, "13")
    assert by_subject["GpuXid"].status is Status.WARN  # the default rule: XID 13 only warns


def test_every_category_of_the_table_is_accepted(tmp_path: Path) -> None:
    rules = [{"reason": f"Rule{name.title()}", "pattern": f"{name} trouble", "category": name} for name in CATEGORIES]
    config = parse_config({"kernel_log": {"extra_rules": rules}})
    assert [rule.category for rule in config.kernel_log.extra_rules] == list(CATEGORIES)
    with pytest.raises(ConfigError, match=r"kernel_log\.extra_rules\[0\]\.category.*unknown category 'clock'"):
        parse_config({"kernel_log": {"extra_rules": [{"reason": "Drift", "pattern": "x", "category": "clock"}]}})
    # category: time (rejected before) raises a finding in the ClockSynced category
    log = tmp_path / "kmsg"
    log.write_bytes(b"")
    probe = KernelLogProbe(clock=FakeClock())
    ctx = _ctx(tmp_path, rules=[{"reason": "ClockJump", "pattern": r"clocksource: .* unstable", "category": "time"}])
    probe.run(ctx)
    _append(log, b"4,1,1,-;clocksource: timekeeping watchdog on CPU3: Marking clocksource 'tsc' as unstable\n")
    (finding,) = [f for f in probe.run(ctx) if not isinstance(f, Sample)]
    assert (finding.subject, finding.status, finding.category) == ("ClockJump", Status.WARN, "time")
    assert CATEGORIES[finding.category].condition_type == "ClockSynced"
