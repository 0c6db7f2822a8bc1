"""Holders in real podman containers (runc, the cgroupfs manager: `/libpod_parent/libpod-<id>`): a container
holding a mknod'ed NPU or GPU device node, one listening on an HCCL port, one with a stale torch lock in its own
filesystem, one stopped while it holds a flock a host process waits on. Each finding names the podman container
and gives `podman stop` (or `podman exec`), never `kill PID` for a container's process nor `kubectl exec` or
`kubectl delete pod` for a container Kubernetes does not run."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fake_npu_smi import FakeSmi, context, make_dev, run_probe, table
from support.pod_cgroups import idle_devices
from support.podman_containers import Container, busybox_rootfs, holds_fd, podman_container
from support.processes import free_port
from support.system import require, require_tool

from agent.config import parse_config
from agent.scheduler import probe_context
from probes.base import Finding, ProbeContext, Status
from probes.network.ports import PortsProbe
from probes.runtime.host import Host
from probes.runtime.procfs import classify_cgroup
from probes.storage.locks import LocksProbe

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return busybox_rootfs(tmp_path_factory.mktemp("podman-rootfs"))


def _podman_owner(container: Container) -> None:
    """The container really is in podman's cgroupfs cgroup, and the classifier calls it a podman container."""
    text = Path(f"/proc/{container.pid}/cgroup").read_text()
    assert f"/libpod_parent/libpod-{container.id}" in text, text
    owner = classify_cgroup(text)
    assert (owner.kind, owner.runtime, owner.container_id) == ("container", "podman", container.id)


@contextlib.contextmanager
def holding_device(rootfs: Path, node: Path, inside: str) -> Iterator[Container]:
    """A podman container whose process keeps `inside` (the node passed with --device) open."""
    script = f"exec 3<{inside}; exec sleep 600"
    with podman_container(
        rootfs, script, "--network=none", f"--device={node}:{inside}", ready=holds_fd(inside)
    ) as container:
        _podman_owner(container)
        yield container


def test_npu_held_by_a_podman_container_is_stopped_with_podman(
    tmp_path: Path, rootfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    smi = FakeSmi(tmp_path / "fake")
    smi.answer({"info": table("910b1-8card-healthy-1proc-info-24.1.0.txt")})
    monkeypatch.setenv("PATH", f"{smi.bin}{os.pathsep}{os.environ.get('PATH', '')}")
    dev = make_dev(tmp_path / "dev", {"davinci0": idle_devices(1)[0]})
    with holding_device(rootfs, dev / "davinci0", "/dev/davinci0") as container:
        findings, _ = run_probe(context(tmp_path, proc=Path("/proc"), dev=dev))
    held = findings[("npu.holders", "npu0")]
    assert (held.status, held.reason) == (Status.FAIL, "NpuHeldOutOfBand")
    assert f"PID {container.pid} (sleep) in podman container {container.short_id} outside Kubernetes" in held.message
    assert f"podman stop {container.short_id}" in held.hint
    assert f"kill {container.pid}" not in held.hint
    (mine,) = [h for h in held.observed["holders"] if h["pid"] == container.pid]
    assert (mine["kind"], mine["container_id"], mine["sources"]) == ("container", container.id, ["fd"])


def test_gpu_held_by_a_podman_container_is_stopped_with_podman(tmp_path: Path, rootfs: Path) -> None:
    from support.fake_nvml.build import build_fake_nvml, device_config
    from support.fake_nvml.runner import run_probe as run_gpu_probe

    require(shutil.which("gcc") is not None or shutil.which("cc") is not None, "gcc to build the fake NVML")
    library = build_fake_nvml(tmp_path / "fake-nvml")
    dev = tmp_path / "gpudev"
    dev.mkdir()
    os.mknod(dev / "nvidia0", 0o600 | stat.S_IFCHR, os.makedev(*idle_devices(1)[0]))
    with holding_device(rootfs, dev / "nvidia0", "/dev/nvidia0") as container:
        run = run_gpu_probe(tmp_path, library.parent, device_config({"memory_used_mib": 100}), dev_dir=dev)
    gpu0 = run.finding("gpu.holders", "gpu0")
    assert (gpu0["status"], gpu0["reason"]) == ("fail", "GpuHeldOutOfBand")
    assert f"podman container {container.short_id} outside Kubernetes" in gpu0["message"]
    assert f"podman stop {container.short_id}" in gpu0["hint"] and f"kill {container.pid}" not in gpu0["hint"]


def _listening(port: int) -> bool:
    """A LISTEN socket on the port in the host's table (a probe connection would end busybox nc)."""
    wanted = f":{port:04X} "
    text = Path("/proc/net/tcp").read_text() + Path("/proc/net/tcp6").read_text()
    return any(wanted in line and line.split()[3] == "0A" for line in text.splitlines()[1:])


def test_hccl_port_held_by_a_podman_container_is_stopped_with_podman(rootfs: Path) -> None:
    port = free_port()
    script = f"exec nc -l -p {port}"
    with podman_container(rootfs, script, "--network=host", ready=lambda _c: _listening(port)) as container:
        _podman_owner(container)
        config = parse_config({"network": {"ports": {"only_with_npus": False, "base": port, "count": 1}}})
        out = PortsProbe().run(ProbeContext(Host(), config, 8))
    findings = {f.subject: f for f in out if isinstance(f, Finding)}
    occupied = findings[f"{port}-{port}"]
    assert (occupied.status, occupied.reason) == (Status.FAIL, "PortRangeOccupied")
    assert f"podman container {container.short_id} outside Kubernetes" in occupied.message
    assert f"podman stop {container.short_id}" in occupied.hint and f"kill {container.pid}" not in occupied.hint


def test_stale_lock_in_a_podman_container_names_it_and_removes_through_podman(tmp_path: Path) -> None:
    rootfs = busybox_rootfs(tmp_path / "rootfs")  # this container's own filesystem, with the job's leftover
    build = "/root/.cache/torch_extensions/py311_cpu/fused_adam"
    lock = rootfs / build.lstrip("/") / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = time.time() - 7200
    os.utime(lock, (old, old))
    with podman_container(rootfs, "exec sleep 600", "--network=none") as container:
        _podman_owner(container)
        config = parse_config({"storage": {"lock_globs": [], "stale_lock_age_seconds": 3600}})
        output = LocksProbe().run(probe_context(Host(), config, 20.0))
    findings = {f.subject: f for f in output if isinstance(f, Finding)}
    label = f"podman container {container.short_id} outside Kubernetes"
    stale = findings[f"{label}: {build}/lock"]
    assert (stale.status, stale.reason) == (Status.FAIL, "StaleFileBaton")
    assert f"inside {label}" in stale.message and "mount namespace" not in stale.message
    assert f"podman exec {container.short_id} rm {build}/lock" in stale.hint
    assert "kubectl" not in stale.hint
    assert stale.observed["container_id"] == container.id and stale.observed["runtime"] == "podman"


# Takes a flock on its argument and keeps it (busybox has no flock applet).
FLOCK_HOLDER_C = """
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int fd = open(argv[1], O_RDWR | O_CREAT, 0644);
    if (fd < 0 || flock(fd, LOCK_EX) != 0) return 1;
    for (;;) pause();
}
"""
# A host process blocked in flock(2) behind the container's lock: `->` in /proc/locks.
BLOCKED_WAITER = "import fcntl, os, sys; fcntl.flock(os.open(sys.argv[1], os.O_RDWR), fcntl.LOCK_EX)"


def _flock_holder(rootfs: Path) -> None:
    """/bin/flock-hold in `rootfs`, with the shared libraries it links."""
    gcc = require_tool("gcc")
    source = rootfs.parent / "flock-hold.c"
    source.write_text(FLOCK_HOLDER_C)
    binary = rootfs / "bin" / "flock-hold"
    subprocess.run([gcc, "-O0", "-o", str(binary), str(source)], check=True, timeout=120)
    linked = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False).stdout
    for library in {word for word in linked.split() if word.startswith("/")}:
        target = rootfs / library.lstrip("/")
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(library).resolve(), target)


def _flock_of(pid: int, blocked: bool) -> bool:
    """Whether /proc/locks shows a flock of `pid` (`1: FLOCK ADVISORY WRITE PID ...`), held or, `blocked`,
    waited for (`1: -> FLOCK ...`)."""
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        waiting = fields[1:2] == ["->"]
        rest = fields[2:] if waiting else fields[1:]
        if waiting == blocked and rest[:1] == ["FLOCK"] and rest[3:4] == [str(pid)]:
            return True
    return False


def _holds_flock(container: Container) -> bool:
    return _flock_of(container.pid, blocked=False)


def test_a_flock_held_by_a_stopped_podman_container_is_ended_with_podman_stop(tmp_path: Path) -> None:
    rootfs = busybox_rootfs(tmp_path / "rootfs")
    _flock_holder(rootfs)
    locks = tmp_path / "locks"
    locks.mkdir()
    path = locks / "held.lock"
    glob = f"{locks}/*.lock"
    script = "exec /bin/flock-hold /locks/held.lock"
    with podman_container(
        rootfs, script, "--network=none", f"--volume={locks}:/locks", ready=_holds_flock
    ) as container:
        _podman_owner(container)
        os.kill(container.pid, signal.SIGSTOP)  # hung while it holds the lock
        waiter = subprocess.Popen([sys.executable, "-c", BLOCKED_WAITER, str(path)])
        try:
            deadline = time.monotonic() + 10
            while not _flock_of(waiter.pid, blocked=True):
                assert waiter.poll() is None and time.monotonic() < deadline, "the waiter never blocked"
                time.sleep(0.05)
            config = parse_config({"storage": {"lock_globs": [glob], "stale_lock_age_seconds": 3600}})
            output = LocksProbe().run(ProbeContext(Host(), config, 20.0))
        finally:
            waiter.kill()
            waiter.wait(10)
    findings = {f.subject: f for f in output if isinstance(f, Finding)}
    hung = findings[f"{glob}: {path}"]
    assert (hung.status, hung.reason) == (Status.WARN, "LockHeldByHungProcess"), hung
    label = f"podman container {container.short_id} outside Kubernetes"
    assert f"locked by pid {container.pid} (flock-hold, {label})" in hung.message, hung.message
    assert "stopped (state T)" in hung.message and f"pid {waiter.pid}" in hung.message
    assert f"end it (podman stop {container.short_id})" in hung.hint, hung.hint
    assert f"kill {container.pid}" not in hung.hint and "pod" not in hung.hint.replace("podman", ""), hung.hint
    assert hung.observed["holder"]["container_id"] == container.id
