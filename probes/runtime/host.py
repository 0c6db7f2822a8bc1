"""Host access, the one object a probe reaches the host through: where the host's /proc, /sys, /dev and root
are (`probes.runtime.paths`), host commands with a hard deadline (`probes.runtime.commands`), filesystem calls
in a child process with a deadline (`probes.runtime.children`), and which accelerator sits on which PCI
function (`probes.runtime.inventory`)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from probes.runtime.children import ChildCalls, ChildResult
from probes.runtime.commands import CommandResult, run_command
from probes.runtime.inventory import DeviceInventory
from probes.runtime.paths import HostPaths


class Host:
    """The host as the agent sees it (in the DaemonSet: root=/host, hostPID).

    `Host(paths)` takes the `host:` section's paths; `Host(proc=..., root=...)` overrides single ones (tests,
    benchmarks). `proc`, `sys`, `dev` and `root` are the four as `Path`s; `proc_path()` and the others join a
    host path under them without letting `..` climb out.
    """

    def __init__(
        self,
        paths: HostPaths | None = None,
        *,
        proc: str | Path | None = None,
        sys: str | Path | None = None,
        dev: str | Path | None = None,
        root: str | Path | None = None,
        children: ChildCalls | None = None,
        devices: DeviceInventory | None = None,
    ) -> None:
        given = {"proc": proc, "sys": sys, "dev": dev, "root": root}
        overrides = {key: str(value) for key, value in given.items() if value is not None}
        self.paths = (paths or HostPaths()).model_copy(update=overrides)
        self.proc = Path(self.paths.proc)
        self.sys = Path(self.paths.sys)
        self.dev = Path(self.paths.dev)
        self.root = Path(self.paths.root)
        self.children = children or ChildCalls()
        # Bus-Id → accelerator, published by the npu and gpu probes and read by pcie; kept across reloads.
        self.devices = devices if devices is not None else DeviceInventory()

    @classmethod
    def from_config(
        cls, paths: HostPaths, children: ChildCalls | None = None, devices: DeviceInventory | None = None
    ) -> Host:
        """The host at the configured paths (the `host:` section, which is a `HostPaths`); `children` and
        `devices` carry over from the previous Host on a reload."""
        own = HostPaths(proc=paths.proc, sys=paths.sys, dev=paths.dev, root=paths.root)
        return cls(own, children=children, devices=devices)

    def proc_path(self, *parts: str | int) -> Path:
        return self.paths.proc_path(*parts)

    def sys_path(self, *parts: str) -> Path:
        return self.paths.sys_path(*parts)

    def dev_path(self, *parts: str) -> Path:
        return self.paths.dev_path(*parts)

    def root_path(self, path: str | Path) -> Path:
        """A host path (e.g. /mnt/share) as seen from the agent (e.g. /host/mnt/share)."""
        return self.paths.root_path(path)

    def which(self, name: str) -> str | None:
        return shutil.which(name)

    def run(
        self, argv: Sequence[str], timeout: float, env: dict[str, str] | None = None, max_output_bytes: int = 4 << 20
    ) -> CommandResult:
        return run_command(argv, timeout, env=env, max_output_bytes=max_output_bytes)

    def child_call(
        self, key: str, fn: Callable[..., Any], *args: Any, timeout: float, deadline: float | None = None
    ) -> ChildResult:
        return self.children.call(key, fn, *args, timeout=timeout, deadline=deadline)
