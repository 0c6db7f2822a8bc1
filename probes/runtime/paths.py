"""Where the host's filesystems are, seen from the agent, and host paths joined under them.

The agent runs in a container: the host's /proc, /sys, /dev and root filesystem are mounted wherever the
DaemonSet puts them (hostPID's /proc, the host's root under /host). Every probe reaches a host file through
these four, never through a literal "/proc" or "/sys", so one setting moves them all (node_exporter's
--path.procfs, --path.sysfs and --path.rootfs are the model). The settings are the `proc`, `sys`, `dev` and
`root` keys of the `host:` section: the host family's config model embeds `HostPaths`, so the keys stay where
operators have always written them while the model lives with the runtime that every family uses.

A path joined under one of them is normalised first (`join_under`), so `..` in a path someone else wrote (a
mount point, a lock file a process waits on) never climbs out of the directory it is joined under.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from pydantic import BaseModel, ConfigDict


def normalize_host_path(path: str | Path) -> str:
    """`path` as an absolute host path with `.`, `..` and repeated slashes resolved lexically: never above `/`."""
    text = str(path)
    return posixpath.normpath("/" + text.lstrip("/")) if text else "/"


def join_under(base: str | Path, path: str | Path) -> Path:
    """`path` (absolute or not) below `base`: `join_under("/host", "/etc/../etc/hosts")` is /host/etc/hosts,
    and no `..` in `path` reaches above `base`. Lexical only: a symlink below `base` is followed as always."""
    return Path(base).joinpath(normalize_host_path(path).lstrip("/"))


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
