"""kernel.log against a hostile tenant: text a process chooses (its name, the name of the file it crashed in)
reaches the kernel log; none of it may raise or clear a fault, hold a control byte, or freeze the agent."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.system import REPO, require, require_root, require_tool

from agent.config import parse_config
from probes.base import ProbeContext, Sample, Status
from probes.kernel.config import KernelLogRule
from probes.kernel.default_rules import DEFAULT_RULES
from probes.kernel.kmsg import parse_kmsg_record
from probes.kernel.log import KernelLogProbe
from probes.kernel.rules import RuleEngine, is_user_task_record
from probes.runtime.host import Host

NOBODY = 65534
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

# Each a fault line of a default rule (or its recovery), as a file name; the token keeps them apart from
# anything else in the log. The kernel logs a crashing task's name (its first 15 bytes) at the start of the
# record and the whole file name after " in ".
HOSTILE_NAMES = {
    "Ext4Error": "EXT4-fs error (device sda1): x",
    "GpuXid": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus",
    "NpuDriverHeartbeatLost": "[ascend] [ERROR] [devdrv] [hb 1] hdc heartbeat lost",
    "XfsError": "XFS (sda1): metadata error, shutting down",
    "NfsServerNotResponding": "nfs: server filer-1 OK",
    "escape": "\x1b[31mEXT4-fs error x\x1b[0m",
}

# ud2, logged as `traps: NAME[pid] trap invalid opcode ... in NAME[...]`
TRAP_C = "int main(void) { __builtin_trap(); }\n"
# a read of address 0x10, logged as `NAME[pid]: segfault at 10 ... in NAME[...]`
SEGV_C = "int main(void) { volatile int *p = (int *)0x10; return *p; }\n"


def default_engine(clock: object = time.monotonic) -> RuleEngine:
    return RuleEngine([KernelLogRule.model_validate(rule) for rule in DEFAULT_RULES], 3600.0, clock)  # type: ignore[arg-type]


@contextlib.contextmanager
def crash_binaries() -> Iterator[Path]:
    """A directory every user can enter with a compiled `trap` and `segv` in it."""
    gcc = require_tool("gcc")
    directory = Path(tempfile.mkdtemp(prefix="node-health-crash-", dir="/tmp"))
    try:
        directory.chmod(0o755)
        for name, source in (("trap", TRAP_C), ("segv", SEGV_C)):
            (directory / f"{name}.c").write_text(source)
            subprocess.run([gcc, "-O0", "-o", str(directory / name), str(directory / f"{name}.c")], check=True)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def crash_as_nobody(directory: Path, kind: str, name: str) -> None:
    """Copy the crashing binary to `name` and run it as an unprivileged user: the kernel logs the crash."""
    target = directory / name
    shutil.copy(directory / kind, target)
    target.chmod(0o755)
    result = subprocess.run([str(target)], user=NOBODY, group=NOBODY, extra_groups=[], timeout=30)
    assert result.returncode in (-signal.SIGILL, -signal.SIGSEGV, -signal.SIGTRAP), result.returncode


def drain(fd: int) -> list[bytes]:
    out = []
    for _ in range(10000):
        try:
            out.append(os.read(fd, 16384))
        except BlockingIOError:
            break
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                raise
    return out


@pytest.mark.system
def test_a_real_crash_in_a_file_with_a_hostile_name_raises_and_clears_nothing() -> None:
    require_root()
    require(os.access("/dev/kmsg", os.R_OK), "readable /dev/kmsg")
    token = uuid.uuid4().hex[:8]
    probe = KernelLogProbe()
    ctx = ProbeContext(Host(), parse_config({}), 5.0)
    assert probe.applicable(ctx) is None  # opens /dev/kmsg at its end: what follows is read by the next run
    raw_fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.lseek(raw_fd, 0, os.SEEK_END)
        with crash_binaries() as directory:
            for index, name in enumerate(HOSTILE_NAMES.values()):
                crash_as_nobody(directory, ("trap", "segv")[index % 2], f"{name} {token}")
        time.sleep(0.5)
        records = [parse_kmsg_record(raw) for raw in drain(raw_fd)]
    finally:
        os.close(raw_fd)
    ours = [r for r in records if r is not None and token in r.message]
    # debug.exception-trace=0 or the printk rate limit keep the kernel from logging crashes: nothing to test then.
    require(len(ours) >= 3, "the kernel logging user-task crashes (sysctl debug.exception-trace=1, not rate limited)")
    assert all(r.from_kernel for r in ours), "crash records carry the kernel facility: the facility filter passes them"
    for record in ours:
        assert not CONTROL.search(record.message), record.message  # the kernel's \x1b stays escaped
        assert is_user_task_record(record.message), record.message
    escaped = [r.message for r in ours if "[31m" in r.message]
    require(bool(escaped), "the crash record of the escape name (rate limit)")
    assert "\\x1b[31m" in escaped[0]

    out = probe.run(ctx)
    findings = {f.subject: f for f in out if not isinstance(f, Sample)}
    for reason in ("Ext4Error", "GpuXid", "NpuDriverHeartbeatLost", "XfsError"):
        assert findings[reason].status is Status.OK, findings[reason].message
    counted = {s.labels.get("reason"): s.value for s in out if isinstance(s, Sample) and "matches" in s.name}
    assert not any(counted.values()), counted
    user_records = [s.value for s in out if isinstance(s, Sample) and s.name.endswith("user_task_records_total")]
    assert user_records and user_records[0] >= len(ours)

    # The recovery line in a crash record does not clear a real problem either.
    engine = default_engine()
    engine.observe("nfs: server filer-1 not responding, still trying")
    engine.observe_all(r.message for r in ours)
    nfs = {f.subject: f for f in engine.findings()}["NfsServerNotResponding"]
    assert nfs.status is Status.WARN and nfs.observed["server"] == "filer-1"


# What the kernel writes around a task's name, from its format strings (arch/x86/mm/fault.c show_signal_msg,
# arch/x86/kernel/traps.c, arch/arm64/kernel/traps.c arm64_show_signal, mm/oom_kill.c, kernel/audit.c).
def user_records(name: str) -> list[str]:
    comm = name[:15]
    return [
        f"{comm}[4242]: segfault at 10 ip 00005617b7227139 sp 00007fff581433a0 error 4 in {name}[1139,5617b000+1000]",
        f"traps: {comm}[4242] trap invalid opcode ip:55c26f7f912d sp:7ffe3dc41970 error:0 in {name}[112d,55c2000+1000]",
        f"traps: {comm}[4242] general protection fault ip:7f2a sp:7ffc error:0 in {name}[7f2a,7f00+1000]",
        f"{comm}[4242]: unhandled exception: DABT (lower EL), ESR 0x92000006, level 2 translation fault"
        f" in {name}[400000+1000]",
        f"audit: type=1701 audit(1700000000.123:99): auid=4294967295 uid=65534 pid=4242 comm={comm!r}"
        f" exe=/tmp/{name!r} sig=11 res=1",
    ]


@pytest.mark.parametrize("name", list(HOSTILE_NAMES.values()))
def test_user_task_records_match_no_default_rule(name: str) -> None:
    engine = default_engine()
    for line in user_records(name):
        assert is_user_task_record(line), line
        assert engine.observe(line) == [], line


@pytest.mark.parametrize("name", list(HOSTILE_NAMES.values()))
def test_a_task_name_at_the_start_of_a_kernel_line_matches_no_default_rule(name: str) -> None:
    """Anchored rules: a task name (15 bytes) that leads a kernel line the crash filter does not know."""
    engine = default_engine()
    comm = name[:15]
    for line in (
        f"{comm} invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, oom_score_adj=0",
        f"{comm}: page allocation failure: order:4, mode:0x40dc0(GFP_KERNEL|__GFP_COMP|__GFP_ZERO)",
        f"CPU: 3 UID: 65534 PID: 4242 Comm: {comm} Not tainted 6.8.0 #1",
    ):
        assert engine.observe(line) == [], line


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.", "GpuXid"),
        ("NVRM: Xid (0000:3b:00): 48, pid=1, name=x, An uncorrectable double bit error", "GpuXid"),
        ("EXT4-fs error (device sda1): ext4_find_entry:1455: inode #2: comm ls: reading directory", "Ext4Error"),
        ("EXT4-fs (nvme0n1p2): Remounting filesystem read-only", "Ext4Error"),
        ('XFS (dm-3): metadata I/O error in "xfs_imap_to_bp+0x5d/0x80" at daddr 0x2d0 len 32 error 5', "XfsError"),
        ("[ascend] [ERROR] [devdrv] [devdrv_heart_beat_broken 512] dev_id 3 heartbeat lost", "NpuDriverHeartbeatLost"),
        ("nfs: server filer-1 not responding, still trying", "NfsServerNotResponding"),
        ("Out of memory: Killed process 4321 (python3) total-vm:1234kB, anon-rss:1000kB", "OomKill"),
        ("Memory cgroup out of memory: Killed process 4321 (python3) total-vm:1234kB", "OomKill"),
        ("INFO: task python3:4242 blocked for more than 120 seconds.", "HungTask"),
        ("pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error message received from 0000:01:00.0", "PcieAerFatal"),
        ("nvidia 0000:3b:00.0: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=Transaction", "PcieAerNonFatal"),
    ],
)
def test_the_drivers_own_lines_still_match(line: str, reason: str) -> None:
    assert not is_user_task_record(line)
    assert reason in default_engine().observe(line)


# Ascend driver lines whose task name (15 bytes at most) is crafted to steer the prefix: a ":pid:tid> " inside the
# name, for the prefix to end there and leave the rest of the name to the rule, or a name that is a fault's words,
# for the prefix to skip the optional "[ERROR] " and leave the whole "<name:pid:tid> " to the rule. Each with the
# reason it aims at; the driver's own text after the task carries no fault of that reason.
CRAFTED_ASCEND_LINES = [
    ("[ascend] [ERROR] [hdc] [f 1] <:1:1> heartbeat:4242:4243> wait for session timeout", "NpuDriverHeartbeatLost"),
    ("[ascend] [hdc] [f 1] <:1:1> heartbeat:4242:4243> session timeout", "NpuDriverHeartbeatLost"),
    ("[ascend] [ERROR] [hdc] [f 1] <x:1:1> error:4242:4243> wait for session", "NpuDriverError"),
    ("[ascend] [hdc] [f 1] <x:1:1> error:4242:4243> wait for session", "NpuDriverError"),
    ("[ascend] [ERROR] [hdc] [f 1] <heartbeat lost:4242:4243> wait for session", "NpuDriverHeartbeatLost"),
    ("[ascend] [ERROR] [hdc] [f 1] <error:4242:4243> wait for session", "NpuDriverError"),
]


@pytest.mark.parametrize(("line", "reason"), CRAFTED_ASCEND_LINES)
def test_a_crafted_ascend_task_name_raises_no_fault(line: str, reason: str) -> None:
    assert not is_user_task_record(line)  # the rules read it: nothing filters it out before them
    engine = default_engine()
    for _ in range(25):  # past NpuDriverError's 20 within 300 s
        assert reason not in engine.observe(line)
    findings = {f.subject: f for f in engine.findings()}
    assert findings[reason].status is Status.OK, findings[reason].message


@pytest.mark.parametrize(
    ("line", "reason", "status"),
    [
        ("[ascend] [ERROR] [hdc] [f 1] <python3:4242:4243> heartbeat lost", "NpuDriverHeartbeatLost", Status.FAIL),
        ("[ascend] [hdc] [f 1] <:1:1> heartbeat:4242:4243> heartbeat lost", "NpuDriverHeartbeatLost", Status.FAIL),
        ("[ascend] [ERROR] [hdc] [f 1] <error:4242:4243> dma copy failed", "NpuDriverError", Status.WARN),
        ("[ascend] [hdc] [f 1] <x:1:1> error:4242:4243> dma copy failed", "NpuDriverError", Status.WARN),
    ],
)
def test_a_genuine_ascend_fault_still_raises_whatever_the_task_name(line: str, reason: str, status: Status) -> None:
    engine = default_engine()
    for _ in range(20):
        assert reason in engine.observe(line)
    findings = {f.subject: f for f in engine.findings()}
    assert findings[reason].status is status, findings[reason].message


@pytest.mark.parametrize(
    "line",
    [
        "EXT4-fs error (device loop3): ext4_find_entry:1455: inode #2: comm ls: reading directory lblock 0",
        "EXT4-fs (loop12p1): Remounting filesystem read-only",
        'XFS (loop0): metadata I/O error in "xfs_trans_read_buf_map" at daddr 0x2 len 1 error 5',
        "XFS (loop7): Corruption of in-memory data detected.  Shutting down filesystem",
    ],
)
def test_loop_devices_are_left_out_of_the_filesystem_rules(line: str) -> None:
    assert default_engine().observe(line) == []


def test_rules_see_at_most_max_line_chars() -> None:
    rule = KernelLogRule.model_validate({"reason": "TailWord", "pattern": "needle"})
    engine = RuleEngine([rule], 60.0, max_line_chars=40)
    assert engine.observe("x" * 30 + " needle") == ["TailWord"]
    assert engine.observe("x" * 40 + " needle") == []


def test_a_catastrophic_pattern_is_cut_by_its_time_limit() -> None:
    rule = KernelLogRule.model_validate({"reason": "Backtrack", "pattern": r"(a|aa)+\["})
    other = KernelLogRule.model_validate({"reason": "Plain", "pattern": "a{5}"})
    engine = RuleEngine([rule, other], 60.0, max_line_chars=240, match_timeout=0.05)
    started = time.monotonic()
    assert engine.observe("a" * 200 + "!") == ["Plain"]  # the other rule still sees the line
    assert time.monotonic() - started < 2.0
    assert engine.match_timeouts("Backtrack") == 1 and engine.match_timeouts("Plain") == 0


def _healthz(port: int) -> tuple[int, float]:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return int(response.status), time.monotonic() - started
    except urllib.error.HTTPError as exc:
        return int(exc.code), time.monotonic() - started
    except OSError:
        return 0, time.monotonic() - started


def _metric(port: int, name: str, labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    selector = f"{{{re.escape(labels)}}}" if labels else ""
    found = re.search(rf"^{name}{selector} (\S+)$", text, re.M)
    return float(found.group(1)) if found else -1.0


@pytest.mark.system
def test_a_redos_rule_and_a_crafted_line_do_not_freeze_the_agent(tmp_path: Path) -> None:
    """The issue's rule (a nested quantifier Python's re backtracks on for ever) and one that backtracks in any
    engine, fed crafted kernel lines: /healthz keeps answering and SIGTERM still stops the agent."""
    with contextlib.closing(__import__("socket").socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    kmsg = tmp_path / "kmsg"
    kmsg.write_bytes(b"")
    rules = [{"reason": "DottedName", "pattern": r"(\w+[.-]?)+\["}, {"reason": "Backtrack", "pattern": r"(a|aa)+\["}]
    config = tmp_path / "config.yaml"
    settings = {
        "http": {"address": "127.0.0.1", "port": port},
        "kernel_log": {"path": str(kmsg), "extra_rules": rules},
        "probes": {"kernel.log": {"interval_seconds": 1, "jitter_fraction": 0}},
    }
    config.write_text(yaml.safe_dump(settings))
    check = subprocess.run(
        [sys.executable, "-m", "agent.cli", "config", "--validate", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", "--no-kube", "--config", str(config)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        # The probe opens the log at its end on its first run: the crafted lines come after it.
        while _healthz(port)[0] == 0 or _metric(port, "nodehealth_kernel_log_records_read_total", "") < 0:
            assert proc.poll() is None and time.monotonic() < deadline, "the agent did not serve"
            time.sleep(0.2)
        with kmsg.open("ab") as log:
            for seq in range(10):
                log.write(b"3,%d,%d,-;%s!\n" % (seq, seq, b"a" * 200))
        answers = []
        end = time.monotonic() + 8
        while time.monotonic() < end:
            answers.append(_healthz(port))
            time.sleep(0.2)
        assert all(code == 200 for code, _ in answers), answers
        assert max(seconds for _, seconds in answers) < 2.0
        assert _metric(port, "nodehealth_kernel_log_match_timeouts_total", 'reason="Backtrack"') >= 1
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert time.monotonic() - started < 5.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_lines_not_matched_by_the_deadline_are_kept_for_the_next_run(tmp_path: Path) -> None:
    engine = default_engine()
    lines = ["nfs: server filer-1 not responding, still trying", "NET: Registered protocol family 10"]
    assert engine.observe_all(lines, deadline=time.monotonic() - 1) == lines  # past the deadline: none fed
    assert engine.matches_total("NfsServerNotResponding") == 0
    assert engine.observe_all(lines, deadline=time.monotonic() + 60) == []
    assert engine.matches_total("NfsServerNotResponding") == 1
