"""storage.space on a real tmpfs the test mounts, filled until ENOSPC and until the inodes run out."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.system import require_root

from agent.config import parse_config
from probes.base import Finding, ProbeContext, Sample, Status
from probes.runtime.host import Host
from probes.storage.config import SpaceSpec
from probes.storage.space import SpaceProbe, space_finding


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    require_root()
    mountpoint = tmp_path / "fs"
    mountpoint.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,nr_inodes=64", "tmpfs", str(mountpoint)], capture_output=True
    )
    if result.returncode != 0:
        from support.system import require

        require(False, f"mount tmpfs: {result.stderr.decode().strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def space(path: Path, **spec: float) -> Finding:
    return space_and_samples(path, **spec)[0]


def space_and_samples(path: Path, **spec: float) -> tuple[Finding, dict[str, float]]:
    config = parse_config({"storage": {"space": [{"path": str(path), **spec}]}})
    output = SpaceProbe().run(ProbeContext(Host(), config, 5.0))
    (finding,) = [f for f in output if isinstance(f, Finding)]
    samples = {s.name: s.value for s in output if isinstance(s, Sample) and s.labels == {"path": str(path)}}
    return finding, samples


def fill_blocks(root: Path) -> None:
    chunk = b"x" * 65536
    with open(root / "big", "wb") as fh:
        try:
            while True:
                fh.write(chunk)
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def fill_inodes(root: Path) -> int:
    made = 0
    try:
        while True:
            (root / f"f{made}").touch()
            made += 1
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    return made


@pytest.mark.system
def test_empty_tmpfs_is_ok(tmpfs: Path) -> None:
    finding, samples = space_and_samples(tmpfs)
    assert finding.status == Status.OK
    assert finding.observed["size_bytes"] == 2 * 1024 * 1024
    assert samples["nodehealth_storage_size_bytes"] == 2 * 1024 * 1024
    assert samples["nodehealth_storage_free_bytes"] == finding.observed["free_bytes"] > 0
    assert samples["nodehealth_storage_inodes"] == 64
    assert samples["nodehealth_storage_free_inodes"] == finding.observed["free_inodes"]
    assert samples["nodehealth_storage_statvfs_seconds"] > 0


@pytest.mark.system
def test_filled_until_enospc_is_disk_full(tmpfs: Path) -> None:
    fill_blocks(tmpfs)
    finding = space(tmpfs)
    assert (finding.status, finding.reason) == (Status.FAIL, "DiskFull")
    assert finding.observed["free_bytes"] == 0
    assert finding.hint


@pytest.mark.system
def test_half_full_crosses_the_warn_watermark(tmpfs: Path) -> None:
    (tmpfs / "half").write_bytes(b"x" * (1024 * 1024 + 65536))
    finding = space(tmpfs, warn_percent=50, fail_percent=90)
    assert (finding.status, finding.reason) == (Status.WARN, "DiskLow")
    assert space(tmpfs, warn_percent=20, fail_percent=40).reason == "DiskFull"


@pytest.mark.system
def test_inodes_run_out_with_blocks_free(tmpfs: Path) -> None:
    made = fill_inodes(tmpfs)
    assert made > 10
    finding = space(tmpfs)
    assert (finding.status, finding.reason) == (Status.FAIL, "InodesExhausted")
    assert finding.observed["free_inodes"] == 0
    assert finding.observed["free_bytes"] > 0


def test_missing_path_fails_with_its_name(tmp_path: Path) -> None:
    finding = space(tmp_path / "nope")
    assert (finding.status, finding.reason) == (Status.FAIL, "PathMissing")
    assert str(tmp_path / "nope") in finding.message
    assert os.path.exists(tmp_path)


def test_a_filesystem_without_an_inode_count_is_judged_by_blocks_only() -> None:
    statvfs = {"frsize": 4096, "blocks": 1000, "bfree": 500, "bavail": 500, "files": 0, "ffree": 0, "favail": 0}
    assert space_finding("/x", statvfs, SpaceSpec(path="/x")).status == Status.OK
    full = {**statvfs, "bfree": 10, "bavail": 10}
    assert space_finding("/x", full, SpaceSpec(path="/x")).reason == "DiskFull"


def test_an_unexpected_errno_is_stat_failed_naming_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    finding = space(tmp_path / "file" / "below")
    assert (finding.status, finding.reason) == (Status.UNKNOWN, "StatFailed"), finding
    assert "ENOTDIR" in finding.message and finding.observed["errno"] == errno.ENOTDIR
