"""host.memory and host.shm on real files: /proc/meminfo in the kernel's format, a real tmpfs as /dev/shm."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.system import require, require_root

from agent.config import parse_config
from probes.base import Finding, ProbeContext, ProbeParseError, Status
from probes.host.host import HostProbe, parse_meminfo
from probes.runtime.host import Host

MEMINFO = """MemTotal:       65536000 kB
MemFree:         1000000 kB
MemAvailable:    {available} kB
Buffers:          100000 kB
Cached:          2000000 kB
HugePages_Total:      64
HugePages_Free:       {hp_free}
HugePages_Rsvd:        0
HugePages_Surp:        0
Hugepagesize:       2048 kB
"""


def run(proc: Path, dev: Path, **host_cfg: object) -> dict[tuple[str, str], Finding]:
    config = parse_config({"host": host_cfg})
    output = HostProbe().run(ProbeContext(Host(proc=proc, dev=dev), config, 5.0))
    return {f.key: f for f in output if isinstance(f, Finding)}


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    require_root()
    dev = tmp_path / "dev"
    (dev / "shm").mkdir(parents=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(dev / "shm")], capture_output=True)
    require(result.returncode == 0, f"mount tmpfs: {result.stderr.decode().strip()}")
    try:
        yield dev
    finally:
        subprocess.run(["umount", "-l", str(dev / "shm")], check=False)


def proc_tree(tmp_path: Path, available_kb: int, hp_free: int) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    (proc / "meminfo").write_text(MEMINFO.format(available=available_kb, hp_free=hp_free))
    return proc


def test_real_meminfo_parses() -> None:
    values = parse_meminfo(Path("/proc/meminfo").read_text())
    assert values["MemTotal"] > values["MemAvailable"] > 0
    assert values["MemTotal"] % 1024 == 0  # kB turned into bytes
    with pytest.raises(ProbeParseError):
        parse_meminfo("garbage\n")


def test_memory_and_hugepages_against_thresholds(tmp_path: Path, shm: Path) -> None:
    ok = run(proc_tree(tmp_path, 30_000_000, 60), shm, memory={"min_free_hugepages": 32}, shm={"min_size_mib": 1})
    assert ok[("host.memory", "")].status == Status.OK
    assert ok[("host.memory", "hugepages")].status == Status.OK

    low = run(proc_tree(tmp_path, 1_000_000, 2), shm, memory={"min_free_hugepages": 32}, shm={"min_size_mib": 1})
    memory = low[("host.memory", "")]
    assert (memory.status, memory.reason) == (Status.FAIL, "HostMemoryLow")
    assert "977 MiB" in memory.message and memory.hint  # 1,000,000 kB
    hugepages = low[("host.memory", "hugepages")]
    assert (hugepages.status, hugepages.reason) == (Status.FAIL, "HostMemoryLow")
    assert hugepages.observed == {"hugepages_free": 2, "hugepages_total": 64}
    # 5% of 62.5 GiB is above 1 GiB available even when the MiB floor is met
    percent = run(proc_tree(tmp_path, 2_000_000, 60), shm, memory={"min_available_mib": 100}, shm={"min_size_mib": 1})
    assert percent[("host.memory", "")].reason == "HostMemoryLow"


def test_shm_too_small_and_too_full_on_a_real_tmpfs(tmp_path: Path, shm: Path) -> None:
    proc = proc_tree(tmp_path, 30_000_000, 60)
    small = run(proc, shm, shm={"min_size_mib": 8, "min_free_mib": 1})[("host.shm", "/dev/shm")]
    assert (small.status, small.reason) == (Status.FAIL, "ShmTooSmall")
    assert "4 MiB" in small.message
    assert run(proc, shm, shm={"min_size_mib": 2, "min_free_mib": 1})[("host.shm", "/dev/shm")].status == Status.OK
    try:
        with open(shm / "shm" / "segment", "wb") as fh:
            while True:
                fh.write(b"x" * 65536)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    full = run(proc, shm, shm={"min_size_mib": 2, "min_free_mib": 1})[("host.shm", "/dev/shm")]
    assert (full.status, full.reason) == (Status.FAIL, "ShmTooSmall")
    assert "free" in full.message and "ls -la /dev/shm" in full.hint
