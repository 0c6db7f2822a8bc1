"""probes/runtime/fdscan.py: the /proc/*/fd scan against real processes holding a mknod'ed device copy, a
file and a listening socket; vanished and forbidden entries, churn, concurrent callers, deadlines; and a
process with a file open on a hung FUSE mount, which must blind nothing."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.fusefs import fuse_mount
from support.system import fuse_capable, require, require_root

from probes.runtime import fdscan
from probes.runtime.holders import DeviceScan, device_holders
from probes.runtime.host import Host
from probes.runtime.procfs import (
    STATX_AVAILABLE,
    ScanError,
    ScanTimeout,
    described,
    device_rdevs,
    lingering_scanners,
    process_info,
    scan_in_process,
    scan_open_files,
)
from probes.runtime.procstat import parse_stat


def _start_time(pid: int) -> int:
    return parse_stat(Path(f"/proc/{pid}/stat").read_text()).start_time


HOLDER = r"""
import os, socket, sys, time
handles = [open(path, "rb") for path in sys.argv[1:]]
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
print(server.getsockname()[1], flush=True)
sys.stdin.read()
"""


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


def _mknod_copy(source: str, target: Path) -> int:
    rdev = os.stat(source).st_rdev
    os.mknod(target, 0o666 | stat.S_IFCHR, rdev)
    return rdev


@pytest.fixture
def holder(tmp: Path) -> Iterator[tuple[subprocess.Popen[str], Path, Path, Path, int]]:
    """A real process holding: a mknod'ed copy of /dev/full under other/, a regular file, a listening socket.

    tmp/dev/davinci0 has the same major:minor as the held copy; the holder never opens that path.
    """
    require_root()
    (tmp / "dev").mkdir()
    (tmp / "other").mkdir()
    davinci = tmp / "dev" / "davinci0"
    copy = tmp / "other" / "copy-of-davinci0"
    try:
        _mknod_copy("/dev/full", davinci)
        _mknod_copy("/dev/full", copy)
        with open(copy, "rb"):
            pass
    except OSError as exc:
        require(False, f"mknod and open of a device node in {tmp} ({exc})")
    regular = tmp / "weights.bin"
    regular.write_bytes(b"x" * 100)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(copy), str(regular)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield proc, davinci, copy, regular, port
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _socket_inode_of_listener(pid: int, port: int) -> int:
    """The inode of the TCP socket listening on 127.0.0.1:port, from the kernel's /proc/PID/net/tcp."""
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and int(local.split(":")[1], 16) == port:
            return int(inode)
    raise AssertionError(f"no listener on port {port} in /proc/{pid}/net/tcp")


@pytest.mark.system
def test_scan_finds_device_copy_by_rdev_file_by_inode_and_socket(holder) -> None:
    proc, davinci, copy, regular, port = holder
    host = Host()
    rdevs = device_rdevs(davinci.parent, ["davinci[0-9]*", "davinci_manager"])
    assert rdevs == {os.stat("/dev/full").st_rdev: str(davinci)}
    regular_st = os.stat(regular)
    socket_inode = _socket_inode_of_listener(proc.pid, port)

    result = scan_open_files(
        host,
        rdevs=rdevs,
        inodes=[(regular_st.st_dev, regular_st.st_ino)],
        sockets=[socket_inode],
        timeout=20,
    )
    mine = [m for m in result.matches if m.pid == proc.pid]
    by_kind = {m.key[0]: m for m in mine}
    assert set(by_kind) == {"rdev", "inode", "socket"}, mine
    start = _start_time(proc.pid)
    assert all(m.start_time == start for m in mine)
    # the holder opened the copy, never davinci0: found by device number, named by the holder's path
    assert by_kind["rdev"].target == str(copy)
    assert by_kind["rdev"].key == ("rdev", os.stat("/dev/full").st_rdev)
    assert by_kind["inode"].target == str(regular)
    assert by_kind["inode"].key == ("inode", regular_st.st_dev, regular_st.st_ino)
    assert by_kind["socket"].target == f"socket:[{socket_inode}]"
    assert by_kind["socket"].key == ("socket", socket_inode)
    # the fd numbers are the holder's real ones
    for match in mine:
        assert os.readlink(f"/proc/{proc.pid}/fd/{match.fd}") == match.target
    assert result.processes >= 2
    assert result.fds >= 3
    assert result.duration > 0
    # the scanning child never reports itself, and the agent process holds none of these
    assert all(m.pid != os.getpid() for m in result.matches)


@pytest.mark.system
def test_the_scanner_that_finds_a_holder_describes_it(holder) -> None:
    """stat, cgroup, status and cmdline of each holder are read by the scanner, not by the caller."""
    proc, davinci, _copy, _regular, _port = holder
    result = scan_open_files(Host(), rdevs=device_rdevs(davinci.parent, ["davinci0"]), timeout=20)
    assert {m.pid for m in result.matches} == set(result.texts) == {proc.pid}
    stat_text, cgroup_text, status_text, cmdline = result.texts[proc.pid]
    assert stat_text == Path(f"/proc/{proc.pid}/stat").read_text()
    assert cgroup_text == Path(f"/proc/{proc.pid}/cgroup").read_text()
    assert "\nUid:\t0\t" in status_text
    assert cmdline == Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    info = described(result)[proc.pid]
    assert info == process_info(Path("/proc"), proc.pid)
    assert info.start_time == _start_time(proc.pid) and info.uid == 0
    assert info.command.startswith(f"{sys.executable} -c import os, socket, sys, time handles = ")


POD_UID = "1f2e3d4c-aaaa-bbbb-cccc-111122223333"
CONTAINER_ID = "4c3b" + "0" * 60


def _fake_process(proc: Path, pid: int, fd_target: Path) -> Path:
    """/proc/PID of a process that holds fd_target in a pod, whose cmdline is a FIFO nobody writes: opening it
    blocks as a read of a real cmdline does while the process's mmap lock is held (a task stuck in mmap or
    munmap on a hung filesystem). Returns the FIFO."""
    base = proc / str(pid)
    (base / "fd").mkdir(parents=True)
    (base / "fd" / "3").symlink_to(fd_target)
    fields = ["S", "1", str(pid), str(pid), "0", "-1", "4194560"] + ["0"] * 12 + ["123456", "0", "0"]
    (base / "stat").write_text(f"{pid} (python3) {' '.join(fields)}\n")
    scope = f"cri-containerd-{CONTAINER_ID}.scope"
    pod_slice = f"kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice"
    (base / "cgroup").write_text(f"0::/kubepods.slice/kubepods-burstable.slice/{pod_slice}/{scope}\n")
    (base / "status").write_text("Name:\tpython3\nUid:\t1000\t1000\t1000\t1000\n")
    (base / "comm").write_text("python3\n")
    os.mkfifo(base / "cmdline")
    return base / "cmdline"


@pytest.mark.system
def test_a_cmdline_that_blocks_keeps_the_holder_and_never_blocks_the_caller(tmp: Path) -> None:
    require_root()
    dev = tmp / "dev"
    dev.mkdir()
    rdev = _mknod_copy("/dev/full", dev / "davinci3")
    _fake_process(tmp / "proc", 4242, dev / "davinci3")
    host = Host(proc=tmp / "proc", dev=dev)
    nodes = {rdev: "davinci3"}
    answer: list[object] = []

    def scan_and_describe() -> None:
        scan = scan_open_files(host, rdevs=nodes.keys(), timeout=10, partial=True, stall_seconds=0.5)
        answer.extend([scan, device_holders(host, DeviceScan(nodes, scan))])

    worker = threading.Thread(target=scan_and_describe, daemon=True)
    worker.start()
    worker.join(timeout=15)
    assert not worker.is_alive(), "the caller blocked on a cmdline"
    scan, holders = answer
    assert [(m.pid, m.key) for m in scan.matches] == [(4242, ("rdev", rdev))]  # type: ignore[attr-defined]
    assert scan.texts[4242][3] is None  # type: ignore[attr-defined]
    assert [(u.pid, u.comm) for u in scan.unreadable] == [(4242, "python3")]  # type: ignore[attr-defined]
    [holder] = holders.holders  # type: ignore[attr-defined]
    assert (holder.pid, holder.things, holder.info.start_time, holder.info.uid) == (4242, {"davinci3"}, 123456, 1000)
    assert holder.info.command == "[python3]" and holder.executable == "python3"
    assert holder.in_pod and holder.owner.pod_uid == POD_UID and holder.owner.container_id == CONTAINER_ID
    assert "PID 4242" in holders.shortfall()  # type: ignore[attr-defined]
    # Callers that need no command line never open it.
    info = process_info(tmp / "proc", 4242, with_command=False)
    assert info is not None and info.command == "[python3]" and info.cgroup.pod_uid == POD_UID
    deadline = time.monotonic() + 10  # a FIFO open is interruptible: the killed scanner is reaped
    while lingering_scanners() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lingering_scanners() == []


@pytest.mark.system
def test_scan_only_sockets_skips_devices(holder) -> None:
    proc, _davinci, _copy, _regular, port = holder
    inode = _socket_inode_of_listener(proc.pid, port)
    result = scan_open_files(Host(), sockets=[inode], timeout=20)
    assert [(m.pid, m.key) for m in result.matches] == [(proc.pid, ("socket", inode))]


@pytest.mark.system
def test_scan_after_holder_exits_finds_nothing(holder) -> None:
    proc, davinci, _copy, _regular, _port = holder
    rdevs = device_rdevs(davinci.parent, ["davinci*"])
    proc.kill()
    proc.wait(timeout=10)
    result = scan_open_files(Host(), rdevs=rdevs, timeout=20)
    assert all(m.pid != proc.pid for m in result.matches)


def test_scan_counts_vanished_entries_in_a_proc_tree(tmp: Path) -> None:
    """A /proc-shaped tree: a pid without fd/ (exited), an fd whose file is gone, a pipe, a matching file."""
    proc = tmp / "proc"
    (proc / "4242" / "fd").mkdir(parents=True)
    (proc / "4243").mkdir()
    (proc / "self").mkdir()
    held = tmp / "held"
    held.write_text("x")
    (proc / "4242" / "fd" / "3").symlink_to(tmp / "gone")
    (proc / "4242" / "fd" / "4").symlink_to("pipe:[1234]")
    (proc / "4242" / "fd" / "5").symlink_to(held)
    (proc / "4242" / "stat").write_text("4242 (x y) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5555 0 0\n")
    st = os.stat(held)
    raw = scan_in_process(str(proc), frozenset(), frozenset({(st.st_dev, st.st_ino)}), frozenset())
    assert raw["processes"] == 2
    assert raw["fds"] == 3
    assert raw["vanished"] == 2  # pid 4243 had no fd table; fd 3 pointed at a file that is gone
    assert raw["matches"] == [(4242, 5555, 5, str(held), ("inode", st.st_dev, st.st_ino), "fd")]


@pytest.mark.system
def test_scan_counts_permission_denied_without_crashing() -> None:
    """An unprivileged scanner cannot read root's fds: counted, never fatal."""
    require_root()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 1
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            raw = scan_in_process("/proc", frozenset({os.stat("/dev/null").st_rdev}), frozenset(), frozenset())
            os.write(write_fd, f"{raw['permission_denied']} {raw['processes']}".encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)
    with os.fdopen(read_fd) as reader:
        text = reader.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    denied, processes = map(int, text.split())
    assert denied >= 1  # at least this pytest process (root) itself
    assert processes >= denied


def test_scan_survives_process_churn() -> None:
    churn = subprocess.Popen(["sh", "-c", "while :; do sleep 0 & done"], start_new_session=True)
    try:
        time.sleep(0.2)
        host = Host()
        for _ in range(3):
            result = scan_open_files(host, rdevs=[os.stat("/dev/null").st_rdev], timeout=20)
            assert result.processes > 0
            assert result.vanished >= 0
    finally:
        os.killpg(churn.pid, signal.SIGKILL)
        churn.wait(timeout=10)


@pytest.mark.system
def test_concurrent_scans_from_several_probe_threads_all_succeed(holder) -> None:
    """npu, gpu, network and storage probes scan from their own threads at once: serialised, never refused."""
    proc, davinci, *_ = holder
    host = Host()
    rdevs = device_rdevs(davinci.parent, ["davinci*"])
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(scan_open_files, host, rdevs=rdevs, timeout=30) for _ in range(4)]
        results = [f.result(timeout=60) for f in futures]
    for result in results:
        assert [m.pid for m in result.matches if m.pid == proc.pid] == [proc.pid]


def test_scan_timeout_raises_scan_timeout() -> None:
    with pytest.raises(ScanTimeout):
        scan_open_files(Host(), rdevs=[1], timeout=1e-6)


@contextlib.contextmanager
def _holder_on_hung_fuse(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A process holding the root of a FUSE mount whose getattr never answers (as a hung NFS server): a plain
    stat(2) through its fd blocks in the kernel; opening the root needed none."""
    fuse_capable()
    tmp_path.mkdir(parents=True, exist_ok=True)
    with fuse_mount(tmp_path, "--hang-getattr") as mount:
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); print(fd, flush=True); input()",
                str(mount.path),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip().isdigit()
            yield holder
        finally:
            holder.kill()
            holder.wait(timeout=10)


@pytest.mark.system
def test_a_file_on_a_hung_fuse_mount_does_not_block_the_scan(tmp_path: Path, holder) -> None:
    """statx(AT_STATX_DONT_SYNC) answers from the inode cache: the fd on the hung mount is read like any other,
    and the device and file holders are all found, well within the deadline."""
    require(STATX_AVAILABLE, "statx(2) (glibc 2.28+, Linux 4.11+)")
    proc, davinci, _copy, regular, _port = holder
    regular_st = os.stat(regular)
    with _holder_on_hung_fuse(tmp_path / "fuse") as stuck:
        result = scan_open_files(
            Host(), rdevs=device_rdevs(davinci.parent, ["davinci*"]), inodes=[(regular_st.st_dev, regular_st.st_ino)],
            timeout=20, stall_seconds=2.0,
        )  # fmt: skip
        state = Path(f"/proc/{stuck.pid}/stat").read_text().rsplit(") ", 1)[1][0]
    assert result.complete and result.unreadable == ()
    assert {m.key[0] for m in result.matches if m.pid == proc.pid} == {"rdev", "inode"}
    assert result.duration < 2.0  # no stall was waited out (the per-process budget is 2 s)
    assert state != "D"
    assert lingering_scanners() == []


@pytest.mark.system
def test_a_stat_that_blocks_costs_one_process_not_the_scan(tmp_path: Path, holder) -> None:
    """Without statx (old kernels) a stat of that fd blocks: the scanner is killed after its per-process budget,
    the process is named as unreadable, and a new scanner finds every other holder; the caller never blocks."""
    proc, _davinci, _copy, regular, _port = holder
    regular_st = os.stat(regular)
    with _holder_on_hung_fuse(tmp_path / "fuse") as stuck:
        started = time.monotonic()
        result = scan_open_files(
            Host(), inodes=[(regular_st.st_dev, regular_st.st_ino)], timeout=20, partial=True, stall_seconds=0.5,
            use_statx=False,
        )  # fmt: skip
        elapsed = time.monotonic() - started
        with pytest.raises(ScanTimeout, match=f"PID {stuck.pid}"):
            scan_open_files(Host(), inodes=[(1, 1)], timeout=20, stall_seconds=0.5, use_statx=False)
    assert elapsed < 10.0
    assert [u.pid for u in result.unreadable] == [stuck.pid]
    assert result.unreadable[0].comm == Path(sys.executable).name[:15]
    assert "no answer within 0.5s" in result.unreadable[0].why and not result.complete
    assert f"PID {stuck.pid}" in result.shortfall()
    assert [m.pid for m in result.matches if m.key[0] == "inode"] == [proc.pid]  # found after the stuck one
    assert result.processes > 2
    deadline = time.monotonic() + 10  # FUSE waits are killable: the killed scanners are reaped
    while lingering_scanners() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lingering_scanners() == []


def test_a_scan_past_its_deadline_says_what_it_did_not_reach() -> None:
    result = scan_open_files(Host(), rdevs=[1], timeout=1e-6, partial=True)
    assert not result.complete and result.unscanned > 0
    assert "not reached before the deadline" in result.shortfall()


def test_scan_of_a_missing_proc_is_a_scan_error(tmp_path: Path) -> None:
    with pytest.raises(ScanError, match="cannot list"):
        scan_open_files(Host(proc=tmp_path / "absent"), rdevs=[1], timeout=5, partial=True)


def test_scanners_one_per_core_the_children_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    for millicores, processes, expected in [
        (None, 10_000, fdscan.MAX_SCANNERS),  # no limit: the CPUs, at most MAX_SCANNERS
        (400, 10_000, 1),  # the DaemonSet's 500m: its children's 400m share one core
        (1600, 10_000, 1),
        (2000, 10_000, 2),
        (None, 1_000, 2),  # at least MIN_PIDS_PER_SCANNER processes each
        (None, 100, 1),
    ]:
        monkeypatch.setattr(fdscan, "children_millicores", lambda m=millicores: m)
        assert fdscan.scanner_count(processes) == expected, (millicores, processes)


@pytest.mark.system
def test_several_scanners_find_what_one_finds(holder, monkeypatch: pytest.MonkeyPatch) -> None:
    proc, davinci, _copy, regular, _port = holder
    rdevs = device_rdevs(davinci.parent, ["davinci[0-9]*", "davinci_manager"])
    regular_st = os.stat(regular)
    wanted = {"rdevs": rdevs, "inodes": [(regular_st.st_dev, regular_st.st_ino)], "mappings": True}
    before = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    one = scan_open_files(Host(), timeout=20, **wanted)  # type: ignore[arg-type]
    monkeypatch.setattr(fdscan, "scanner_count", lambda _processes: 3)
    three = scan_open_files(Host(), timeout=20, **wanted)  # type: ignore[arg-type]
    # The machine's own processes come and go (a previous test's agents exiting); those alive before the first scan
    # and after the second were there for both, and each scan must have counted every one of them.
    lasting = before & {int(p) for p in os.listdir("/proc") if p.isdigit()}
    mine = sorted((m.key, m.fd, m.target) for m in three.matches if m.pid == proc.pid)
    assert mine == sorted((m.key, m.fd, m.target) for m in one.matches if m.pid == proc.pid) and len(mine) >= 2
    assert three.complete and proc.pid in three.texts
    assert three.processes >= len(lasting) and one.processes >= len(lasting), (len(lasting), one, three)
    pids = [m.pid for m in three.matches]
    order = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    assert pids == sorted(pids, key=lambda pid: order.index(pid) if pid in order else -1)  # in /proc's order


@pytest.mark.system
def test_with_several_scanners_a_stuck_process_costs_only_itself(
    tmp_path: Path, holder, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc, _davinci, _copy, regular, _port = holder
    regular_st = os.stat(regular)
    monkeypatch.setattr(fdscan, "scanner_count", lambda _processes: 3)
    with _holder_on_hung_fuse(tmp_path / "fuse") as stuck:
        result = scan_open_files(
            Host(), inodes=[(regular_st.st_dev, regular_st.st_ino)], timeout=20, partial=True, stall_seconds=0.5,
            use_statx=False,
        )  # fmt: skip
    assert [u.pid for u in result.unreadable] == [stuck.pid] and result.unscanned == 0, result.unreadable
    assert [m.pid for m in result.matches if m.key[0] == "inode"] == [proc.pid]
    deadline = time.monotonic() + 10
    while lingering_scanners() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lingering_scanners() == []
