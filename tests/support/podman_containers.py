"""Real podman containers for the holder tests: runc and the cgroupfs manager (they work on cgroup v1 hosts as on
v2; the container's cgroup is `/libpod_parent/libpod-<64 hex>`), run from a root filesystem made here out of the
host's busybox and the libraries it links, so no image is pulled or built. Each container is removed afterwards.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from support.podman import podman, ulimits
from support.system import require, require_root, require_tool


def busybox_rootfs(root: Path) -> Path:
    """A root filesystem with the host's busybox (its applets as links) and the shared libraries it needs."""
    require_root()
    busybox = require_tool("busybox")
    for sub in ("bin", "dev", "proc", "sys", "tmp", "etc"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, root / "bin" / "busybox")
    linked = subprocess.run(["ldd", busybox], capture_output=True, text=True, check=False).stdout
    for library in {word for word in linked.split() if word.startswith("/")}:
        target = root / library.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(library).resolve(), target)
    for applet in ("sh", "sleep", "nc", "touch", "mkdir"):
        (root / "bin" / applet).symlink_to("busybox")
    return root


@dataclass(frozen=True)
class Container:
    id: str
    pid: int  # the container's first process, as the host's /proc numbers it

    @property
    def short_id(self) -> str:
        return self.id[:12]


@contextlib.contextmanager
def podman_container(
    rootfs: Path, script: str, *run_args: str, ready: Callable[[Container], bool] | None = None
) -> Iterator[Container]:
    """`sh -c SCRIPT` in a detached podman container on `rootfs` (with `run_args`, e.g. --device), until the
    block ends; `ready` is waited for (10 s) before the block starts."""
    require_root()
    require(bool(shutil.which("podman")) and bool(shutil.which("runc")), "podman and runc")
    name = f"node-health-test-{uuid.uuid4().hex[:12]}"
    podman("run", "--detach", "--name", name, *ulimits(), *run_args, "--rootfs", str(rootfs), "/bin/sh", "-c", script)
    try:
        (state,) = json.loads(podman("inspect", name).stdout)
        container = Container(state["Id"], int(state["State"]["Pid"]))
        deadline = time.monotonic() + 10
        while ready is not None and not ready(container):
            assert time.monotonic() < deadline, f"container {name} not ready: {podman('logs', name, check=False)}"
            time.sleep(0.05)
        yield container
    finally:
        podman("rm", "--force", "--time", "0", name, check=False)


def holds_fd(target: str) -> Callable[[Container], bool]:
    """Ready once the container's process has an fd whose link reads `target`."""

    def check(container: Container) -> bool:
        fd_dir = Path(f"/proc/{container.pid}/fd")
        with contextlib.suppress(OSError):
            return any(str(link.readlink()) == target for link in fd_dir.iterdir())
        return False

    return check
