"""storage.write against real kernels: FUSE filesystems failing at write, fsync or close; real tmpfs."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fusefs import fuse_mount
from support.system import fuse_capable, require_root, traversable_tmp_dir

from agent.config import parse_config
from agent.scheduler import probe_context
from probes.base import Finding, Sample, Status
from probes.runtime.host import Host
from probes.storage.config import WriteProbeSpec
from probes.storage.write import WriteProbe, write_finding, write_probe_file_name

JOB_UID, JOB_GID = 4321, 4322


def run_write(path: Path, uid: int = JOB_UID, gid: int = JOB_GID, nbytes: int = 65536) -> tuple[Finding, list[Sample]]:
    config = parse_config(
        {
            "node_name": "node-a",
            "storage": {"write_probes": [{"path": str(path), "uid": uid, "gid": gid, "bytes": nbytes}]},
        }
    )
    output = WriteProbe().run(probe_context(Host(), config, 15.0))
    findings = [f for f in output if isinstance(f, Finding)]
    assert len(findings) == 1
    return findings[0], [s for s in output if isinstance(s, Sample)]


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A temp dir the job uid can traverse."""
    with traversable_tmp_dir("nh-write-") as path:
        yield path


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "nh-test", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.system
@pytest.mark.parametrize(
    ("flag", "stage"),
    [("--write-errno", "write"), ("--fsync-errno", "fsync"), ("--flush-errno", "close")],
)
def test_quota_exceeded_at_each_stage(tmp_path: Path, flag: str, stage: str) -> None:
    fuse_capable()
    with fuse_mount(tmp_path, flag, "EDQUOT") as mount:
        finding, samples = run_write(mount.path)
        leftovers = os.listdir(mount.path)
    assert (finding.status, finding.reason) == (Status.FAIL, "DiskQuotaExceeded"), finding
    assert finding.check == "storage.write"
    assert finding.observed["stage"] == stage
    assert "EDQUOT (errno 122" in finding.message and f"at {stage}" in finding.message
    assert f"uid {JOB_UID}" in finding.hint and "quota" in finding.hint
    assert leftovers == []  # the probe file is removed even after a failure
    assert [s.value for s in samples if s.name == "nodehealth_storage_write_ok"] == [0.0]


@pytest.mark.system
def test_enospc_with_and_without_free_inodes_on_fuse(tmp_path: Path) -> None:
    fuse_capable()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with fuse_mount(tmp_path / "a", "--write-errno", "ENOSPC") as mount:
        full, _ = run_write(mount.path)
    with fuse_mount(tmp_path / "b", "--write-errno", "ENOSPC", "--files", "1000", "--ffree", "0") as mount:
        no_inodes, _ = run_write(mount.path)
    assert (full.status, full.reason) == (Status.FAIL, "DiskFull"), full
    assert "ENOSPC (errno 28" in full.message and "grow the disk" in full.hint
    assert (no_inodes.status, no_inodes.reason) == (Status.FAIL, "InodesExhausted"), no_inodes
    assert no_inodes.observed["free_inodes"] == 0


@pytest.mark.system
def test_write_as_the_job_uid_succeeds_and_cleans_up(tmp_path: Path) -> None:
    fuse_capable()
    with fuse_mount(tmp_path) as mount:
        finding, samples = run_write(mount.path, nbytes=300_000)
        leftovers = os.listdir(mount.path)
    assert finding.status == Status.OK, finding
    assert leftovers == []
    assert [s.value for s in samples if s.name == "nodehealth_storage_write_ok"] == [1.0]
    assert any(s.name == "nodehealth_storage_write_seconds" for s in samples)


@pytest.mark.system
def test_tmpfs_filled_to_enospc_is_disk_full(tmp_path: Path) -> None:
    require_root()
    with tmpfs(tmp_path / "fs", "size=1m,nr_inodes=1000,mode=1777") as fs:
        with open(fs / "filler", "wb") as handle, contextlib.suppress(OSError):
            handle.write(b"x" * (2 << 20))
        finding, _ = run_write(fs)
        assert os.listdir(fs) == ["filler"]
    assert (finding.status, finding.reason) == (Status.FAIL, "DiskFull"), finding
    assert finding.observed["stage"] == "write"


@pytest.mark.system
def test_tmpfs_out_of_inodes_is_inodes_exhausted(tmp_path: Path) -> None:
    require_root()
    with tmpfs(tmp_path / "fs", "size=1m,nr_inodes=8,mode=1777") as fs:
        created = 0
        with contextlib.suppress(OSError):
            while created < 100:
                (fs / f"f{created}").touch()
                created += 1
        assert 0 < created < 100
        finding, _ = run_write(fs)
    assert (finding.status, finding.reason) == (Status.FAIL, "InodesExhausted"), finding
    assert finding.observed["stage"] == "open"


@pytest.mark.system
def test_read_only_tmpfs(tmp_path: Path) -> None:
    require_root()
    with tmpfs(tmp_path / "fs", "size=1m,ro") as fs:
        finding, _ = run_write(fs)
    assert (finding.status, finding.reason) == (Status.FAIL, "ReadOnlyFilesystem"), finding
    assert "EROFS" in finding.message


@pytest.mark.system
def test_root_ignores_what_the_job_cannot_do(tmp_path: Path) -> None:
    """The probe runs as the configured uid: a directory only root may write is denied to the job."""
    require_root()
    private = tmp_path / "private"
    private.mkdir(mode=0o755)
    as_job, _ = run_write(private)
    as_root, _ = run_write(private, uid=0, gid=0)
    assert (as_job.status, as_job.reason) == (Status.WARN, "WriteDenied"), as_job
    assert as_root.status == Status.OK
    missing, _ = run_write(tmp_path / "nope")
    assert (missing.status, missing.reason) == (Status.FAIL, "PathMissing")


def test_classification_of_outcomes() -> None:
    def classify(number: int | None, stage: str = "write", st: dict | None = None) -> Finding:
        outcome = {"stage": stage, "errno": number, "error": "", "statvfs": st}
        return write_finding(WriteProbeSpec(path="/mnt/x", uid=1000, gid=1000, bytes=10), outcome, 0.01)

    assert classify(None, "done").reason == "OK"
    assert classify(errno.EDQUOT, "close").reason == "DiskQuotaExceeded"
    # Filesystems with no inode limit report f_files == 0: that is not exhaustion.
    assert classify(errno.ENOSPC, st={"bavail": 0, "files": 0, "favail": 0}).reason == "DiskFull"
    assert classify(errno.ENOSPC, st={"bavail": 9, "files": 10, "favail": 0}).reason == "InodesExhausted"
    assert classify(errno.ENOSPC, st=None).reason == "DiskFull"
    assert classify(errno.EROFS, "open").reason == "ReadOnlyFilesystem"
    assert classify(errno.ESTALE, "open").reason == "MountStale"
    assert classify(errno.EIO, "fsync").reason == "WriteFailed"
    unknown = classify(errno.EPERM, "switch to uid/gid")
    assert (unknown.status, unknown.reason) == (Status.UNKNOWN, "WriteProbeFailed")
    assert write_probe_file_name("node a/1") == ".node-health-write-probe.node_a_1"
