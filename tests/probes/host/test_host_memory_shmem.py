"""host.memory when tmpfs leftovers hold the host's memory: files on a tmpfs count in Shmem and in no process's
RSS, so `ps --sort=-rss` shows nothing. A real tmpfs filled with 1 GiB, configured as the shm path: the finding
says shared memory holds it and gives the commands that find the files."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from support.system import require_root

from agent.config import parse_config
from probes.base import Finding, ProbeContext, Status
from probes.host.host import HostProbe, parse_meminfo
from probes.runtime.host import Host

MIB = 1 << 20
FILL_MIB = 1024


def memory_finding(config: dict) -> Finding:
    output = HostProbe().run(ProbeContext(Host(), parse_config({"host": config}), 5.0))
    (finding,) = [f for f in output if isinstance(f, Finding) and f.key == ("host.memory", "")]
    return finding


@pytest.mark.system
def test_memory_held_by_files_on_a_tmpfs_is_named_with_the_commands_that_find_them(tmp_path: Path) -> None:
    require_root()
    shm = tmp_path / "shm"
    shm.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FILL_MIB + 200}m", "nh-shmem", str(shm)], check=True)
    try:
        with open(shm / "leftover.bin", "wb") as handle:
            chunk = b"\1" * MIB
            for _ in range(FILL_MIB):
                handle.write(chunk)
        available = parse_meminfo(Path("/proc/meminfo").read_text())["MemAvailable"]
        # Ask for more than is available, so the finding fails here as it would on a node short of memory.
        config = {"memory": {"min_available_mib": available // MIB + 2048}, "shm": {"path": str(shm)}}
        finding = memory_finding(config)
    finally:
        subprocess.run(["umount", "-l", str(shm)], check=False)
    assert (finding.status, finding.reason) == (Status.FAIL, "HostMemoryLow"), finding
    assert finding.observed["shmem_mib"] >= FILL_MIB
    assert "of it is shared memory (Shmem: tmpfs and /dev/shm files), which ps does not show" in finding.message
    assert "`df -h -t tmpfs`" in finding.hint
    assert f"`du -ah {shm} | sort -h | tail`" in finding.hint
    assert f"{shm} alone holds" in finding.hint


MEMINFO = """MemTotal:       65536000 kB
MemFree:          500000 kB
MemAvailable:     900000 kB
Shmem:          {shmem} kB
"""


def test_a_small_shmem_keeps_the_process_hint(tmp_path: Path) -> None:
    """Little shared memory: the processes are where the memory went, and the hint says ps."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(MEMINFO.format(shmem=40_000))
    output = HostProbe().run(ProbeContext(Host(proc=proc, dev=tmp_path), parse_config({}), 5.0))
    (finding,) = [f for f in output if isinstance(f, Finding) and f.key == ("host.memory", "")]
    assert (finding.status, finding.reason) == (Status.FAIL, "HostMemoryLow")
    assert "shared memory" not in finding.message and finding.hint.startswith("find the processes using memory")
    (proc / "meminfo").write_text(MEMINFO.format(shmem=30_000_000))
    output = HostProbe().run(ProbeContext(Host(proc=proc, dev=tmp_path), parse_config({}), 5.0))
    (finding,) = [f for f in output if isinstance(f, Finding) and f.key == ("host.memory", "")]
    assert finding.hint.startswith("shared memory holds 29297 MiB: files on tmpfs mounts and in /dev/shm")
