"""storage.write on real filesystems on loop devices: ext4 full into its reserved blocks (root writes on where the
job's uid 1000 gets ENOSPC, so the probe must run as the job: storage.write_uid), and a btrfs subvolume over its
qgroup limit (the hint names the qgroup, not a per-user quota). The quota kinds the kernel cannot show here
(XFS/ext4 project quotas need CONFIG_QUOTA) are told from the same facts in the pure part."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.system import require_root, require_tool, traversable_tmp_dir

from agent.config import parse_config
from probes.base import Finding, ProbeContext, Status
from probes.runtime.host import Host
from probes.storage.quota import enabled_kinds, quota_kind
from probes.storage.write import WriteProbe

JOB = 1000


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A temp dir the job uid can traverse."""
    with traversable_tmp_dir("nh-quota-") as path:
        yield path


@contextlib.contextmanager
def loop_filesystem(tmp_path: Path, size_mib: int, mkfs: list[str]) -> Iterator[Path]:
    """A fresh filesystem on a loop device over a sparse image, mounted at tmp_path/mnt."""
    require_root()
    require_tool("losetup")
    require_tool(mkfs[0])
    image = tmp_path / "disk.img"
    with open(image, "wb") as handle:
        handle.truncate(size_mib << 20)
    device = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True, check=True)
    loop = device.stdout.strip()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        subprocess.run([*mkfs, loop], capture_output=True, check=True)
        subprocess.run(["mount", loop, str(mnt)], check=True)
        try:
            yield mnt
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)


def fill_as(uid: int, path: Path) -> None:
    """Write as `uid` until the kernel says ENOSPC (or EDQUOT)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            for size in (1 << 20, 4096):  # big chunks, then the last few blocks
                chunk = os.urandom(size)
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, chunk)
            with contextlib.suppress(OSError):
                os.fsync(fd)
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(1)
    assert os.waitpid(pid, 0)[1] == 0


def write_findings(storage: dict[str, Any]) -> dict[str, Finding]:
    config = parse_config({"node_name": "node-q", "storage": storage})
    output = WriteProbe().run(ProbeContext(Host(), config, 15.0))
    return {f.subject: f for f in output if isinstance(f, Finding)}


@pytest.mark.system
def test_root_writes_into_ext4_reserved_blocks_the_job_uid_gets_no_space(tmp_path: Path) -> None:
    """The default uid 0 passes on a disk the job cannot write to; write_uid makes the probe the job."""
    with loop_filesystem(tmp_path, 64, ["mkfs.ext4", "-q", "-m", "10"]) as fs:
        scratch = fs / "scratch"
        scratch.mkdir(mode=0o777)
        scratch.chmod(0o1777)
        fill_as(JOB, scratch / "filler")
        st = os.statvfs(scratch)
        # Less than one probe write left for the job; only root's reserved blocks are free.
        assert st.f_bavail * st.f_frsize < 65536 and st.f_bfree * st.f_frsize > 1 << 20
        as_root = write_findings({"write_probes": [{"path": str(scratch)}]})[str(scratch)]
        as_job = write_findings(
            {"write_uid": JOB, "write_gid": JOB, "write_probes": [{"path": str(scratch)}, {"path": str(fs)}]}
        )
        own_uid = write_findings({"write_uid": JOB, "write_probes": [{"path": str(scratch), "uid": 0}]})
    assert (as_root.status, as_root.reason) == (Status.OK, "OK"), as_root
    assert "as uid 0:0" in as_root.message
    full = as_job[str(scratch)]
    assert (full.status, full.reason) == (Status.FAIL, "DiskFull"), full
    assert f"as uid {JOB}:{JOB}" in full.message and "ENOSPC (errno 28" in full.message
    assert "grow the disk" in full.hint
    denied = as_job[str(fs)]  # the filesystem's root directory belongs to root: the job may not create there
    assert (denied.status, denied.reason) == (Status.WARN, "WriteDenied"), denied
    assert "storage.write_uid" in denied.hint
    assert own_uid[str(scratch)].status == Status.OK  # a probe's own uid wins over write_uid


@pytest.mark.system
def test_a_btrfs_qgroup_over_its_limit_is_told_as_a_qgroup(tmp_path: Path) -> None:
    require_tool("btrfs")
    with loop_filesystem(tmp_path, 300, ["mkfs.btrfs", "-q", "-f"]) as fs:
        subprocess.run(["btrfs", "quota", "enable", str(fs)], check=True)
        volume = fs / "vol"
        subprocess.run(["btrfs", "subvolume", "create", str(volume)], capture_output=True, check=True)
        subprocess.run(["btrfs", "qgroup", "limit", "1M", str(volume)], check=True)
        volume.chmod(0o1777)
        subvolume_id = int(
            subprocess.run(
                ["btrfs", "inspect-internal", "rootid", str(volume)], capture_output=True, text=True, check=True
            ).stdout
        )
        storage = {"write_uid": JOB, "write_gid": JOB, "write_probes": [{"path": str(volume), "bytes": 4 << 20}]}
        finding = write_findings(storage)[str(volume)]
    assert (finding.status, finding.reason) == (Status.FAIL, "DiskQuotaExceeded"), finding
    assert "EDQUOT (errno 122" in finding.message
    assert f"the btrfs qgroup 0/{subvolume_id}" in finding.message
    assert finding.observed["quota_kind"] == "btrfs qgroup"
    assert finding.hint.startswith(f"the btrfs qgroup 0/{subvolume_id} is used up here")
    assert f"`btrfs qgroup show -reF {volume}`" in finding.hint
    assert "quota -s -u" not in finding.hint  # btrfs has no per-user quota


def test_quota_kind_from_the_mount_options_and_the_project_id() -> None:
    """What the kernel tells: the quota types a filesystem was mounted with, the directory's project id."""
    assert enabled_kinds("rw,relatime,attr2,inode64,usrquota,prjquota") == {"user", "project"}
    assert enabled_kinds("rw,relatime,uquota,gquota") == {"user", "group"}

    def kind(fstype: str, options: str, project: int | None = None) -> Any:
        return quota_kind("/data/u", "/data", fstype, options, 1000, 2000, project, None)

    project = kind("xfs", "rw,prjquota", 42)
    assert (project.kind, project.what) == ("project", "project 42's quota")
    assert project.commands == ("xfs_quota -x -c 'quota -p -h 42' /data",)
    # Project quotas on, but this directory is in no project: the user quota is what remains.
    user = kind("xfs", "rw,usrquota,prjquota", 0)
    assert (user.kind, user.commands) == ("user", ("xfs_quota -x -c 'quota -u -h 1000' /data",))
    group = kind("ext4", "rw,relatime,grpquota")
    assert (group.kind, group.what, group.commands) == ("group", "gid 2000's group quota", ("quota -s -g 2000",))
    both = kind("ext4", "rw,usrquota,grpquota,prjquota", 7)
    assert both.kind == "" and "uid 1000's user quota" in both.what and "project 7's quota" in both.what
    assert "repquota -P -s /data" in both.commands
    nfs = kind("nfs4", "rw,vers=4.2")
    assert nfs.kind == "" and nfs.commands == ("quota -s -u 1000", "quota -s -g 2000") and "rquotad" in nfs.what
    lustre = kind("lustre", "rw,flock", 9)
    assert lustre.commands[-1] == "lfs quota -h -p 9 /data/u"
    assert lustre.hint().startswith("a quota is used up here (uid 1000, gid 2000 or project quota)")


def test_the_shipped_config_probes_as_the_runners_uid() -> None:
    """deploy/configmap.yaml sets write_uid/write_gid 1000: a write probe added there runs as the job, not root."""
    import yaml
    from support.system import REPO

    from probes.storage.config import StorageConfig, WriteProbeSpec

    configmap = yaml.safe_load((REPO / "deploy" / "configmap.yaml").read_text())
    shipped = parse_config(yaml.safe_load(configmap["data"]["config.yaml"]))
    storage = shipped.storage
    assert isinstance(storage, StorageConfig)
    assert storage.write_ids(WriteProbeSpec(path="/mnt/share/scratch")) == (1000, 1000)
    assert storage.write_ids(WriteProbeSpec(path="/x", uid=4000, gid=4001)) == (4000, 4001)
    assert parse_config({}).storage.write_ids(WriteProbeSpec(path="/x")) == (0, 0)  # the built-in default
