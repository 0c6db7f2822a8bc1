"""storage.locks with real lock holders: FileBaton-style, SoftFileLock-style and flock, alive and killed."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fusefs import fuse_mount
from support.system import fuse_capable, require_root, wait_reaped

from agent.config import parse_config
from agent.scheduler import execute
from probes.base import Finding, ProbeContext, ProbeParseError, Sample, Status
from probes.runtime.children import ChildCalls
from probes.runtime.host import Host
from probes.storage.lockfiles import (
    is_soft_lock_record,
    lock_style,
    parse_proc_locks,
    remove_container_lock_in_child,
    remove_lock_if_unchanged,
    split_glob,
)
from probes.storage.locks import LocksProbe
from probes.storage.lockwalk import WalkPlan, glob_parts, walk_in_child
from probes.storage.mounttable import MountEntry, mount_containing, parse_mountinfo
from probes.storage.waiters import lock_waiter_candidates


def read_host_mounts() -> list[MountEntry]:
    return parse_mountinfo(Path("/proc/1/mountinfo").read_text())


HOUR = 3600.0
HOLDER = r"""
import fcntl, os, socket, sys, time
mode, path = sys.argv[1], sys.argv[2]
if mode == "baton":      # torch FileBaton.try_acquire: existence is the lock, the fd stays open
    fd = os.open(path, os.O_CREAT | os.O_EXCL)
elif mode == "soft":     # filelock SoftFileLock: the same, with a pid/hostname record inside
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC, 0o644)
    os.write(fd, f"{os.getpid()}\n{socket.gethostname()}\n".encode())
else:                    # filelock UnixFileLock: the kernel lock is the lock
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("ready", flush=True)
time.sleep(600)
"""


class Holder:
    def __init__(self, mode: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, mode, str(path)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == b"ready\n"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@contextlib.contextmanager
def holders() -> Iterator[list[Holder]]:
    started: list[Holder] = []
    try:
        yield started
    finally:
        for holder in started:
            holder.kill()
            if holder.proc.stdout:
                holder.proc.stdout.close()


def age(path: Path, seconds: float = 2 * HOUR) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def run_locks(
    globs: list[str], remove: bool = False, probe: LocksProbe | None = None, host: Host | None = None, **extra: object
) -> tuple[dict[str, Finding], list[Sample]]:
    config = parse_config(
        {"storage": {"lock_globs": globs, "stale_lock_age_seconds": HOUR, "remove_stale_locks": remove, **extra}}
    )
    output = (probe or LocksProbe()).run(ProbeContext(host or Host(), config, 15.0))
    return {f.subject: f for f in output if isinstance(f, Finding)}, [s for s in output if isinstance(s, Sample)]


def counter(samples: list[Sample], glob: str) -> float:
    (value,) = [
        s.value
        for s in samples
        if s.name == "nodehealth_storage_stale_locks_removed_total"
        and s.labels["glob"] == glob
        and s.labels["scope"] == "host"
    ]
    return value


@pytest.mark.system
def test_killed_baton_holder_leaves_a_stale_lock_live_holders_never_reported(tmp_path: Path) -> None:
    require_root()
    ext = tmp_path / "torch_extensions" / "py311_cpu"
    baton_glob = f"{tmp_path}/torch_extensions/*/*/lock"
    hub = tmp_path / "hub" / ".locks" / "models--org--name"
    flock_glob = f"{tmp_path}/hub/.locks/*/*.lock"
    with holders() as running:
        live = Holder("baton", ext / "live_ext" / "lock")
        dead = Holder("baton", ext / "dead_ext" / "lock")
        young = Holder("baton", ext / "young_ext" / "lock")
        soft_dead = Holder("soft", hub / "soft.lock")
        flock_live = Holder("flock", hub / "held.lock")
        flock_dead = Holder("flock", hub / "left.lock")
        running += [live, dead, young, soft_dead, flock_live, flock_dead]
        for holder in (dead, young, soft_dead, flock_dead):
            holder.kill()
        for holder in running:
            if holder is not young:
                age(holder.path)
        findings, samples = run_locks([baton_glob, flock_glob])

        baton = findings[baton_glob]
        assert (baton.status, baton.reason) == (Status.FAIL, "StaleFileBaton"), baton
        assert [item["path"] for item in baton.observed["stale_local"]] == [str(dead.path)]
        assert baton.observed["held"] == 1 and baton.observed["young"] == 1
        assert str(live.path) not in baton.message and str(dead.path) in baton.message
        assert f"(rm {dead.path})" in baton.hint and "PATH" not in baton.hint  # the real path to remove

        hub_finding = findings[flock_glob]
        assert (hub_finding.status, hub_finding.reason) == (Status.FAIL, "StaleFileBaton"), hub_finding
        stale = hub_finding.observed["stale_local"]
        assert [(item["path"], item["style"]) for item in stale] == [(str(soft_dead.path), "soft")]
        # flock-style files are judged by /proc/locks: the live one is locked, the killed one's file is harmless.
        assert hub_finding.observed["flock_locked"] == 1
        assert hub_finding.observed["flock_unlocked"] == 1
        assert dead.path.exists() and soft_dead.path.exists()  # nothing removed unless asked
        stale_gauge = {
            s.labels["glob"]: s.value
            for s in samples
            if s.name == "nodehealth_storage_stale_locks" and s.labels["scope"] == "host"
        }
        assert stale_gauge == {baton_glob: 1, flock_glob: 1}
        assert counter(samples, baton_glob) == 0


@pytest.mark.system
def test_remove_stale_node_local_locks_only(tmp_path: Path) -> None:
    require_root()
    ext = tmp_path / "torch_extensions" / "py311_cpu"
    baton_glob = f"{tmp_path}/torch_extensions/*/*/lock"
    probe = LocksProbe()
    with holders() as running:
        live = Holder("baton", ext / "live_ext" / "lock")
        dead = Holder("baton", ext / "dead_ext" / "lock")
        running += [live, dead]
        dead.kill()
        age(live.path)
        age(dead.path)
        inode = dead.path.stat().st_ino
        findings, samples = run_locks([baton_glob], remove=True, probe=probe)
        finding = findings[baton_glob]
        assert (finding.status, finding.reason) == (Status.WARN, "StaleLockRemoved"), finding
        (removed,) = finding.observed["removed"]
        local_fstype = mount_containing(read_host_mounts(), str(dead.path)).fstype
        assert removed["path"] == str(dead.path) and removed["ino"] == inode and removed["style"] == "baton"
        assert removed["fstype"] == local_fstype and removed["age_seconds"] >= 2 * HOUR - 60
        assert not dead.path.exists()
        assert live.path.exists()
        assert counter(samples, baton_glob) == 1
        # told to Kubernetes as an event on the Node (the reconciler emits Finding.event)
        assert finding.event is not None and finding.event.reason == "StaleLockRemoved"
        assert str(dead.path) in finding.event.message
        again, samples = run_locks([baton_glob], remove=True, probe=probe)
        assert again[baton_glob].status == Status.OK
        assert counter(samples, baton_glob) == 1  # a counter: it keeps its total


@pytest.mark.system
def test_stale_lock_on_a_shared_filesystem_only_warns_and_is_never_removed(tmp_path: Path) -> None:
    fuse_capable()
    with fuse_mount(tmp_path) as mount, holders() as running:
        dead = Holder("baton", mount.path / "py311_cpu" / "ext" / "lock")
        running.append(dead)
        dead.kill()
        age(dead.path)
        glob = f"{mount.path}/*/*/lock"
        findings, samples = run_locks([glob], remove=True)
        finding = findings[glob]
        assert (finding.status, finding.reason) == (Status.WARN, "StaleLockShared"), finding
        assert finding.observed["stale_shared"][0]["fstype"] == "fuse"
        assert "another node" in finding.hint
        assert dead.path.exists()
        assert counter(samples, glob) == 0


@pytest.mark.system
def test_symlinked_lock_or_directory_is_never_followed_judged_nor_deleted(tmp_path: Path) -> None:
    """A lock that is a symlink is ignored; a symlinked directory on the glob's way is skipped, the same way
    every run: a stale-looking lock below it never taints the node (anyone who can write the lock directory
    could point it anywhere)."""
    require_root()
    outside = tmp_path / "outside"
    outside.mkdir()
    precious = outside / "precious"
    precious.write_text("keep me")
    age(precious)
    link = tmp_path / "torch_extensions" / "py311_cpu" / "ext" / "lock"
    link.parent.mkdir(parents=True)
    link.symlink_to(precious)
    age(link)
    (outside / "ext2").mkdir()
    real_lock = outside / "ext2" / "lock"
    real_lock.touch()
    age(real_lock)
    (tmp_path / "torch_extensions" / "py311_cu121").symlink_to(outside)
    glob = f"{tmp_path}/torch_extensions/*/*/lock"
    probe = LocksProbe()
    for _ in range(3):
        findings, samples = run_locks([glob], remove=True, probe=probe)
        finding = findings[glob]
        assert (finding.status, finding.reason) == (Status.OK, "OK"), finding
        assert finding.observed["not_regular"] == 1 and finding.observed["symlinked_dirs"] == 1
        assert finding.observed["stale_local"] == [] and finding.observed["removed"] == []
        assert precious.read_text() == "keep me" and link.is_symlink()
        assert real_lock.exists()
        assert counter(samples, glob) == 0


def test_lock_swapped_for_a_symlink_between_check_and_delete_is_not_deleted(tmp_path: Path) -> None:
    root = tmp_path / "torch_extensions"
    lock = root / "py311_cpu" / "ext" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    age(lock)
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    # Check phase: what the probe saw.
    plan = WalkPlan(str(root), (tuple(glob_parts("*/*/lock")),), ("lock",), 1000, 10.0)
    ((rel, _mode, dev, ino, _size, _mtime, mtime_ns, style),) = walk_in_child(plan)["globs"][0]["files"]
    assert style == "baton"
    # Swap: the lock becomes a symlink to a file outside the root.
    swapped = lock.with_name("lock.tmp")
    swapped.symlink_to(precious)
    swapped.replace(lock)
    outcome = remove_lock_if_unchanged(str(root), rel, dev, ino, mtime_ns)
    assert outcome.startswith("refused: no longer a regular file")
    assert lock.is_symlink() and precious.read_text() == "keep me"
    # Swapped for another regular file (a new holder took the lock): not deleted either.
    lock.unlink()
    lock.touch()
    assert remove_lock_if_unchanged(str(root), rel, dev, ino, mtime_ns).startswith("refused: replaced")
    assert lock.exists()
    # Touched since the check (same inode, new mtime): kept.
    st = lock.stat()
    os.utime(lock, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert remove_lock_if_unchanged(str(root), rel, st.st_dev, st.st_ino, st.st_mtime_ns).startswith("refused")
    # Unchanged: removed.
    st = lock.stat()
    assert remove_lock_if_unchanged(str(root), rel, st.st_dev, st.st_ino, st.st_mtime_ns) == "removed"
    assert not lock.exists()
    assert remove_lock_if_unchanged(str(root), "../precious", 0, 0, 0).startswith("refused")
    assert precious.exists()


def test_proc_locks_parsed_from_real_kernel_locks(tmp_path: Path) -> None:
    paths = {name: tmp_path / name for name in ("flock", "posix", "ofd", "waited")}
    for path in paths.values():
        path.write_bytes(b"x" * 10)
    fds = {name: os.open(path, os.O_RDWR) for name, path in paths.items()}
    waiter = None
    try:
        fcntl.flock(fds["flock"], fcntl.LOCK_SH)
        fcntl.lockf(fds["posix"], fcntl.LOCK_EX, 5, 2)
        ofd_lock = (fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        import struct

        fcntl.fcntl(fds["ofd"], fcntl.F_OFD_SETLK, struct.pack("hhqqi", *ofd_lock))
        fcntl.flock(fds["waited"], fcntl.LOCK_EX)
        waiter = subprocess.Popen(
            [sys.executable, "-c", f"import fcntl; fcntl.flock(open({str(paths['waited'])!r}), fcntl.LOCK_EX)"]
        )
        deadline = time.monotonic() + 5
        text = ""
        while time.monotonic() < deadline:
            text = Path("/proc/locks").read_text()
            if "->" in text:
                break
            time.sleep(0.02)
        records = parse_proc_locks(text)
    finally:
        if waiter:
            waiter.kill()
            waiter.wait()
        for fd in fds.values():
            os.close(fd)

    def mine(name: str) -> list:
        st = paths[name].stat()
        key = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
        return [r for r in records if r.file_key == key]

    (flock,) = mine("flock")
    assert (flock.kind, flock.access, flock.pid, flock.blocked) == ("FLOCK", "READ", os.getpid(), False)
    (posix,) = mine("posix")
    assert (posix.kind, posix.access, posix.pid) == ("POSIX", "WRITE", os.getpid())
    (ofd,) = mine("ofd")
    assert (ofd.kind, ofd.pid) == ("OFDLCK", -1)
    waited = mine("waited")
    assert sorted(r.blocked for r in waited) == [False, True]
    assert [r.pid for r in waited if r.blocked] == [waiter.pid]


def test_proc_locks_layouts_and_garbage() -> None:
    text = (
        "1: FLOCK  ADVISORY  WRITE 12403 fe:00:2164387 0 EOF\n"
        "1: -> FLOCK  ADVISORY  WRITE 12500 fe:00:2164387 0 EOF\n"
        "2: POSIX  ADVISORY  READ 77 103:0a:42 5 9\n"
        "3: OFDLCK ADVISORY  WRITE -1 00:2c:9 0 EOF\n"
        "4: LEASE  ACTIVE    READ 900 08:01:1234 0 EOF\n"
    )
    records = parse_proc_locks(text)
    assert [(r.kind, r.pid, r.file_key, r.blocked) for r in records] == [
        ("FLOCK", 12403, (254, 0, 2164387), False),
        ("FLOCK", 12500, (254, 0, 2164387), True),
        ("POSIX", 77, (0x103, 10, 42), False),
        ("OFDLCK", -1, (0, 0x2C, 9), False),
        ("LEASE", 900, (8, 1, 1234), False),
    ]
    assert parse_proc_locks("") == []
    for garbage in ("1: FLOCK ADVISORY WRITE 12 fe00 0 EOF", "FLOCK ADVISORY WRITE 12 fe:00:1 0 EOF", "1: x"):
        with pytest.raises(ProbeParseError):
            parse_proc_locks(garbage)


def test_glob_roots_and_lock_styles() -> None:
    assert split_glob("/root/.cache/torch_extensions/*/*/lock") == ("/root/.cache/torch_extensions", "*/*/lock")
    assert split_glob("/root/.cache/huggingface/hub/.locks/*/*.lock") == (
        "/root/.cache/huggingface/hub/.locks",
        "*/*.lock",
    )
    assert split_glob("/var/lock/build.lock") == ("/var/lock", "build.lock")
    assert split_glob("/data/[ab]/lock") == ("/data", "[ab]/lock")
    assert lock_style("lock", None, ["lock"]) == "baton"
    assert lock_style("abc.lock", b"", ["lock"]) == "flock"
    assert lock_style("abc.lock", b"4242\nnode-7\n", ["lock"]) == "soft"
    assert is_soft_lock_record(b"4242\nnode-7\ntoken") and not is_soft_lock_record(b"4242")
    assert not is_soft_lock_record(b"hello\nworld")


@pytest.mark.system
def test_hung_lock_directory_is_reported_not_waited_on(tmp_path: Path) -> None:
    fuse_capable()
    host = Host(children=ChildCalls())
    with fuse_mount(tmp_path, "--hang-getattr") as mount:
        glob = f"{mount.path}/*/lock"
        started = time.monotonic()
        findings, _ = run_locks([glob], host=host, locks_timeout_seconds=0.5)
        assert time.monotonic() - started < 1.5
    assert findings[glob].reason == "MountHung"
    assert wait_reaped(host.children) == {}


@pytest.mark.system
def test_a_process_waiting_on_a_stale_baton_is_named(tmp_path: Path) -> None:
    """A real Python child stuck in FileBaton.wait() on a stale lock, found with the real py-spy."""
    require_root()
    from support.pyprocs import FILE_BATON, child
    from support.system import require_tool

    require_tool("py-spy")
    build_directory = tmp_path / "torch_extensions" / "py311_cpu" / "fused_adam"
    build_directory.mkdir(parents=True)
    lock = build_directory / "lock"
    lock.touch()
    age(lock)
    baton_glob = f"{tmp_path}/torch_extensions/*/*/lock"
    with child(FILE_BATON, "jit", str(build_directory)) as waiter:
        findings, _ = run_locks([baton_glob])
        for _ in range(20):  # the child prints "ready" just before it starts sleeping in wait()
            if f"{baton_glob} waiters" in findings:
                break
            time.sleep(0.1)
            findings, _ = run_locks([baton_glob])
        assert findings[baton_glob].reason == "StaleFileBaton"
        waiting = findings[f"{baton_glob} waiters"]
        assert (waiting.status, waiting.reason) == (Status.FAIL, "ProcessWaitingOnFileBaton"), waiting
        assert waiting.observed["waiters"][0]["pid"] == waiter.pid
        assert waiting.observed["waiters"][0]["lock"] == str(lock)
        assert f"pid {waiter.pid}" in waiting.message and str(lock) in waiting.hint
    findings, _ = run_locks([baton_glob])
    assert f"{baton_glob} waiters" not in findings  # the waiter is gone: so is the finding


def test_locks_probe_skips_only_when_both_glob_lists_are_empty() -> None:
    empty = parse_config({"storage": {"lock_globs": [], "container_lock_globs": []}})
    result, findings, _ = execute(LocksProbe(), Host(), empty, 5.0)
    assert result == "skip" and [(f.status, f.reason) for f in findings] == [(Status.SKIP, "NotApplicable")]
    containers_only = parse_config({"storage": {"lock_globs": []}})
    assert LocksProbe().applicable(ProbeContext(Host(), containers_only, 5.0)) is None


def test_a_container_lock_is_not_removed_once_its_process_left_the_namespace(tmp_path: Path) -> None:
    """The pid a container is reached through may exit and be reused: the removal checks it first."""
    own = os.readlink("/proc/self/ns/mnt")
    gone = remove_container_lock_in_child("/proc", os.getpid(), "mnt:[1]", "tmp/lock", 0, 0, 0)
    assert gone == f"refused: pid {os.getpid()} is no longer in mnt:[1]"
    lock = tmp_path / "lock"
    lock.touch()
    st = lock.stat()
    rel = str(lock).lstrip("/")
    assert remove_container_lock_in_child("/proc", os.getpid(), own, rel, st.st_dev, st.st_ino, st.st_mtime_ns) == (
        "removed"
    )
    assert not lock.exists()


def test_waiter_candidates_are_python_pollers_never_zombies_nor_long_sleepers() -> None:
    """A loop around a short sleep (as lock waiters poll) is a candidate; a process sleeping for a minute, a
    busy one and a zombie (still named python) are not."""
    poll = "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.05)"
    poller = subprocess.Popen([sys.executable, "-c", poll], stdout=subprocess.PIPE)
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE
    )
    busy = subprocess.Popen(
        [sys.executable, "-c", "print('ready', flush=True)\nwhile True: pass"], stdout=subprocess.PIPE
    )
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    started = [poller, sleeper, busy]
    try:
        for proc in started:
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 10
        while Path(f"/proc/{exited.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.02)
        candidates = lock_waiter_candidates(Path("/proc"), 100_000)
        assert poller.pid in candidates
        assert sleeper.pid not in candidates and busy.pid not in candidates
        assert exited.pid not in candidates  # a zombie polls nothing
    finally:
        for proc in started:
            proc.kill()
            proc.wait()
        exited.wait()
