"""Real podman containers for the holder tests: runc and the cgroupfs manager (they work on cgroup v1 hosts as on
v2; the container's cgroup is `/libpod_parent/libpod-<64 hex>`), run from a root filesystem made here out of the
host's busybox and the libraries it links, so no image is pulled or built. Each container is removed afterwards.
"""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from support.system import require, require_root, require_tool


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = [require_tool("podman"), "--runtime", require_tool("runc"), "--cgroup-manager", "cgroupfs", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, f"{' '.join(argv)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _ulimits() -> list[str]:
    """podman's default limits exceed this host's hard limits, which runc may not raise: stay at or below them."""
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1 << 20)
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 4096)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


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
    podman("run", "--detach", "--name", name, *_ulimits(), *run_args, "--rootfs", str(rootfs), "/bin/sh", "-c", script)
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
