"""Real processes in real cgroups named like Kubernetes pods' containers, holding device nodes.

`idle_devices()` picks real character devices no process holds right now (tests on a shared machine must not
count another test's holder of /dev/full as theirs). `pod_cgroups()` makes
`<hierarchy>/node-health-test-<id>/kubepods/burstable/pod<uid>/<container id>` in the hierarchy that
/proc/PID/cgroup names first for classification (cgroup v1 memory, else v2), moves processes into it and
removes it afterwards. `holding()` starts a process that keeps a path open. `containerd_bundle()` writes
the OCI bundle containerd keeps for a container (only its annotations), under a fake host root.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from probes.runtime.procfs import scan_in_process
from support.system import require, require_root

# Real character devices that open read-only anywhere without side effects.
_CANDIDATES = (
    "/dev/full",
    "/dev/random",
    "/dev/kmsg",
    "/dev/autofs",
    "/dev/hwrng",
    "/dev/kvm",
    "/dev/loop-control",
    "/dev/btrfs-control",
    "/dev/cpu_dma_latency",
)


def idle_devices(count: int) -> list[tuple[int, int]]:
    """(major, minor) of `count` character devices that open here and that no process holds at the moment."""
    require_root()
    usable: dict[int, str] = {}
    for path in _CANDIDATES:
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK))
            usable.setdefault(os.stat(path).st_rdev, path)
        except OSError:
            continue
    held = {match[4][1] for match in scan_in_process("/proc", frozenset(usable), frozenset(), frozenset())["matches"]}
    idle = [(os.major(rdev), os.minor(rdev)) for rdev in usable if rdev not in held]
    require(len(idle) >= count, f"{count} character devices no process holds (of {', '.join(usable.values())})")
    return idle[:count]


@dataclass(frozen=True)
class PodCgroup:
    uid: str
    container_id: str
    path: Path

    def add(self, pid: int) -> None:
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            require(False, f"moving a process into a cgroup: {exc}")


def cgroup_hierarchy() -> Path | None:
    """A writable cgroup hierarchy that classify_cgroup reads: v1 memory, else a v2 root."""
    for root in (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")):
        if (root / "cgroup.procs").exists() and os.access(root, os.W_OK):
            if root.name != "memory" and not (root / "cgroup.controllers").exists():
                continue
            return root
    return None


@contextlib.contextmanager
def pod_cgroups(count: int) -> Iterator[list[PodCgroup]]:
    """`count` pod container cgroups (each its own pod UID), removed when the block ends (after the test has
    killed what it put in them)."""
    require_root()
    root = cgroup_hierarchy()
    require(root is not None, "a writable cgroup hierarchy (memory v1 or v2)")
    assert root is not None
    top = root / f"node-health-test-{uuid.uuid4().hex[:8]}"
    pods = []
    for _ in range(count):
        uid, container_id = str(uuid.uuid4()), uuid.uuid4().hex + uuid.uuid4().hex  # a 64-hex container id
        pods.append(PodCgroup(uid, container_id, top / "kubepods" / "burstable" / f"pod{uid}" / container_id))
    try:
        for pod in pods:
            pod.path.mkdir(parents=True)
    except OSError as exc:
        require(False, f"creating a cgroup: {exc}")
    try:
        yield pods
    finally:
        _remove_tree(top)


def _remove_tree(top: Path) -> None:
    leaves = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
    for directory in [*leaves, top]:
        for _ in range(100):  # a killed process leaves its cgroup asynchronously
            try:
                directory.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)


@contextlib.contextmanager
def holding(path: Path, *extra_args: str) -> Iterator[subprocess.Popen[bytes]]:
    """A real child process that keeps `path` open until the block ends (extra argv words, before the path,
    are just carried: a command line to find or not in messages)."""
    code = "import os,sys,time;os.open(sys.argv[-1],os.O_RDONLY);print('ready',flush=True);time.sleep(300)"
    child = subprocess.Popen([sys.executable, "-c", code, *extra_args, str(path)], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        yield child
    finally:
        child.kill()
        child.wait()


# Maps one page of a device node (MAP_PRIVATE: /dev/zero's number allows it, and its shared mappings become shmem)
# with libc's mmap (Python's mmap module keeps a dup of the fd), then closes the fd: only the mapping holds it.
_MAPPER = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fd = os.open(sys.argv[-1], os.O_RDWR)
address = libc.mmap(None, 4096, 3, 2, fd, 0)
assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
os.close(fd)
print("ready", flush=True)
time.sleep(300)
"""


@contextlib.contextmanager
def mapping(path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real child process that has `path` (a device node that maps, e.g. /dev/zero's 1:5) mapped and no fd
    open on it, until the block ends."""
    child = subprocess.Popen([sys.executable, "-c", _MAPPER, str(path)], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        fds = [os.readlink(f"/proc/{child.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{child.pid}/fd")]
        assert str(path) not in fds, fds
        yield child
    finally:
        child.kill()
        child.wait()


def containerd_bundle(host_root: Path, container_id: str, namespace: str, name: str, container: str) -> Path:
    """config.json of a container as containerd's CRI plugin writes it (annotations only) under host_root."""
    bundle = host_root / "run/containerd/io.containerd.runtime.v2.task/k8s.io" / container_id
    bundle.mkdir(parents=True)
    annotations = {
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.sandbox-namespace": namespace,
        "io.kubernetes.cri.sandbox-name": name,
        "io.kubernetes.cri.container-name": container,
    }
    path = bundle / "config.json"
    path.write_text(json.dumps({"ociVersion": "1.1.0", "process": {"env": ["SECRET=x"]}, "annotations": annotations}))
    return path
