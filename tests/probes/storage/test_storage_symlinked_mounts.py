"""Mount paths configured through a symlink (`/data` -> the mount point), on a real tmpfs: the path is resolved
inside the host root before the mount table is consulted, in a child with a deadline (the target may be a hung
mount), and the message shows both the path and its target. A healthy disk behind a symlink is never
MountMissing, and the model caches under it are judged as caches."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.fusefs import fuse_mount
from support.system import fuse_capable, require_root, wait_reaped

from agent.config import parse_config
from probes.base import Finding, ProbeContext, Status
from probes.runtime.children import ChildCalls
from probes.runtime.host import Host
from probes.storage.model_cache import ModelCacheProbe, hub_repo_folder
from probes.storage.mounts import MountsProbe
from probes.storage.space import SpaceProbe

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
MODEL = "org/model-7b"


def findings_of(probe: Any, storage: dict[str, Any], host: Host | None = None) -> dict[str, Finding]:
    output = probe.run(ProbeContext(host or Host(), parse_config({"storage": storage}), 10.0))
    return {f.subject: f for f in output if isinstance(f, Finding)}


@contextlib.contextmanager
def tmpfs(path: Path, source: str) -> Iterator[Path]:
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", source, str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def complete_cache(cache: Path) -> None:
    repo = cache / hub_repo_folder(MODEL)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "blobs").mkdir()
    (repo / "blobs" / ("a" * 40)).write_text("{}")
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "snapshots" / COMMIT / "config.json").symlink_to(f"../../blobs/{'a' * 40}")


@pytest.mark.system
def test_a_mount_configured_through_a_symlink_is_found_at_its_target(tmp_path: Path) -> None:
    require_root()
    with tmpfs(tmp_path / "mnt" / "disk", "nh-symlinked") as disk:
        data = tmp_path / "data"
        data.symlink_to(disk)  # absolute, as an operator writes /data -> /mnt/disk
        relative = tmp_path / "models"
        relative.symlink_to("mnt/disk")  # relative
        complete_cache(disk / "hub")
        storage = {
            "mounts": [
                {"path": str(data), "fstype": "tmpfs", "source": "nh-symlinked"},
                {"path": str(relative), "fstype": "tmpfs"},
            ],
            "model_caches": [{"cache_dir": str(data / "hub"), "repo_id": MODEL}],
            "space": [{"path": str(data)}],
        }
        mounts = findings_of(MountsProbe(), storage)
        caches = findings_of(ModelCacheProbe(), storage)
        space = findings_of(SpaceProbe(), storage)
        for path in (data, relative):
            finding = mounts[str(path)]
            assert (finding.status, finding.reason) == (Status.OK, "OK"), finding
            assert f"{path} (a symlink to {disk}): tmpfs from nh-symlinked answered" in finding.message
            assert finding.observed["target"] == str(disk)
        (cache,) = caches.values()
        assert (cache.status, cache.reason) == (Status.OK, "OK"), cache
        assert space[str(data)].status == Status.OK

    # The disk gone, the symlink still there: missing, naming both the path and the mount point it means.
    mounts = findings_of(MountsProbe(), storage)
    missing = mounts[str(data)]
    assert (missing.status, missing.reason) == (Status.FAIL, "MountMissing"), missing
    assert missing.message == f"{data} (a symlink to {disk}) is not mounted (expected tmpfs from nh-symlinked)"
    assert "mount it" in missing.hint
    (cache,) = findings_of(ModelCacheProbe(), storage).values()
    assert (cache.status, cache.reason) == (Status.FAIL, "ModelCacheMountMissing"), cache
    assert f"a symlink to {disk}" in cache.message and "do not download" in cache.hint


@pytest.mark.system
def test_a_symlink_into_a_hung_mount_is_resolved_in_a_child_with_a_deadline(tmp_path: Path) -> None:
    fuse_capable()
    host = Host(children=ChildCalls())
    with fuse_mount(tmp_path, "--hang-getattr") as mount:
        to_root = tmp_path / "share"
        to_root.symlink_to(mount.path)
        into = tmp_path / "deep"
        into.symlink_to(mount.path / "sub" / "dir")  # resolving it looks up `sub` on the hung mount
        storage = {
            "mounts": [{"path": str(to_root), "fstype": "fuse"}, {"path": str(into), "fstype": "fuse"}],
            "mount_timeout_seconds": 0.5,
        }
        started = time.monotonic()
        findings = findings_of(MountsProbe(), storage, host)
        assert time.monotonic() - started < 1.5
        for path in (to_root, into):
            finding = findings[str(path)]
            assert (finding.status, finding.reason) == (Status.FAIL, "MountHung"), finding
            assert "mount | grep" in finding.hint
    assert wait_reaped(host.children) == {}


def test_a_symlink_to_an_absolute_path_stays_inside_the_host_root(tmp_path: Path) -> None:
    """With host.root at a directory, `/data -> /mnt/disk` is the host's /mnt/disk, not the agent's: the mount
    table is asked for /mnt/disk (here: not mounted), and the stat goes below the root."""
    root = tmp_path / "host"
    (root / "mnt" / "disk").mkdir(parents=True)
    (root / "data").symlink_to("/mnt/disk")
    (root / "escape").symlink_to("../../../../../../etc")
    host = Host(root=root)
    finding = findings_of(MountsProbe(), {"mounts": [{"path": "/data", "fstype": "nfs4"}]}, host)["/data"]
    assert (finding.status, finding.reason) == (Status.FAIL, "MountMissing"), finding
    assert finding.message == "/data (a symlink to /mnt/disk) is not mounted (expected nfs4)"
    escaped = findings_of(MountsProbe(), {"mounts": [{"path": "/escape", "fstype": "*"}]}, host)["/escape"]
    assert escaped.observed["target"] == "/etc"  # the host root's /etc, never above it
    assert os.path.realpath(root / "escape") != str(root / "etc")  # the kernel alone would have left the root
