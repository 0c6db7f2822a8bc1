"""kernel.log against a task name (comm, 15 bytes, set freely with prctl(PR_SET_NAME)) that leads or sits inside a
kernel record: the OOM killer's invocation line, pr_warn_once task lines, hung-task and OOM reports. Each default
rule gets a name made to match it, in each record shape; none may match through the name. And a real OOM in a
memory cgroup of a process named `XFS (x): error`, read back from /dev/kmsg."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import regex
from support.system import require, require_root

from agent.config import parse_config
from probes.base import ProbeContext, Sample, Status
from probes.kernel.config import KernelLogRule
from probes.kernel.default_rules import DEFAULT_RULES
from probes.kernel.kmsg import parse_kmsg_record
from probes.kernel.log import KernelLogProbe
from probes.kernel.rules import TASK_NAME, RuleEngine, neutralise_task_names
from probes.runtime.host import Host

# Each record shape a task name leads or sits in, from the kernel's format strings (see TASK_NAME_RECORDS).
SHAPES = {
    "oom-invocation": "{comm} invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, "
    "oom_score_adj=0",
    "page-allocation": "{comm}: page allocation failure: order:4, mode:0x40dc0(GFP_KERNEL|__GFP_COMP), nodemask=(null)",
    "drop-caches": "{comm} (4242): drop_caches: 3",
    "oom-adj": "{comm} (4242): /proc/4242/oom_adj is deprecated, please use /proc/4242/oom_score_adj instead.",
    "stack-depth": "{comm} (4242) used greatest stack depth: 10392 bytes left",
    "arm64-deprecated": '"{comm}" (4242) uses deprecated CP15 Barrier instruction at 0xffff8000',
    "hung-task": "INFO: task {comm}:4242 blocked for more than 120 seconds.",
    "oom-kill": "Out of memory: Killed process 4242 ({comm}) total-vm:1234kB, anon-rss:1000kB, file-rss:0kB",
    "memcg-oom-kill": "Memory cgroup out of memory: Killed process 4242 ({comm}) total-vm:1234kB, anon-rss:1000kB",
    "oom-reaper": "oom_reaper: reaped process 4242 ({comm}), now anon-rss:0kB, file-rss:0kB, shmem-rss:0kB",
    "oom-victim": "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/t,"
    "task_memcg=/t,task={comm},pid=4242,uid=0",
    "task-dump": "[   4242]     0  4242    12345      678        0    45056        0             0 {comm}",
    "dump-stack": "CPU: 3 UID: 0 PID: 4242 Comm: {comm} Not tainted 6.8.0 #1",
    "soft-lockup": "watchdog: BUG: soft lockup - CPU#3 stuck for 22s! [{comm}:4242]",
}

# A genuine line of each default rule (the drivers' own, from test_kernel_log_tenant.py's table), from which a
# name is cut; a rule with none here gets a name from its pattern's literal start.
GENUINE = {
    "GpuXid": "NVRM: Xid (0): 79, pid=1, name=x",
    "Ext4Error": "EXT4-fs (sda1): Remounting filesystem read-only",
    "XfsError": "XFS (x): error",
    "NfsServerNotResponding": "nfs: server x not responding",
    "NpuDriverHeartbeatLost": "[ascend] [a] [b 1] heartbeat lost",
    "NpuDriverError": "[ascend] [a] [b 1] error",
    "OomKill": "Out of memory: Killed process 1",
    "HungTask": "INFO: task x:1 blocked for more than 1 seconds",
    "PcieAerFatal": "a b: AER: Uncorrected (Fatal) error",
    "PcieAerNonFatal": "a b: AER: Uncorrected (Non-Fatal) error",
    "PcieCorrectableBurst": "a b: AER: Corrected error",
}


def _literal_start(pattern: str) -> str:
    """The text a pattern's start spells literally (after ^ and inline flags), unescaped."""
    text = re.sub(r"^(?:\(\?[a-z]+\))?\^?", "", pattern)
    out = []
    escaped = False
    for char in text:
        if escaped:
            if char.isalnum():
                break  # \S, \d: a class, no literal
            out.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char in "([{.*+?|$^":
            break
        else:
            out.append(char)
    return "".join(out)


def names_for(rule: dict[str, object]) -> list[str]:
    """Task names (15 bytes at most) made to match `rule`: the first 15 bytes of a genuine line of it, and of the
    pattern's literal start filled with the genuine line's words."""
    genuine = GENUINE.get(str(rule["reason"]), "")
    literal = _literal_start(str(rule["pattern"]))
    names = {genuine.encode()[:15].decode("utf-8", "ignore"), (literal + " error lost")[:15]}
    return sorted(name for name in names if name)


RULES = [KernelLogRule.model_validate(rule) for rule in DEFAULT_RULES]
CASES = [
    pytest.param(rule, name, shape, id=f"{rule['reason']}-{shape}-{index}")
    for rule in DEFAULT_RULES
    for index, name in enumerate(names_for(rule))
    for shape in SHAPES
]


@pytest.mark.parametrize(("rule", "name", "shape"), CASES)
def test_no_default_rule_matches_through_a_task_name(rule: dict[str, object], name: str, shape: str) -> None:
    assert len(name.encode()) <= 15
    line = SHAPES[shape].format(comm=name)
    seen, neutralised = neutralise_task_names(line)
    # What the rules read is what they read for an innocent name: nothing of the name is left.
    assert neutralised and seen == neutralise_task_names(SHAPES[shape].format(comm="x"))[0], seen
    assert TASK_NAME in seen
    engine = RuleEngine(RULES, 3600.0)
    reason = str(rule["reason"])
    for _ in range(25):  # past every rule's count
        matched = engine.observe(line)
        # Only the record's own rule may match it (an OOM kill is OomKill, a hung task HungTask), whatever the name.
        assert reason not in matched or regex.search(str(rule["pattern"]), SHAPES[shape].format(comm="x")), matched


def test_the_names_have_teeth() -> None:
    """Without the neutralising, the XfsError name leading the OOM killer's invocation is a permanent fail: the
    case the tests above exist for."""
    (xfs,) = [rule for rule in DEFAULT_RULES if rule["reason"] == "XfsError"]
    line = SHAPES["oom-invocation"].format(comm="XFS (x): error")
    assert regex.search(str(xfs["pattern"]), line)
    assert RuleEngine(RULES, 3600.0).observe(line) == []


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("Out of memory: Killed process 4242 (XFS (x): error) total-vm:1234kB, anon-rss:1000kB", "OomKill"),
        ("Memory cgroup out of memory: Killed process 1 (a) total-vm:1kB) total-vm:1234kB", "OomKill"),
        ("INFO: task XFS (x): error:4242 blocked for more than 120 seconds.", "HungTask"),
    ],
)
def test_the_records_own_rule_still_matches_with_the_name_replaced(line: str, reason: str) -> None:
    engine = RuleEngine(RULES, 3600.0)
    assert engine.observe(line) == [reason]
    finding = {f.subject: f for f in engine.findings()}[reason]
    assert "XFS" not in finding.message and "total-vm:1kB)" not in finding.message


@pytest.mark.parametrize(
    "line",
    [
        # A driver's fault line that embeds a name early (NVRM's name=) is never taken for a record led by one.
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=y (1): /proc/, GPU has fallen off the bus.",
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x invoked oom-k, GPU has fallen off the bus.",
        'XFS (dm-3): metadata I/O error in "xfs_imap_to_bp+0x5d/0x80" at daddr 0x2d0 len 32 error 5',
    ],
)
def test_a_genuine_fault_line_is_left_as_it_is(line: str) -> None:
    assert neutralise_task_names(line) == (line, False)
    assert RuleEngine(RULES, 3600.0).observe(line) != []


# A process that names itself `XFS (x): error` and allocates until its memory cgroup's limit kills it.
HOG = r"""
import ctypes, sys
ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)  # PR_SET_NAME
blocks = []
while True:
    blocks.append(bytearray(16 << 20))
"""


def _memory_cgroup(token: str) -> Path:
    """A memory cgroup of 64 MiB (v1 or v2), removed by the caller."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists():
        group = Path(f"/sys/fs/cgroup/node-health-oom-{token}")
        group.mkdir()
        (group / "memory.max").write_text(str(64 << 20))
        if (group / "memory.swap.max").exists():
            (group / "memory.swap.max").write_text("0")
        return group
    group = Path(f"/sys/fs/cgroup/memory/node-health-oom-{token}")
    require(group.parent.is_dir(), "a memory cgroup hierarchy")
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(64 << 20))
    return group


@pytest.mark.system
def test_a_real_oom_of_a_process_named_like_a_fault_raises_only_oomkill() -> None:
    require_root()
    require(os.access("/dev/kmsg", os.R_OK), "readable /dev/kmsg")
    token = uuid.uuid4().hex[:8]
    name = "XFS (x): error"
    probe = KernelLogProbe()
    ctx = ProbeContext(Host(), parse_config({}), 5.0)
    assert probe.applicable(ctx) is None  # opens /dev/kmsg at its end: the OOM's records are read by the next run
    raw = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    os.lseek(raw, 0, os.SEEK_END)
    group = _memory_cgroup(token)
    try:
        hog = subprocess.Popen(
            [sys.executable, "-c", HOG, name],
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )
        assert hog.wait(120) == -9, "the memory cgroup's OOM killer did not kill the process"
        records = []
        deadline = time.monotonic() + 10
        while not any("Killed process" in r.message and f"({name})" in r.message for r in records):
            assert time.monotonic() < deadline, [r.message for r in records]
            try:
                record = parse_kmsg_record(os.read(raw, 16384))
            except BlockingIOError:
                time.sleep(0.05)
                continue
            if record is not None:
                records.append(record)
    finally:
        os.close(raw)
        group.rmdir()
    leading = [r.message for r in records if r.message.startswith(f"{name} invoked oom-killer: ")]
    assert leading, [r.message for r in records]  # the real record leads with the name, as the issue says
    out = probe.run(ctx)
    findings = {f.subject: f for f in out if not isinstance(f, Sample)}
    assert findings["XfsError"].status is Status.OK, findings["XfsError"].message
    assert findings["OomKill"].status is Status.WARN and name not in findings["OomKill"].message
