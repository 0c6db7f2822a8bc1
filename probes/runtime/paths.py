"""Where the host's filesystems are, seen from the agent, and host paths joined under them.

The agent runs in a container: the host's /proc, /sys, /dev and root filesystem are mounted wherever the
DaemonSet puts them (hostPID's /proc, the host's root under /host). Every probe reaches a host file through
these four, never through a literal "/proc" or "/sys", so one setting moves them all (node_exporter's
--path.procfs, --path.sysfs and --path.rootfs are the model). The settings are the `proc`, `sys`, `dev` and
`root` keys of the `host:` section: the host family's config model embeds `HostPaths`, so the keys stay where
operators have always written them while the model lives with the runtime that every family uses.

A path joined under one of them is normalised first (`join_under`), so `..` in a path someone else wrote (a
mount point, a lock file a process waits on) never climbs out of the directory it is joined under.

`join_under` is lexical: a symlink below the base is followed by the kernel, and an absolute link target
(`/data` -> `/mnt/disk`) would then be taken in the agent's own filesystem, not the host's. `resolve_under`
resolves a host path's symlinks the way the host resolves them, inside the host root.
"""

from __future__ import annotations

import errno
import os
import posixpath
from pathlib import Path

from pydantic import BaseModel, ConfigDict

# As the kernel: at most this many symlinks on one path (MAXSYMLINKS), then ELOOP.
MAX_SYMLINKS = 40


def normalize_host_path(path: str | Path) -> str:
    """`path` as an absolute host path with `.`, `..` and repeated slashes resolved lexically: never above `/`."""
    text = str(path)
    return posixpath.normpath("/" + text.lstrip("/")) if text else "/"


def join_under(base: str | Path, path: str | Path) -> Path:
    """`path` (absolute or not) below `base`: `join_under("/host", "/etc/../etc/hosts")` is /host/etc/hosts,
    and no `..` in `path` reaches above `base`. Lexical only: a symlink below `base` is followed as always."""
    return Path(base).joinpath(normalize_host_path(path).lstrip("/"))


def resolve_under(root: str, path: str) -> str:
    """The host path `path` with every symlink in it resolved as the host would, inside `root` (the host's
    root as the agent sees it): an absolute link target starts again at `root`, and `..` never climbs above it.

    Reads links only (readlink(2) of each component; never stat), so a component that is a mount point is
    not asked for its attributes; a component on a hung filesystem blocks, so call it in a child with a
    deadline. Only `os` and pure Python: it runs in forked children. The first component that does not exist
    ends the resolution, the rest is kept as written. Raises OSError for any other error (ELOOP past
    MAX_SYMLINKS, ENOTCONN from a dead FUSE mount on the way, EACCES).
    """
    pending = [part for part in path.split("/") if part][::-1]  # a stack: the next component is last
    resolved: list[str] = []
    links = 0
    while pending:
        part = pending.pop()
        if part == ".":
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        try:
            target = os.readlink(os.path.join(root, *resolved, part))
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # not a symlink
                resolved.append(part)
                continue
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                rest = "/".join([part, *pending[::-1]])
                return normalize_host_path("/".join(["", *resolved, rest]))
            raise
        links += 1
        if links > MAX_SYMLINKS:
            raise OSError(errno.ELOOP, f"more than {MAX_SYMLINKS} symlinks", path)
        if target.startswith("/"):
            resolved = []
        pending.extend([piece for piece in target.split("/") if piece][::-1])
    return "/" + "/".join(resolved)


class HostPaths(BaseModel):
    """The host's /proc, /sys, /dev and root as the agent sees them (the `host:` section's first four keys)."""

    # Strict like every config section (probes.base.Section): unknown keys are errors, values are frozen.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    proc: str = "/proc"
    sys: str = "/sys"
    dev: str = "/dev"
    root: str = "/"

    def proc_path(self, *parts: str | int) -> Path:
        """`proc_path(42, "ns", "mnt")` is <proc>/42/ns/mnt."""
        return join_under(self.proc, "/".join(str(part) for part in parts))

    def sys_path(self, *parts: str) -> Path:
        return join_under(self.sys, "/".join(parts))

    def dev_path(self, *parts: str) -> Path:
        return join_under(self.dev, "/".join(parts))

    def root_path(self, host_path: str | Path) -> Path:
        """A host path (e.g. /mnt/share) as seen from the agent (e.g. /host/mnt/share)."""
        return join_under(self.root, host_path)

    def host_path(self, agent_path: str | Path) -> str:
        """The inverse of `root_path`: /host/etc/chrony.conf → /etc/chrony.conf (a path outside the root stays)."""
        root = str(Path(self.root)).rstrip("/")
        text = str(agent_path)
        if not root:
            return normalize_host_path(text)
        if text != root and not text.startswith(root + "/"):
            return text
        return normalize_host_path(text[len(root) :])
