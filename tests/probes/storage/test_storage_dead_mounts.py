"""A dead FUSE share: the daemon of a mounted FUSE filesystem SIGKILLed, so every access fails with ENOTCONN
("Transport endpoint is not connected"), as when a juicefs/s3fs/sshfs daemon is OOM-killed. Every storage
check that touches it says MountDead with how to detach and remount it, a model cache on it is never
"download it", and with only storage.mounts configured the node is not ready."""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from support.cli import check_json
from support.fusefs import fuse_mount, mounted_at
from support.system import fuse_capable

from agent.config import parse_config
from probes.base import Check, Finding, ProbeContext, Status
from probes.runtime.children import ChildResult
from probes.runtime.host import Host
from probes.storage.common import child_error_finding
from probes.storage.locks import LocksProbe
from probes.storage.model_cache import ModelCacheProbe
from probes.storage.mounts import MountsProbe
from probes.storage.space import SpaceProbe
from probes.storage.write import WriteProbe

MODEL = "org/model-7b"


def findings_of(probe: Any, config: dict[str, Any]) -> dict[str, Finding]:
    output = probe.run(ProbeContext(Host(), parse_config(config), 15.0))
    return {f.subject: f for f in output if isinstance(f, Finding)}


def kill_daemon(mount_path: Path, pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:  # the kernel aborts the connection once the daemon's /dev/fuse is closed
        try:
            os.stat(mount_path)
        except OSError as exc:
            # A request in flight when the daemon died ends with ECONNABORTED; every one after is ENOTCONN.
            assert exc.errno in (errno.ENOTCONN, errno.ECONNABORTED), exc
            if exc.errno == errno.ENOTCONN:
                break
        assert time.monotonic() < deadline, "the FUSE connection was not aborted"
        time.sleep(0.02)
    assert mounted_at(mount_path) is not None  # still in the mount table: dead, not gone


def assert_mount_dead(finding: Finding, mount_path: Path) -> None:
    assert (finding.status, finding.reason) == (Status.FAIL, "MountDead"), finding
    assert "ENOTCONN (errno 107" in finding.message and "daemon is gone" in finding.message
    assert f"fusermount -uz {mount_path}" in finding.hint and f"umount -l {mount_path}" in finding.hint
    assert "remount the share" in finding.hint
    assert "permission" not in finding.hint and "download" not in finding.hint


@pytest.mark.system
def test_a_sigkilled_fuse_daemon_is_mount_dead_in_every_storage_check(tmp_path: Path) -> None:
    fuse_capable()
    with fuse_mount(tmp_path) as mount:
        cache = mount.path / "hub"
        (cache / "models--org--model-7b" / "refs").mkdir(parents=True)
        storage = {
            "mounts": [{"path": str(mount.path), "fstype": "fuse*"}],
            "space": [{"path": str(mount.path)}],
            "write_probes": [{"path": str(mount.path), "uid": 0, "gid": 0}],
            "model_caches": [{"cache_dir": str(cache), "repo_id": MODEL}],
            "lock_globs": [f"{cache}/.locks/*/*.lock"],
            "container_lock_globs": [],
        }
        config = {"storage": storage, "kubernetes": {"enabled": False}}
        healthy = findings_of(MountsProbe(), config)[str(mount.path)]
        assert healthy.status == Status.OK, healthy
        only_mounts = {"storage": {"mounts": storage["mounts"]}, "kubernetes": {"enabled": False}}
        assert check_json(only_mounts, tmp_path, "--only", "storage.mounts")["ready"] is True

        kill_daemon(mount.path, mount.daemon_pid)

        assert_mount_dead(findings_of(MountsProbe(), config)[str(mount.path)], mount.path)
        assert_mount_dead(findings_of(SpaceProbe(), config)[str(mount.path)], mount.path)
        assert_mount_dead(findings_of(WriteProbe(), config)[str(mount.path)], mount.path)
        # The cache on the dead share: the mount's reason, never "download it into the dead mount".
        (cached,) = findings_of(ModelCacheProbe(), config).values()
        assert_mount_dead(cached, mount.path)
        assert_mount_dead(findings_of(LocksProbe(), config)[f"{cache}/.locks/*/*.lock"], mount.path)

        report = check_json(only_mounts, tmp_path, "--only", "storage.mounts")
        assert report["ready"] is False
        assert [(r["check"], r["reason"]) for r in report["reasons"]] == [("storage.mounts", "MountDead")]


@pytest.mark.system
def test_eio_from_a_fuse_daemon_that_lost_its_backend_is_mount_dead(tmp_path: Path) -> None:
    """JuiceFS without its metadata engine, s3fs and sshfs without their server answer EIO: the share is dead, but
    its daemon lives and answers, and the finding says so (never "the daemon is gone"); a killed daemon is told
    apart by the kernel's ENOTCONN."""
    fuse_capable()
    with fuse_mount(tmp_path, "--getattr-errno", "EIO") as mount:
        config = {"storage": {"mounts": [{"path": str(mount.path), "fstype": "fuse"}]}}
        live = [findings_of(MountsProbe(), config)[str(mount.path)]]
        os.kill(mount.daemon_pid, 0)  # the daemon is alive all along
        kill_daemon(mount.path, mount.daemon_pid)
        dead = findings_of(MountsProbe(), config)[str(mount.path)]
    for finding in live:
        assert (finding.status, finding.reason) == (Status.FAIL, "MountDead"), finding
        assert (
            "EIO (errno 5" in finding.message
            and "daemon runs but answers every access with an error" in finding.message
        )
        assert "gone" not in finding.message and "killed" not in finding.hint
        assert "metadata engine" in finding.hint and "log" in finding.hint
        assert f"fusermount -uz {mount.path}" in finding.hint
        assert finding.observed["daemon"] == "answering errors"
    assert_mount_dead(dead, mount.path)


def test_eio_elsewhere_is_not_taken_for_a_dead_daemon() -> None:
    """EIO from a disk is not a dead FUSE daemon: it stays StatFailed (unknown) with the errno named."""
    check = Check("storage.space")
    failed = ChildResult("error", errno=errno.EIO, error="Input/output error (EIO)")
    on_disk = child_error_finding(check, "/data", failed, mount=("/data", "ext4"))
    assert (on_disk.status, on_disk.reason) == (Status.UNKNOWN, "StatFailed")
    on_fuse = child_error_finding(check, "/data", failed, mount=("/data", "fuse.juicefs"))
    assert on_fuse.reason == "MountDead" and "fusermount -uz /data" in on_fuse.hint
    gone = ChildResult("error", errno=errno.ENOTCONN, error="Transport endpoint is not connected (ENOTCONN)")
    assert child_error_finding(check, "/data", gone).reason == "MountDead"
