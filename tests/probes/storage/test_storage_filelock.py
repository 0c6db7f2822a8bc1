"""storage.locks against the real py-filelock 3.13.1 from PyPI (pinned in the test extra), in child processes:

- a SoftFileLock whose holder was SIGKILLed leaves an empty file (3.13 writes nothing into it): harmless until a
  process polls it, then StaleFileLock naming the waiter, with the real path to remove;
- a FileLock (flock) held by a stopped process, or by one that makes no progress between two runs, with a
  FileLock poller and a blocking flock waiter behind it: LockHeldByHungProcess naming holder and waiters, and
  ending the holder with `kill PID` on the host, `kubectl delete pod` in a pod (in a podman container:
  tests/runtime/test_podman_holders.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.pod_cgroups import containerd_bundle, pod_cgroups
from support.system import require_root, require_tool

from agent.config import parse_config
from probes.base import Finding, ProbeContext, Status
from probes.runtime.host import Host
from probes.storage.locks import LocksProbe

HOUR = 3600.0
FILELOCK_VERSION = "3.13.1"
CHILD = r"""
import fcntl, os, sys, time
import filelock
assert filelock.__version__ == sys.argv[3], filelock.__version__
mode, path = sys.argv[1], sys.argv[2]
held = None  # the lock object must live: filelock releases a lock when its object is collected
if mode == "soft-hold":
    held = filelock.SoftFileLock(path)
    held.acquire()
elif mode == "flock-hold":
    held = filelock.FileLock(path)
    held.acquire()
elif mode == "block":  # a blocking flock(2) waiter, as /proc/locks shows it: `-> FLOCK ...`
    print("ready", flush=True)
    fcntl.flock(os.open(path, os.O_RDWR), fcntl.LOCK_EX)
    sys.exit(0)
else:  # "soft-wait" / "flock-wait": filelock's acquire polls every 50 ms (or argv[4] s), forever
    print("ready", flush=True)
    interval = float(sys.argv[4]) if len(sys.argv) > 4 else 0.05
    (filelock.SoftFileLock if mode == "soft-wait" else filelock.FileLock)(path).acquire(poll_interval=interval)
    sys.exit(0)
print("ready", flush=True)
time.sleep(600)
"""


class Child:
    def __init__(self, mode: str, path: Path, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, mode, str(path), FILELOCK_VERSION, *extra],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == b"ready\n", f"{mode} child did not start (is filelock installed?)"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()


@contextlib.contextmanager
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    try:
        yield started
    finally:
        for child in started:
            child.kill()


def age(path: Path, seconds: float = 2 * HOUR) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def run_locks(glob: str, probe: LocksProbe, host: Host | None = None) -> dict[str, Finding]:
    # Room for every Python process of a busy machine that polls something: the waiters must be among them.
    storage = {"lock_globs": [glob], "stale_lock_age_seconds": HOUR, "lock_waiter_max_processes": 32}
    output = probe.run(ProbeContext(host or Host(), parse_config({"storage": storage}), 20.0))
    return {f.subject: f for f in output if isinstance(f, Finding)}


def until(found: Callable[[], dict[str, Finding] | None], tries: int = 20) -> dict[str, Finding]:
    """Run until the expected subject shows (a child prints ready just before it starts to poll)."""
    for _ in range(tries):
        findings = found()
        if findings is not None:
            return findings
        time.sleep(0.1)
    raise AssertionError("the expected finding never showed")


def showing(glob: str, subject: str, probe: LocksProbe) -> Callable[[], dict[str, Finding] | None]:
    def run() -> dict[str, Finding] | None:
        findings = run_locks(glob, probe)
        return findings if subject in findings else None

    return run


@pytest.fixture(autouse=True)
def _real_filelock() -> None:
    require_root()
    require_tool("py-spy")
    import filelock

    assert filelock.__version__ == FILELOCK_VERSION, f"the test extra pins filelock=={FILELOCK_VERSION}"


@pytest.mark.system
def test_an_empty_softfilelock_left_by_a_killed_holder_is_stale_once_a_process_polls_it(tmp_path: Path) -> None:
    locks = tmp_path / "hub" / ".locks" / "models--org--model-7b"
    locks.mkdir(parents=True)
    path = locks / "0123abcd.lock"
    glob = f"{tmp_path}/hub/.locks/*/*.lock"
    subject = f"{glob}: {path}"
    probe = LocksProbe()
    with children() as started:
        holder = Child("soft-hold", path)
        started.append(holder)
        holder.kill()
        assert path.exists() and path.stat().st_size == 0  # filelock 3.13 leaves it empty
        age(path)
        quiet = run_locks(glob, probe)
        assert subject not in quiet and quiet[glob].status == Status.OK  # nobody polls it: harmless
        waiter = Child("soft-wait", path)
        started.append(waiter)
        findings = until(showing(glob, subject, probe))
        stale = findings[subject]
        assert (stale.status, stale.reason) == (Status.FAIL, "StaleFileLock"), stale
        assert f"pid {waiter.pid} (python" in stale.message and "an empty lock file" in stale.message
        assert stale.hint == f"the lock has no holder: remove it (rm {path}) and the waiting job takes it and continues"
        assert [w["pid"] for w in stale.observed["waiters"]] == [waiter.pid]
        assert (
            findings[glob].status == Status.OK
            and "1 lock(s) reported under their own subject" in findings[glob].message
        )
        path.unlink()  # the fix: the waiter takes the lock and ends
        assert waiter.proc.wait(10) == 0
        assert subject not in run_locks(glob, probe)


@pytest.mark.system
@pytest.mark.parametrize("interval", ["0.5", "1.0", "2.0"])
def test_a_slow_poller_of_an_empty_softfilelock_is_found(tmp_path: Path, interval: str) -> None:
    """filelock 3.13's acquire(poll_interval=...) up to 2 s between tries: the first half-second window sees it
    sleep through, and only then its threads are watched longer (SLOW_POLLING_WINDOW)."""
    locks = tmp_path / "hub" / ".locks" / "models--org--model-7b"
    locks.mkdir(parents=True)
    path = locks / "slow.lock"
    path.write_bytes(b"")
    age(path)
    glob = f"{tmp_path}/hub/.locks/*/*.lock"
    subject = f"{glob}: {path}"
    probe = LocksProbe()
    with children() as started:
        waiter = Child("soft-wait", path, interval)
        started.append(waiter)
        stale = until(showing(glob, subject, probe), tries=5)[subject]
        assert (stale.status, stale.reason) == (Status.FAIL, "StaleFileLock"), stale
        assert [w["pid"] for w in stale.observed["waiters"]] == [waiter.pid]
        path.unlink()  # the fix: the waiter takes the lock and ends
        assert waiter.proc.wait(10) == 0


@pytest.mark.system
def test_an_unparseable_lock_file_polled_by_a_softfilelock_waiter_is_stale(tmp_path: Path) -> None:
    """A pid with no hostname after it (a record cut short, not the `<pid>\\n<hostname>` newer filelocks write)
    is no SoftFileLock record: judged as the empty file is, once a process polls it."""
    locks = tmp_path / "hub" / ".locks" / "models--org--model-7b"
    locks.mkdir(parents=True)
    path = locks / "cut.lock"
    glob = f"{tmp_path}/hub/.locks/*/*.lock"
    subject = f"{glob}: {path}"
    path.write_bytes(b"4242\n")
    age(path)
    probe = LocksProbe()
    with children() as started:
        quiet = run_locks(glob, probe)
        assert subject not in quiet and quiet[glob].observed["flock_unlocked"] == 1  # nobody polls it: harmless
        waiter = Child("soft-wait", path)
        started.append(waiter)
        stale = until(showing(glob, subject, probe))[subject]
        assert (stale.status, stale.reason) == (Status.FAIL, "StaleFileLock"), stale
        assert f"{path}: an unparseable lock file" in stale.message and f"pid {waiter.pid} (python" in stale.message
        assert f"remove it (rm {path})" in stale.hint
        path.unlink()  # the fix: the waiter takes the lock and ends
        assert waiter.proc.wait(10) == 0


@pytest.mark.system
def test_a_flock_held_by_a_stopped_process_with_waiters_behind_it(tmp_path: Path) -> None:
    locks = tmp_path / "hub" / ".locks" / "models--org--model-7b"
    locks.mkdir(parents=True)
    path = locks / "stopped.lock"
    glob = f"{tmp_path}/hub/.locks/*/*.lock"
    subject = f"{glob}: {path}"
    with children() as started:
        holder = Child("flock-hold", path)
        started.append(holder)
        os.kill(holder.pid, signal.SIGSTOP)
        poller = Child("flock-wait", path)
        blocked = Child("block", path)
        started += [poller, blocked]

        def shows_both() -> dict[str, Finding] | None:
            findings = run_locks(glob, LocksProbe())
            hung = findings.get(subject)
            return findings if hung and len(hung.observed["waiters"]) == 2 else None

        hung = until(shows_both)[subject]
        assert (hung.status, hung.reason) == (Status.WARN, "LockHeldByHungProcess"), hung
        assert f"locked by pid {holder.pid} (python" in hung.message and "stopped (state T)" in hung.message
        assert f"pid {poller.pid}" in hung.message and f"pid {blocked.pid}" in hung.message
        assert hung.observed["holder"]["pid"] == holder.pid
        assert sorted(w["pid"] for w in hung.observed["waiters"]) == sorted([poller.pid, blocked.pid])
        assert f"kill -CONT {holder.pid}" in hung.hint and f"kill {holder.pid}" in hung.hint
        os.kill(holder.pid, signal.SIGCONT)  # resumed, it is not stopped any more: no finding on first sight
        assert subject not in run_locks(glob, LocksProbe())


@pytest.mark.system
def test_a_flock_holder_that_makes_no_progress_between_two_runs_is_hung(tmp_path: Path) -> None:
    """Not stopped, just stuck (a download on a dead connection sleeps in recv): the first run sees it, the
    second finds its CPU time and I/O unchanged."""
    locks = tmp_path / "hub" / ".locks" / "models--org--model-7b"
    locks.mkdir(parents=True)
    path = locks / "stuck.lock"
    glob = f"{tmp_path}/hub/.locks/*/*.lock"
    subject = f"{glob}: {path}"
    probe = LocksProbe()
    with children() as started:
        holder = Child("flock-hold", path)
        poller = Child("flock-wait", path)
        started += [holder, poller]
        first = run_locks(glob, probe)
        assert subject not in first  # first sight: nothing to compare with
        assert first[glob].observed["flock_locked"] == 1
        hung = until(showing(glob, subject, probe))[subject]
        assert (hung.status, hung.reason) == (Status.WARN, "LockHeldByHungProcess"), hung
        assert "no progress for" in hung.message and f"pid {poller.pid}" in hung.message


@pytest.mark.system
def test_a_flock_held_by_a_stopped_process_in_a_pod_is_ended_by_deleting_the_pod(tmp_path: Path) -> None:
    """The holder in a pod's cgroup, the pod's name in containerd's bundle under the host root: the hint deletes
    the pod by name (killing its process would only have the kubelet restart the container)."""
    root = tmp_path / "host"
    locks = root / "hub" / ".locks" / "models--org--model-7b"
    locks.mkdir(parents=True)
    path = locks / "pod.lock"
    glob = "/hub/.locks/*/*.lock"
    subject = f"{glob}: /hub/.locks/models--org--model-7b/pod.lock"
    with pod_cgroups(1) as (pod,), children() as started:
        containerd_bundle(root, pod.container_id, "ml", "trainer-0", "main")
        holder = Child("flock-hold", path)
        started.append(holder)
        pod.add(holder.pid)
        os.kill(holder.pid, signal.SIGSTOP)
        blocked = Child("block", path)
        started.append(blocked)

        def shows_it() -> dict[str, Finding] | None:
            findings = run_locks(glob, LocksProbe(), Host(root=root))
            hung = findings.get(subject)
            return findings if hung and hung.observed["waiters"] else None

        hung = until(shows_it)[subject]
        assert (hung.status, hung.reason) == (Status.WARN, "LockHeldByHungProcess"), hung
        assert f"locked by pid {holder.pid} (python" in hung.message and f"pod {pod.uid}" in hung.message
        assert "end it (kubectl delete pod -n ml trainer-0)" in hung.hint, hung.hint
        assert f"kill {holder.pid}" not in hung.hint and "podman" not in hung.hint
