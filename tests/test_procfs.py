"""probes/_procfs.py: cgroup classification on real path formats, and the /proc/*/fd scan against real
processes holding a mknod'ed device copy, a file and a listening socket."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from support.system import require, require_root

from probes.runtime.host import ChildCalls, Host
from probes.runtime.procfs import (
    CgroupOwner,
    ScanTimeout,
    cgroup_path,
    classify_cgroup,
    device_rdevs,
    parse_start_time,
    parse_stat,
    process_info,
    scan_fds_in_child,
    scan_open_files,
)

UID = "1f0e7c2a-3b4d-4e5f-8a9b-0c1d2e3f4a5b"
UID_ = UID.replace("-", "_")
CID = "4c3b2a19" * 8  # 64 hex
STATIC_UID = "6f8c6b2dd3a0b4fe6b1d0c0ea7a56d1a"

HYBRID_V1 = """\
9:name=systemd:/
8:pids:/
7:blkio:/
6:freezer:/
5:devices:/
4:memory:/process_api/c1e97fa65943553b75f9e6e57374ea0b
3:cpuset:/
2:cpuacct:/
1:cpu:/
0::/
"""

# (cgroup file text, expected kind, pod uid, container id, runtime, unit)
CLASSIFICATION_TABLE = [
    # cgroup v2, systemd driver, containerd, Burstable
    (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
        "pod",
        UID,
        CID,
        "containerd",
        None,
    ),
    # v2 systemd, BestEffort, cri-o with its `container` sub-cgroup
    (
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{CID}.scope/container\n",
        "pod",
        UID,
        CID,
        "cri-o",
        None,
    ),
    # Guaranteed pod, systemd driver: no QoS level in the path
    (f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope\n", "pod", UID, CID, "cri-o", None),
    # Guaranteed pod, Docker (dockershim) on v1 systemd
    (
        f"12:pids:/kubepods.slice/kubepods-pod{UID_}.slice/docker-{CID}.scope\n"
        f"4:memory:/kubepods.slice/kubepods-pod{UID_}.slice/docker-{CID}.scope\n",
        "pod",
        UID,
        CID,
        "docker",
        None,
    ),
    # v1 cgroupfs driver (k3s), Guaranteed: /kubepods/pod<uid>/<id>
    (
        f"11:cpu,cpuacct:/kubepods/pod{UID}/{CID}\n10:memory:/kubepods/pod{UID}/{CID}\n",
        "pod",
        UID,
        CID,
        None,
        None,
    ),
    # v1 cgroupfs, Burstable
    (f"4:memory:/kubepods/burstable/pod{UID}/{CID}\n", "pod", UID, CID, None, None),
    # v2 cgroupfs, BestEffort
    (f"0::/kubepods/besteffort/pod{UID}/{CID}\n", "pod", UID, CID, None, None),
    # a process in the pod cgroup itself (no container level)
    (f"0::/kubepods/burstable/pod{UID}\n", "pod", UID, None, None, None),
    # static pod: the UID is a bare md5
    (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{STATIC_UID}.slice/"
        f"cri-containerd-{CID}.scope\n",
        "pod",
        STATIC_UID,
        CID,
        "containerd",
        None,
    ),
    # kind: kubelet with its own cgroup root, systemd driver
    (
        f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
        f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
        "pod",
        UID,
        CID,
        "containerd",
        None,
    ),
    # read from a private cgroup namespace (unprivileged agent on v2)
    (
        f"0::/../kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
        f"cri-containerd-{CID}.scope\n",
        "pod",
        UID,
        CID,
        "containerd",
        None,
    ),
    (f"0::/../../kubepods/besteffort/pod{UID}/{CID}\n", "pod", UID, CID, None, None),
    # kind: a Kubernetes node in a docker container
    (f"4:memory:/docker/{'ab' * 32}/kubepods/burstable/pod{UID}/{CID}\n", "pod", UID, CID, None, None),
    # containers outside Kubernetes
    (f"0::/system.slice/docker-{CID}.scope\n", "container", None, CID, "docker", f"docker-{CID}.scope"),
    (f"4:memory:/docker/{CID}\n8:pids:/docker/{CID}\n", "container", None, CID, "docker", None),
    (f"0::/../../system.slice/docker-{CID}.scope\n", "container", None, CID, "docker", f"docker-{CID}.scope"),
    (
        f"0::/system.slice/cri-containerd-{CID}.scope\n",
        "container",
        None,
        CID,
        "containerd",
        f"cri-containerd-{CID}.scope",
    ),
    (f"0::/system.slice/nerdctl-{CID}.scope\n", "container", None, CID, "containerd", f"nerdctl-{CID}.scope"),
    (f"0::/system.slice/crio-{CID}.scope\n", "container", None, CID, "cri-o", f"crio-{CID}.scope"),
    (
        f"0::/machine.slice/libpod-{CID}.scope/container\n",
        "container",
        None,
        CID,
        "podman",
        f"libpod-{CID}.scope",
    ),
    # systemd services, login sessions, host
    ("0::/system.slice/sshd.service\n", "service", None, None, None, "sshd.service"),
    ("0::/system.slice/containerd.service\n", "service", None, None, None, "containerd.service"),
    (
        "12:pids:/system.slice/ascend-dmp.service\n4:memory:/system.slice/ascend-dmp.service\n1:name=systemd:/system.slice/ascend-dmp.service\n",
        "service",
        None,
        None,
        None,
        "ascend-dmp.service",
    ),
    ("0::/user.slice/user-1000.slice/session-3.scope\n", "session", None, None, None, "session-3.scope"),
    (
        "0::/user.slice/user-1000.slice/user@1000.service/app.slice/run-r1b2.scope\n",
        "service",
        None,
        None,
        None,
        "run-r1b2.scope",
    ),
    ("0::/\n", "host", None, None, None, None),
    ("0::/init.scope\n", "host", None, None, None, "init.scope"),
    (HYBRID_V1, "host", None, None, None, None),
    ("", "unknown", None, None, None, None),
]


@pytest.mark.parametrize(("text", "kind", "pod_uid", "container_id", "runtime", "unit"), CLASSIFICATION_TABLE)
def test_classify_cgroup_table(
    text: str, kind: str, pod_uid: str | None, container_id: str | None, runtime: str | None, unit: str | None
) -> None:
    owner = classify_cgroup(text)
    assert (owner.kind, owner.pod_uid, owner.container_id, owner.runtime, owner.unit) == (
        kind,
        pod_uid,
        container_id,
        runtime,
        unit,
    )
    assert owner.in_pod == (kind == "pod")
    assert owner.describe()


def test_cgroup_path_prefers_memory_then_pids_then_unified() -> None:
    assert cgroup_path(HYBRID_V1) == "/process_api/c1e97fa65943553b75f9e6e57374ea0b"
    assert cgroup_path("9:name=systemd:/a.service\n8:pids:/b\n0::/c\n") == "/b"
    assert cgroup_path("9:name=systemd:/a.service\n0::/c\n") == "/c"
    assert cgroup_path("9:name=systemd:/a.service\n") == "/a.service"
    assert cgroup_path("garbage\n") == ""


def test_parse_stat_with_spaces_and_parentheses_in_comm() -> None:
    line = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10 " + " ".join(
        ["0"] * 30
    )
    comm, rest = parse_stat(line)
    assert comm == "a) b (c)"
    assert rest[0] == "S"
    assert parse_start_time(line) == 987654
    with pytest.raises(ValueError):
        parse_start_time("4242 (x) S 1 2")
    with pytest.raises(ValueError):
        parse_stat("no parens here")


# --- real processes --------------------------------------------------------------------------------

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


def _start_time(pid: int) -> int:
    return parse_start_time(Path(f"/proc/{pid}/stat").read_text())


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


def test_scan_only_sockets_skips_devices(holder) -> None:
    proc, _davinci, _copy, _regular, port = holder
    inode = _socket_inode_of_listener(proc.pid, port)
    result = scan_open_files(Host(), sockets=[inode], timeout=20)
    assert [(m.pid, m.key) for m in result.matches] == [(proc.pid, ("socket", inode))]


def test_scan_after_holder_exits_finds_nothing(holder) -> None:
    proc, davinci, _copy, _regular, _port = holder
    rdevs = device_rdevs(davinci.parent, ["davinci*"])
    proc.kill()
    proc.wait(timeout=10)
    result = scan_open_files(Host(), rdevs=rdevs, timeout=20)
    assert all(m.pid != proc.pid for m in result.matches)


def test_process_info_of_real_child(holder) -> None:
    proc, *_ = holder
    info = process_info(Path("/proc"), proc.pid)
    assert info is not None
    assert info.pid == proc.pid
    assert info.key == (proc.pid, _start_time(proc.pid))
    # field 22 agrees with psutil's create_time (boot time + start ticks / CLK_TCK)
    ticks = os.sysconf("SC_CLK_TCK")
    assert abs(psutil.boot_time() + info.start_time / ticks - psutil.Process(proc.pid).create_time()) < 1.0
    assert info.command.startswith(sys.executable + " -c")
    assert "\n" not in info.command
    assert info.comm == Path(f"/proc/{proc.pid}/comm").read_text().strip()
    assert info.uid == os.getuid()
    assert info.cgroup == classify_cgroup(Path(f"/proc/{proc.pid}/cgroup").read_text())


def test_process_info_of_vanished_process_is_none() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=10)
    assert process_info(Path("/proc"), proc.pid) is None


def _own_cgroup_dir() -> Path | None:
    """The directory of this process's cgroup in the hierarchy classify_cgroup reads (v1 memory/pids, v2)."""
    text = Path("/proc/self/cgroup").read_text()
    path = cgroup_path(text)
    wanted = None
    for line in text.splitlines():
        hierarchy, controllers, line_path = line.split(":", 2)
        if line_path == path:
            wanted = "" if hierarchy == "0" and not controllers else controllers
            break
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _source, options = right.split()[:3]
        mount_point, root = left.split()[4], left.split()[3]
        if (wanted == "" and fstype == "cgroup2") or (fstype == "cgroup" and wanted in options.split(",")):
            relative = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
            return Path(mount_point) / relative
    return None


def test_process_info_classifies_a_process_moved_into_a_pod_cgroup(holder) -> None:
    """A real process in a real cgroup named like a Guaranteed pod's container (cgroupfs driver)."""
    proc, *_ = holder
    own = _own_cgroup_dir()
    require(own is not None and os.access(own, os.W_OK), "a writable cgroup hierarchy of this process")
    assert own is not None
    created: list[Path] = []
    target = own
    for part in ("kubepods", f"pod{UID}", CID):
        target = target / part
        try:
            target.mkdir()
        except OSError as exc:
            require(False, f"mkdir in the cgroup hierarchy ({exc})")
        created.append(target)
    try:
        (target / "cgroup.procs").write_text(str(proc.pid))
        info = process_info(Path("/proc"), proc.pid)
        assert info is not None
        assert info.cgroup.kind == "pod"
        assert info.cgroup.pod_uid == UID
        assert info.cgroup.container_id == CID
        assert info.cgroup.in_pod
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for path in reversed(created):
            for _ in range(50):  # the killed process leaves the cgroup asynchronously
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)


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
    raw = scan_fds_in_child(str(proc), frozenset(), frozenset({(st.st_dev, st.st_ino)}), frozenset())
    assert raw["processes"] == 2
    assert raw["fds"] == 3
    assert raw["vanished"] == 2  # pid 4243 had no fd table; fd 3 pointed at a file that is gone
    assert raw["matches"] == [(4242, 5555, 5, str(held), ("inode", st.st_dev, st.st_ino))]


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
            raw = scan_fds_in_child("/proc", frozenset({os.stat("/dev/null").st_rdev}), frozenset(), frozenset())
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


def test_device_rdevs_only_char_devices_matching_patterns(tmp: Path) -> None:
    require_root()
    try:
        full = _mknod_copy("/dev/full", tmp / "davinci0")
        zero = _mknod_copy("/dev/zero", tmp / "davinci_manager")
        _mknod_copy("/dev/null", tmp / "hisi_hdc")
    except OSError as exc:
        require(False, f"mknod in {tmp} ({exc})")
    (tmp / "davinci1").write_text("a regular file is not a device")
    (tmp / "davinci2").mkdir()
    assert device_rdevs(tmp, ["davinci[0-9]*", "davinci_manager"]) == {
        full: str(tmp / "davinci0"),
        zero: str(tmp / "davinci_manager"),
    }
    assert device_rdevs(tmp / "missing", ["*"]) == {}


def test_owner_describe() -> None:
    assert "pod" in CgroupOwner("pod", pod_uid=UID, container_id=CID).describe()
    assert "docker" in CgroupOwner("container", container_id=CID, runtime="docker").describe()
    assert CgroupOwner("service", unit="x.service").describe() == "service x.service"


@pytest.mark.system
def test_scan_over_a_hung_fuse_file_times_out_and_never_blocks_the_caller(tmp_path: Path) -> None:
    """A holder of a file on a FUSE mount whose getattr never answers: the stat in the scan blocks (as on a
    hung NFS mount); the caller gets ScanTimeout in time, a second scan is refused while the first child is
    stuck, and the child is reaped once the filesystem goes away."""
    require_root()
    require(os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None, "FUSE (/dev/fuse, fusermount3)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from support.fusefs import fuse_mount

    children = ChildCalls()
    host = Host(children=children)
    with fuse_mount(tmp_path, "--hang-getattr") as mount:
        # Opening the mount's root needs no getattr; a stat through the holder's fd does, and hangs.
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
            assert holder.stdout is not None
            assert holder.stdout.readline().strip().isdigit()
            started = time.monotonic()
            with pytest.raises(ScanTimeout):
                scan_open_files(host, inodes=[(1, 1)], timeout=1.0)
            assert time.monotonic() - started < 3.0
            assert "procfs-fd-scan" in children.in_flight()
            with pytest.raises(ScanTimeout, match="still stuck"):
                scan_open_files(host, inodes=[(1, 1)], timeout=1.0)
        finally:
            holder.kill()
            holder.wait(timeout=10)
    deadline = time.monotonic() + 10
    while children.in_flight() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert children.in_flight() == {}
    # The next scan runs normally.
    assert scan_open_files(host, sockets=[1], timeout=20).processes > 0
