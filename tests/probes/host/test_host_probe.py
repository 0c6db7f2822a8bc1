"""host.memory and host.shm on real files: /proc/meminfo in the kernel's format, a real tmpfs as /dev/shm, a
hung FUSE mount as a misconfigured shm path."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fusefs import fuse_mount
from support.system import fuse_capable, require, require_root, wait_reaped

from agent.config import parse_config
from probes.base import (
    OBSERVED_HOST_MEM_AVAILABLE_MIB,
    OBSERVED_HUGEPAGES_FREE,
    Finding,
    ProbeContext,
    ProbeParseError,
    Status,
)
from probes.host.host import HostProbe, parse_meminfo
from probes.runtime.children import ChildCalls
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


def run(proc: Path, dev: Path, root: Path | None = None, **host_cfg: object) -> dict[tuple[str, str], Finding]:
    config = parse_config({"host": host_cfg})
    host = Host(proc=proc, dev=dev, root=root or "/")
    output = HostProbe().run(ProbeContext(host, config, 5.0))
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


@pytest.mark.system
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


@pytest.mark.system
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


def test_hugepages_are_reported_whenever_the_host_has_them(tmp_path: Path) -> None:
    """/ready?min_hugepages= is answered from the hugepages finding, so it exists without a configured minimum."""
    dev = tmp_path / "dev"
    (dev / "shm").mkdir(parents=True)
    found = run(proc_tree(tmp_path, 30_000_000, 7), dev, shm={"min_size_mib": 0, "min_free_mib": 0})
    hugepages = found[("host.memory", "hugepages")]
    assert (hugepages.status, hugepages.reason) == (Status.OK, "OK")
    assert hugepages.observed[OBSERVED_HUGEPAGES_FREE] == 7
    assert "7 free hugepages of 64" in hugepages.message
    memory = found[("host.memory", "")]
    assert memory.observed[OBSERVED_HOST_MEM_AVAILABLE_MIB] == 29297  # 30,000,000 kB
    assert memory.status == Status.OK
    # a kernel without hugetlbfs shows no HugePages_ lines: nothing to report
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 6000000 kB\n")
    found = run(tmp_path / "proc", dev, shm={"min_size_mib": 0, "min_free_mib": 0})
    assert ("host.memory", "hugepages") not in found
    assert found[("host.memory", "")].observed[OBSERVED_HOST_MEM_AVAILABLE_MIB] == 5859


def test_unreadable_meminfo_is_unknown_and_shm_still_checked(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    (dev / "shm").mkdir(parents=True)
    found = run(tmp_path / "noproc", dev, shm={"min_size_mib": 0, "min_free_mib": 0})
    memory = found[("host.memory", "")]
    assert (memory.status, memory.reason) == (Status.UNKNOWN, "MeminfoUnreadable")
    assert "No such file" in memory.message and memory.hint
    assert found[("host.shm", "/dev/shm")].status == Status.OK
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("garbage\n")
    assert run(tmp_path / "proc", dev)[("host.memory", "")].reason == "MeminfoUnreadable"


def test_missing_shm_is_too_small(tmp_path: Path) -> None:
    proc = proc_tree(tmp_path, 30_000_000, 60)
    shm = run(proc, tmp_path / "nodev")[("host.shm", "/dev/shm")]
    assert (shm.status, shm.reason) == (Status.FAIL, "ShmTooSmall")
    assert "does not exist" in shm.message
    elsewhere = run(proc, tmp_path, tmp_path, shm={"path": "/run/shm"})[("host.shm", "/run/shm")]
    assert (elsewhere.status, elsewhere.reason) == (Status.FAIL, "ShmTooSmall")


@pytest.mark.system
def test_shm_path_on_a_hung_mount_is_unknown_not_a_hang(tmp_path: Path) -> None:
    fuse_capable()
    proc = proc_tree(tmp_path, 30_000_000, 60)
    children = ChildCalls()
    with fuse_mount(tmp_path, "--hang-getattr"):
        config = parse_config({"host": {"shm": {"path": "/mnt/shm"}}})
        ctx = ProbeContext(Host(proc=proc, root=tmp_path, children=children), config, 1.0)
        output = HostProbe().run(ctx)
        found = {f.key: f for f in output if isinstance(f, Finding)}
        shm = found[("host.shm", "/mnt/shm")]
        assert (shm.status, shm.reason) == (Status.UNKNOWN, "ShmUnreadable")
        assert shm.observed["state"] in ("timeout", "busy")
        assert found[("host.memory", "")].status == Status.OK
    assert wait_reaped(children) == {}, "the stuck statvfs child outlived the mount"
