"""Which quota an EDQUOT came from: user, group, project, or a btrfs qgroup, as far as the kernel tells.

EDQUOT itself does not say which limit was hit. What can be known without privileges:
- the filesystem type: btrfs has no user or group quotas, only qgroups (one per subvolume, `0/<subvolume id>`);
- the quota types the filesystem was mounted with (mount options in the mount table: `usrquota`/`uquota`,
  `grpquota`/`gquota`, `prjquota`/`pquota`; ext4's quota feature and NFS, Lustre and FUSE filesystems show
  none there);
- the directory's project id (FS_IOC_FSGETXATTR, XFS and ext4): a directory with project id N under a
  filesystem with project quotas enabled is charged to project N (its new files inherit the id).

When exactly one kind can apply, the hint names it and the command that shows its usage; otherwise it gives
the command for each. `*_in_child` functions run in the write probe's child: `os`, `fcntl`, `struct` only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from dataclasses import dataclass

# _IOR('X', 31, struct fsxattr): fsx_xflags, fsx_extsize, fsx_nextents, fsx_projid, fsx_cowextsize, 8 pad bytes.
FS_IOC_FSGETXATTR = 0x801C581F
_FSXATTR = struct.Struct("IIIII8x")
# _IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args): treeid, objectid, name[4080]. With treeid 0 and
# objectid BTRFS_FIRST_FREE_OBJECTID (256) it returns the id of the subvolume the fd is in, unprivileged.
BTRFS_IOC_INO_LOOKUP = 0xD0009412
_BTRFS_FIRST_FREE_OBJECTID = 256
_INO_LOOKUP_SIZE = 4096

USER, GROUP, PROJECT, QGROUP = "user", "group", "project", "btrfs qgroup"
_OPTION_KINDS = {
    "usrquota": USER,
    "uquota": USER,
    "quota": USER,
    "usrjquota": USER,
    "grpquota": GROUP,
    "gquota": GROUP,
    "grpjquota": GROUP,
    "prjquota": PROJECT,
    "pquota": PROJECT,
    "prjjquota": PROJECT,
}


def quota_facts_in_child(directory: str) -> dict[str, int | None]:
    """Runs in the write probe's child, after EDQUOT: the directory's project id and btrfs subvolume id
    (None where the filesystem does not tell)."""
    facts: dict[str, int | None] = {"project_id": None, "btrfs_subvolume": None}
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return facts
    try:
        with contextlib.suppress(OSError):
            buffer = bytearray(_FSXATTR.size)
            fcntl.ioctl(fd, FS_IOC_FSGETXATTR, buffer, True)
            facts["project_id"] = _FSXATTR.unpack(buffer)[3]
        with contextlib.suppress(OSError):
            lookup = bytearray(struct.pack("QQ", 0, _BTRFS_FIRST_FREE_OBJECTID) + bytes(_INO_LOOKUP_SIZE - 16))
            fcntl.ioctl(fd, BTRFS_IOC_INO_LOOKUP, lookup, True)
            facts["btrfs_subvolume"] = struct.unpack_from("Q", lookup)[0]
    finally:
        os.close(fd)
    return facts


def enabled_kinds(options: str) -> set[str]:
    """Quota kinds the mount options (per-mount and superblock, comma separated) enable."""
    kinds = set()
    for option in options.replace(" ", ",").split(","):
        kind = _OPTION_KINDS.get(option.split("=", 1)[0])
        if kind:
            kinds.add(kind)
    return kinds


@dataclass(frozen=True)
class QuotaKind:
    what: str  # "uid 1000's user quota", "project 42's quota", "the btrfs qgroup 0/256 of the subvolume"
    kind: str  # user, group, project, btrfs qgroup, or "" when it cannot be told
    commands: tuple[str, ...]  # what shows the usage and the limit

    def hint(self) -> str:
        told = f"{self.what} is used up here" if self.kind else f"a quota is used up here ({self.what})"
        return (
            f"{told}: delete your own old files (checkpoints, caches, logs) or ask the storage admins for more "
            f"quota; see it with {'; '.join(f'`{command}`' for command in self.commands)}"
        )


def quota_kind(
    path: str,
    mount_point: str,
    fstype: str,
    options: str,
    uid: int,
    gid: int,
    project_id: int | None,
    btrfs_subvolume: int | None,
) -> QuotaKind:
    """Which quota the EDQUOT of a write as uid:gid in `path` came from, and the commands that show it."""
    if fstype == "btrfs":
        qgroup = f"0/{btrfs_subvolume}" if btrfs_subvolume else "of the subvolume"
        what = f"the btrfs qgroup {qgroup}" if btrfs_subvolume else "the subvolume's btrfs qgroup"
        return QuotaKind(what, QGROUP, (f"btrfs qgroup show -reF {path}",))
    if fstype.startswith("lustre"):
        commands: tuple[str, ...] = (f"lfs quota -h -u {uid} {path}", f"lfs quota -h -g {gid} {path}")
        if project_id:
            commands += (f"lfs quota -h -p {project_id} {path}",)
        return QuotaKind(f"uid {uid}, gid {gid} or project quota", "", commands)
    kinds = enabled_kinds(options)
    if project_id == 0 or project_id is None:
        kinds.discard(PROJECT)  # files written here are charged to no project
    by_kind = {
        USER: (f"uid {uid}'s user quota", _user_command(fstype, mount_point, uid)),
        GROUP: (f"gid {gid}'s group quota", _group_command(fstype, mount_point, gid)),
        PROJECT: (f"project {project_id}'s quota", _project_command(fstype, mount_point, project_id)),
    }
    if len(kinds) == 1:
        (kind,) = kinds
        what, command = by_kind[kind]
        return QuotaKind(what, kind, (command,))
    candidates = sorted(kinds) if kinds else [USER, GROUP, *([PROJECT] if project_id else [])]
    what = " or ".join(by_kind[kind][0] for kind in candidates)
    listed = tuple(by_kind[kind][1] for kind in candidates)
    if not kinds and fstype.startswith("nfs"):
        what += "; on NFS the server enforces it, `quota` asks its rquotad"
    return QuotaKind(what, "", listed)


def _user_command(fstype: str, mount_point: str, uid: int) -> str:
    return f"xfs_quota -x -c 'quota -u -h {uid}' {mount_point}" if fstype == "xfs" else f"quota -s -u {uid}"


def _group_command(fstype: str, mount_point: str, gid: int) -> str:
    return f"xfs_quota -x -c 'quota -g -h {gid}' {mount_point}" if fstype == "xfs" else f"quota -s -g {gid}"


def _project_command(fstype: str, mount_point: str, project_id: int | None) -> str:
    if fstype == "xfs":
        return f"xfs_quota -x -c 'quota -p -h {project_id}' {mount_point}"
    return f"repquota -P -s {mount_point}"
