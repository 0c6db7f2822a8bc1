"""Config of the storage family (`storage:`)."""

from __future__ import annotations

import os

from pydantic import Field, model_validator

from probes.family import Percent, PositiveSeconds, Section


class MountSpec(Section):
    path: str
    fstype: str = "*"  # fnmatch pattern: nfs4, nfs*, fuse.*, lustre
    source: str | None = None


class WriteProbeSpec(Section):
    path: str
    # None: storage.write_uid / write_gid. Write as the uid the jobs run as: root bypasses quota hard limits
    # and writes into the blocks ext4 reserves for it, so a probe as root passes where the job gets ENOSPC.
    uid: int | None = Field(None, ge=0)
    gid: int | None = Field(None, ge=0)
    bytes: int = Field(65536, ge=1)


class SpaceSpec(Section):
    path: str
    warn_percent: Percent = 85.0
    fail_percent: Percent = 95.0
    warn_inodes_percent: Percent = 85.0
    fail_inodes_percent: Percent = 95.0

    @model_validator(mode="after")
    def _ordered(self) -> SpaceSpec:
        if self.warn_percent > self.fail_percent:
            raise ValueError("warn_percent must not exceed fail_percent")
        if self.warn_inodes_percent > self.fail_inodes_percent:
            raise ValueError("warn_inodes_percent must not exceed fail_inodes_percent")
        return self


class ModelCacheSpec(Section):
    cache_dir: str
    repo_id: str
    revision: str = "main"


class StorageConfig(Section):
    mounts: list[MountSpec] = []
    mount_timeout_seconds: PositiveSeconds = 5.0
    write_probes: list[WriteProbeSpec] = []
    # The uid and gid of the write probes that name none: the uid the jobs run as (e.g. 1000). 0 (root)
    # passes where the jobs do not: quota hard limits and ext4's reserved blocks do not apply to root.
    write_uid: int = Field(0, ge=0)
    write_gid: int = Field(0, ge=0)
    # One write (N bytes + fsync + close) may take a while on a busy NFS server.
    write_timeout_seconds: PositiveSeconds = 10.0
    space: list[SpaceSpec] = [SpaceSpec(path="/")]
    space_timeout_seconds: PositiveSeconds = 5.0
    lock_globs: list[str] = [
        "/root/.cache/torch_extensions/*/*/lock",
        "/root/.cache/huggingface/hub/.locks/*/*.lock",
        "/root/.cache/modelscope/hub/.lock/*",
    ]
    stale_lock_age_seconds: PositiveSeconds = 1800.0
    remove_stale_locks: bool = False
    # File names (fnmatch) of existence-style locks (torch FileBaton: the file's existence is the lock).
    # Other lock files are flock-style unless they hold a SoftFileLock record ("<pid>\n<hostname>").
    baton_lock_names: list[str] = ["lock"]
    # While stale locks, old unlocked lock files or held flocks exist: py-spy up to this many Python processes
    # seen polling, to find those waiting (ProcessWaitingOnFileBaton, StaleFileLock, LockHeldByHungProcess);
    # 0 turns it off. py-spy pauses each process for a moment.
    lock_waiter_max_processes: int = Field(8, ge=0)
    # The py-spy command, every element kept: ["nsenter", "-t", "1", "-m", "--", "py-spy"] runs the host's
    # ([]: plain py-spy).
    py_spy_command: list[str] = ["py-spy"]
    # Filesystem types (fnmatch) where a lock holder may sit on another node: stale locks only warn there.
    shared_fstypes: list[str] = [
        "nfs*",
        "lustre",
        "fuse",
        "fuse.*",
        "cifs",
        "smb*",
        "ceph",
        "glusterfs",
        "gpfs",
        "beegfs",
        "afs",
        "9p",
        "virtiofs",
        "ocfs2",
        "gfs2",
        "wekafs",
    ]
    locks_timeout_seconds: PositiveSeconds = 5.0
    # Lock files inside containers' own filesystems, as each container sees them: walked through
    # /proc/<pid>/root once per mount namespace other than the host's. Empty: containers are not looked at.
    container_lock_globs: list[str] = [
        "/root/.cache/torch_extensions/*/*/lock",
        "/home/*/.cache/torch_extensions/*/*/lock",
        "/tmp/torch_extensions/*/*/lock",
        "/root/.cache/huggingface/hub/.locks/*/*.lock",
        "/home/*/.cache/huggingface/hub/.locks/*/*.lock",
        "/root/.cache/modelscope/hub/.lock/*",
        "/home/*/.cache/modelscope/hub/.lock/*",
    ]
    # At most this many containers' mount namespaces are walked per run (the rest: LockScanIncomplete).
    container_lock_max_namespaces: int = Field(64, ge=0)
    # Directory entries one walk (one host glob, or one container's globs) may look at before it stops
    # (LockScanIncomplete): a lock root with 400k directories must not look like a hung mount.
    lock_walk_max_entries: int = Field(100_000, ge=1)
    model_caches: list[ModelCacheSpec] = []
    model_cache_timeout_seconds: PositiveSeconds = 10.0

    def write_ids(self, spec: WriteProbeSpec) -> tuple[int, int]:
        """The uid and gid a write probe runs as: its own, else write_uid / write_gid."""
        return (
            self.write_uid if spec.uid is None else spec.uid,
            self.write_gid if spec.gid is None else spec.gid,
        )

    @model_validator(mode="after")
    def _unique_subjects(self) -> StorageConfig:
        for key, paths in (
            ("mounts", [m.path for m in self.mounts]),
            ("write_probes", [w.path for w in self.write_probes]),
        ):
            seen: set[str] = set()
            for path in paths:
                normal = os.path.normpath(path)
                if normal in seen:
                    raise ValueError(f"{key}: path {path} is listed twice")
                seen.add(normal)
        for key, patterns in (("lock_globs", self.lock_globs), ("container_lock_globs", self.container_lock_globs)):
            for glob_pattern in patterns:
                if not glob_pattern.startswith("/"):
                    raise ValueError(f"{key}: {glob_pattern!r} must be an absolute path")
        return self
