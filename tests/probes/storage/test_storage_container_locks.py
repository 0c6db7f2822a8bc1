"""storage.locks inside containers' own filesystems, for real: a process in a private mount namespace
(`unshare -m`) with a tmpfs over its /tmp, in a cgroup named like a kubepods pod, leaving or holding torch
FileBaton locks that exist only in that namespace, and a FileBaton waiter inside it found with py-spy."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.pyprocs import FILE_BATON
from support.system import REPO, fuse_capable, require, require_root, require_tool, wait_reaped

from agent.config import parse_config
from agent.scheduler import probe_context
from probes.base import Finding, Sample, Status
from probes.runtime.children import ChildCalls
from probes.runtime.host import Host
from probes.storage.locks import LocksProbe

HOUR = 3600.0
EXT_DIR = "/tmp/torch_extensions/py311_cpu"
# A holder as torch's FileBaton.try_acquire leaves it: the lock created with O_EXCL, the fd kept open.
HOLDER = (
    "import os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('ready', flush=True); "
    "time.sleep(600)"
)
SLEEPER = "import time; print('ready', flush=True); time.sleep(600)"


def _cgroup_root() -> Path | None:
    """A cgroup hierarchy this test may create pod cgroups in, the one /proc/PID/cgroup is classified by."""
    for root in (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")):
        if (root / "cgroup.procs").exists() and os.access(root, os.W_OK):
            if root.name != "memory" and not (root / "cgroup.controllers").exists():
                continue
            return root
    return None


@dataclass
class Container:
    proc: subprocess.Popen[str]
    pod_uid: str
    container_id: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def host_path(self, path: str) -> Path:
        return Path(f"/proc/{self.pid}/root{path}")

    @property
    def label(self) -> str:
        return f"pod {self.pod_uid} container {self.container_id[:12]}"


def _aged(path: str, seconds: float = 2 * HOUR) -> str:
    return f"touch -d @{int(time.time() - seconds)} {shlex.quote(path)}"


@contextlib.contextmanager
def container(
    setup: list[str], script: str, *args: str, executable: str = sys.executable, pass_fds: tuple[int, ...] = ()
) -> Iterator[Container]:
    """Run `python -c script args` in a new mount namespace with a tmpfs over /tmp (after the shell `setup`
    ran there), moved into a cgroup `.../kubepods/burstable/pod<uid>/<container id>`. Everything the setup
    started is killed with it (its own process group)."""
    require_root()
    require_tool("unshare")
    root = _cgroup_root()
    require(root is not None, "a writable cgroup hierarchy (memory v1 or v2)")
    assert root is not None
    pod_uid, container_id = str(uuid.uuid4()), uuid.uuid4().hex + uuid.uuid4().hex
    top = root / f"node-health-test-{uuid.uuid4().hex[:8]}"
    leaf = top / "kubepods" / "burstable" / f"pod{pod_uid}" / container_id
    leaf.mkdir(parents=True)
    shell = " && ".join(["mount -t tmpfs nh-container /tmp", *setup, 'exec "$0" "$@"'])
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell, executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        pass_fds=pass_fds,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", f"container did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"
        (leaf / "cgroup.procs").write_text(str(proc.pid))
        yield Container(proc, pod_uid, container_id)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        for directory in (leaf, *leaf.parents):
            if directory == root:
                break
            with contextlib.suppress(OSError):
                directory.rmdir()


def run_locks(
    probe: LocksProbe | None = None, host: Host | None = None, redact: bool = True, **storage: object
) -> tuple[dict[str, Finding], list[Sample]]:
    """One run over the containers only (no host globs), as the daemon would run it."""
    settings = {"lock_globs": [], "stale_lock_age_seconds": HOUR, **storage}
    config = parse_config({"storage": settings, "redact_cmdlines": redact})
    output = (probe or LocksProbe()).run(probe_context(host or Host(), config, 20.0))
    return {f.subject: f for f in output if isinstance(f, Finding)}, [s for s in output if isinstance(s, Sample)]


@pytest.mark.system
def test_stale_baton_inside_a_container_fails_naming_the_pod_and_its_waiter() -> None:
    """The field failure: a stale FileBaton in a job container's own filesystem, a later job of that pod
    stuck in FileBaton.wait() on it. Nothing of it is visible at the node's own paths."""
    require_tool("py-spy")
    build = f"{EXT_DIR}/fused_adam"
    setup = [f"mkdir -p {build}", f"touch {build}/lock", _aged(f"{build}/lock")]
    with container(setup, FILE_BATON, "jit", build) as job:
        assert job.host_path(f"{build}/lock").is_file() and not Path(f"{build}/lock").exists()
        findings, samples = run_locks()
        subject = f"{job.label}: {build}/lock"
        stale = findings[subject]
        assert (stale.status, stale.reason) == (Status.FAIL, "StaleFileBaton"), findings
        assert job.pod_uid in stale.message and f"{build}/lock" in stale.message
        assert f"/proc/{job.pid}/root{build}/lock" in stale.message
        assert stale.observed["pod_uid"] == job.pod_uid and stale.observed["container_id"] == job.container_id
        assert stale.observed["host_path"] == f"/proc/{job.pid}/root{build}/lock"
        waiting = findings[f"{subject} waiters"]
        assert (waiting.status, waiting.reason) == (Status.FAIL, "ProcessWaitingOnFileBaton"), waiting
        assert f"pid {job.pid}" in waiting.message and job.pod_uid in waiting.message
        (waiter,) = waiting.observed["waiters"]
        assert (waiter["pid"], waiter["pod_uid"], waiter["lock"]) == (job.pid, job.pod_uid, f"{build}/lock")
        # Other tenants' command lines are not shown unless the operator allows it.
        assert "command" not in waiter and "-c import" not in waiting.message
        gauge = [s for s in samples if s.name == "nodehealth_storage_stale_locks" and s.labels["scope"] == "containers"]
        assert sum(s.value for s in gauge if s.labels["glob"] == "/tmp/torch_extensions/*/*/lock") >= 1
        shown, _ = run_locks(redact=False)
        (waiter,) = shown[f"{subject} waiters"].observed["waiters"]
        assert "-c import os" in waiter["command"] and "-c import os" in shown[f"{subject} waiters"].message
    after, _ = run_locks()
    assert subject not in after and f"{subject} waiters" not in after  # the container is gone, so are they


@pytest.mark.system
def test_locks_held_in_the_container_or_from_the_host_and_young_ones_are_not_stale() -> None:
    held, outside, young = (f"{EXT_DIR}/{name}/lock" for name in ("held", "outside", "young"))
    setup = [f"mkdir -p {EXT_DIR}/held {EXT_DIR}/outside {EXT_DIR}/young", f"touch {outside} {young}", _aged(outside)]
    with container(setup, HOLDER, held) as job:
        os.utime(job.host_path(held), (time.time() - 2 * HOUR,) * 2)
        # A process of another mount namespace (this one, the host's) holds the second lock open.
        fd = os.open(job.host_path(outside), os.O_RDONLY)
        try:
            findings, _ = run_locks()
        finally:
            os.close(fd)
        assert not [s for s in findings if s.startswith(job.label)], findings
        summary = findings["containers"]
        assert summary.status == Status.OK and summary.observed["lock_files"] >= 3
        findings, _ = run_locks()
        assert findings[f"{job.label}: {outside}"].reason == "StaleFileBaton"  # nobody holds it any more


@pytest.mark.system
def test_remove_stale_lock_inside_a_container_safely(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    gone, linked_dir = f"{EXT_DIR}/gone/lock", f"{EXT_DIR}/../py311_cu121"
    setup = [
        f"mkdir -p {EXT_DIR}/gone /tmp/elsewhere/ext",
        f"touch {gone} /tmp/elsewhere/ext/lock",
        _aged(gone),
        _aged("/tmp/elsewhere/ext/lock"),
        f"ln -s /tmp/elsewhere {linked_dir}",
        f"mkdir -p {EXT_DIR}/link && ln -s {precious} {EXT_DIR}/link/lock",
    ]
    probe = LocksProbe()
    with container(setup, SLEEPER) as job:
        findings, samples = run_locks(probe, remove_stale_locks=True)
        removed = findings[f"{job.label}: {gone}"]
        assert (removed.status, removed.reason) == (Status.WARN, "StaleLockRemoved"), findings
        assert removed.event is not None and gone in removed.event.message and job.pod_uid in removed.event.message
        assert not job.host_path(gone).exists()
        # Below a symlinked directory and through a symlinked lock: never judged, never removed.
        assert job.host_path("/tmp/elsewhere/ext/lock").exists() and precious.read_text() == "keep me"
        assert not [s for s in findings if "elsewhere" in s or "py311_cu121" in s or "/link/" in s]
        counters = {
            s.labels["glob"]: s.value
            for s in samples
            if s.name == "nodehealth_storage_stale_locks_removed_total" and s.labels["scope"] == "containers"
        }
        assert counters["/tmp/torch_extensions/*/*/lock"] == 1
        again, _ = run_locks(probe, remove_stale_locks=True)
        assert f"{job.label}: {gone}" not in again and again["containers"].status == Status.OK


@pytest.mark.system
def test_without_py_spy_the_waiter_check_says_so() -> None:
    build = f"{EXT_DIR}/fused_adam"
    setup = [f"mkdir -p {build}", f"touch {build}/lock", _aged(f"{build}/lock")]
    with container(setup, FILE_BATON, "jit", build) as job:
        subject = f"{job.label}: {build}/lock"
        for command in (
            ["/nonexistent/py-spy"],
            ["nsenter", "-t", str(os.getpid()), "-m", "--", "/nonexistent/py-spy"],
        ):
            findings, _ = run_locks(py_spy_command=command)
            assert findings[subject].reason == "StaleFileBaton"
            unavailable = findings[f"{subject} waiters"]
            assert (unavailable.status, unavailable.reason) == (Status.UNKNOWN, "LockWaiterCheckUnavailable")
            assert "py-spy not found" in unavailable.message


@pytest.mark.system
def test_py_spy_command_is_run_whole() -> None:
    """`[nsenter, -t, PID, -m, --, py-spy]`: every element is used (only the first would run `nsenter dump`)."""
    require_tool("py-spy")
    require_tool("nsenter")
    build = f"{EXT_DIR}/fused_adam"
    setup = [f"mkdir -p {build}", f"touch {build}/lock", _aged(f"{build}/lock")]
    with container(setup, FILE_BATON, "jit", build) as job:
        command = ["nsenter", "-t", str(os.getpid()), "-m", "--", "py-spy"]
        findings, _ = run_locks(py_spy_command=command)
        waiting = findings[f"{job.label}: {build}/lock waiters"]
        assert waiting.reason == "ProcessWaitingOnFileBaton" and f"pid {job.pid}" in waiting.message


@pytest.mark.system
def test_pod_named_from_the_container_runtime_state(tmp_path: Path) -> None:
    """containerd keeps each container's OCI config under /run; its annotations name the pod."""
    build = f"{EXT_DIR}/fused_adam"
    setup = [f"mkdir -p {build}", f"touch {build}/lock", _aged(f"{build}/lock")]
    with container(setup, SLEEPER) as job:
        bundle = tmp_path / "run/containerd/io.containerd.runtime.v2.task/k8s.io" / job.container_id
        bundle.mkdir(parents=True)
        annotations = {
            "io.kubernetes.cri.sandbox-namespace": "ml-team",
            "io.kubernetes.cri.sandbox-name": "train-0",
            "io.kubernetes.cri.container-name": "trainer",
        }
        (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.1.0", "annotations": annotations}))
        findings, _ = run_locks(host=Host(root=tmp_path), lock_waiter_max_processes=0)
        stale = findings[f"{job.label}: {build}/lock"]
        assert "ml-team/train-0 container trainer" in stale.message
        assert (stale.observed["pod_namespace"], stale.observed["pod_name"]) == ("ml-team", "train-0")


@pytest.mark.system
def test_namespace_limit_is_reported_as_an_incomplete_scan() -> None:
    build = f"{EXT_DIR}/fused_adam"
    setup = [f"mkdir -p {build}", f"touch {build}/lock", _aged(f"{build}/lock")]
    with container(setup, SLEEPER) as job:
        findings, _ = run_locks(container_lock_max_namespaces=0, lock_waiter_max_processes=0)
        summary = findings["containers"]
        assert (summary.status, summary.reason) == (Status.UNKNOWN, "LockScanIncomplete")
        assert "walked 0 of" in summary.message
        assert not [s for s in findings if s.startswith(job.label)]


class _Fd:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        os.close(self.fd)


@pytest.mark.system
def test_a_container_filesystem_that_never_answers_is_mount_hung(tmp_path: Path) -> None:
    """A FUSE filesystem mounted inside the container at its torch_extensions directory that never answers:
    that container's walk is MountHung under its own subject, within the deadline; the others go on."""
    fuse_capable()
    # The container's /tmp is a fresh tmpfs, which hides a checkout under /tmp: the script is handed over as
    # an open file and run through /proc/self/fd, which reaches it whatever the mount namespace shows.
    script = os.open(REPO / "tests" / "support" / "fusefs.py", os.O_RDONLY)
    mounted = (
        "for i in $(seq 200); do grep -q ' /tmp/torch_extensions ' /proc/self/mountinfo && break; sleep 0.05; done"
        " && grep -q ' /tmp/torch_extensions ' /proc/self/mountinfo"
    )
    setup = [
        "mkdir -p /tmp/torch_extensions",
        f"{{ {sys.executable} /proc/self/fd/{script} /tmp/torch_extensions --hang-getattr >/dev/null 2>&1 & }}",
        mounted,
    ]
    host = Host(children=ChildCalls())
    with contextlib.closing(_Fd(script)), container(setup, SLEEPER, pass_fds=(script,)) as job:
        started = time.monotonic()
        findings, _ = run_locks(host=host, locks_timeout_seconds=1.0)
        assert time.monotonic() - started < 20.0
        hung = findings[job.label]
        assert (hung.status, hung.reason) == (Status.FAIL, "MountHung"), hung
        assert hung.observed["pod_uid"] == job.pod_uid and hung.observed["pid"] == job.pid
        summary = findings["containers"].observed
        assert summary["walked"] < summary["namespaces"]  # the hung one is not counted as walked
    assert wait_reaped(host.children) == {}  # the FUSE daemon died with the container: the child ended


@pytest.mark.system
def test_a_pod_sandbox_process_is_not_walked() -> None:
    build = f"{EXT_DIR}/fused_adam"
    # The kernel names a process after the file it ran: through this link, comm is "pause".
    setup = [f"ln -s {sys.executable} /tmp/pause", f"mkdir -p {build}", f"touch {build}/lock", _aged(f"{build}/lock")]
    with container(setup, SLEEPER, executable="/tmp/pause") as sandbox:
        assert Path(f"/proc/{sandbox.pid}/comm").read_text().strip() == "pause"
        findings, _ = run_locks(lock_waiter_max_processes=0)
        assert not [s for s in findings if s.startswith(sandbox.label)], findings


@pytest.mark.system
def test_a_waiter_is_matched_to_the_very_file_it_waits_on() -> None:
    """Same relative path, different files: a container's waiter on its own stale lock is that lock's waiter,
    not the host lock's; a container waiting on the host's lock through a bind mount is the host lock's (and
    that lock is reported once, under the host glob)."""
    require_tool("py-spy")
    host_dir = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="nh-locks-"))  # outside the containers' /tmp
    try:
        host_root = host_dir / "torch_extensions"
        host_lock = host_root / "py311_cpu" / "fused_adam" / "lock"
        host_lock.parent.mkdir(parents=True)
        host_lock.touch()
        os.utime(host_lock, (time.time() - 2 * HOUR,) * 2)
        host_glob = f"{host_root}/*/*/lock"
        build = f"{EXT_DIR}/fused_adam"
        own = [f"mkdir -p {build}", f"touch {build}/lock", _aged(f"{build}/lock")]
        with container(own, FILE_BATON, "jit", build) as job:
            findings, _ = run_locks(lock_globs=[host_glob])
            assert findings[host_glob].reason == "StaleFileBaton"
            waiting = findings[f"{job.label}: {build}/lock waiters"]
            assert waiting.observed["waiters"][0]["pid"] == job.pid
            assert f"{host_glob} waiters" not in findings
        bound = ["mkdir -p /tmp/torch_extensions", f"mount --bind {host_root} /tmp/torch_extensions"]
        with container(bound, FILE_BATON, "jit", build) as job:
            findings, _ = run_locks(lock_globs=[host_glob])
            waiting = findings[f"{host_glob} waiters"]
            (waiter,) = waiting.observed["waiters"]
            assert (waiter["pid"], waiter["pod_uid"], waiter["lock"]) == (job.pid, job.pod_uid, str(host_lock))
            assert not [s for s in findings if s.startswith(job.label)], findings
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)


@pytest.mark.system
def test_when_py_spy_may_not_read_the_processes_the_waiter_check_says_so() -> None:
    """py-spy run as nobody (setpriv) may not read root's processes: unknown, not silence."""
    require_tool("setpriv")
    py_spy = Path(sys.executable).parent / "py-spy"
    require(py_spy.is_file(), "the py-spy binary beside the Python interpreter")
    copy_dir = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="nh-py-spy-"))  # outside /root (mode 0700)
    try:
        copy_dir.chmod(0o755)
        shutil.copy(py_spy, copy_dir / "py-spy")
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(copy_dir / "py-spy")]
        build = f"{EXT_DIR}/fused_adam"
        setup = [f"mkdir -p {build}", f"touch {build}/lock", _aged(f"{build}/lock")]
        with container(setup, FILE_BATON, "jit", build) as job:
            findings, _ = run_locks(py_spy_command=command)
            unavailable = findings[f"{job.label}: {build}/lock waiters"]
            assert (unavailable.status, unavailable.reason) == (Status.UNKNOWN, "LockWaiterCheckUnavailable")
            assert "may not read the processes" in unavailable.message and "Permission Denied" in unavailable.message
    finally:
        shutil.rmtree(copy_dir, ignore_errors=True)
