"""probes/runtime/procfs.py and holders.py: cgroup classification on real path formats (v1, v2, cgroupfs and
systemd drivers, private cgroup namespaces), /proc/PID/stat parsing, process_info of real processes (one moved
into a real cgroup named like a pod's), device numbers by glob; and how holders are named, matched and stopped
(pod names from the runtimes' OCI bundles, the allow/ignore matcher, runtime-aware stop commands, redaction).
The /proc/*/fd scan: test_fdscan.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from support.system import require, require_root

from probes.runtime.holders import (
    Holder,
    PodNames,
    PodRef,
    Sighting,
    collect_holders,
    describe_holders,
    executable_name,
    matches_command,
    stop_hint,
)
from probes.runtime.procfs import (
    CgroupOwner,
    ProcessInfo,
    cgroup_path,
    classify_cgroup,
    classify_cgroup_path,
    device_rdevs,
    process_info,
)
from probes.runtime.procstat import parse_stat, state_of

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
    # podman: the cgroupfs manager (a container, one in a pod), the systemd manager, its conmon, rootless
    (f"4:memory:/libpod_parent/libpod-{CID}\n0::/libpod_parent/libpod-{CID}\n", "container", None, CID, "podman", None),
    (f"0::/libpod_parent/{'ab' * 32}/libpod-{CID}\n", "container", None, CID, "podman", None),
    (f"0::/machine.slice/libpod-{CID}.scope\n", "container", None, CID, "podman", f"libpod-{CID}.scope"),
    (
        f"0::/machine.slice/libpod-conmon-{CID}.scope\n",
        "container",
        None,
        CID,
        "podman",
        f"libpod-conmon-{CID}.scope",
    ),
    (
        f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{CID}.scope\n",
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
    parsed = parse_stat(line)
    assert parsed.comm == "a) b (c)"
    assert parsed.state == "S" and state_of(line) == "S"
    assert parsed.start_time == 987654
    with pytest.raises(ValueError):
        parse_stat("4242 (x) S 1 2")
    with pytest.raises(ValueError):
        parse_stat("no parens here")
    assert state_of("") == "" and state_of("no parens here") == ""


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A real process that sleeps until the test ends."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _mknod_copy(source: str, target: Path) -> int:
    rdev = os.stat(source).st_rdev
    os.mknod(target, 0o666 | stat.S_IFCHR, rdev)
    return rdev


def _start_time(pid: int) -> int:
    return parse_stat(Path(f"/proc/{pid}/stat").read_text()).start_time


def test_process_info_of_real_child(child: subprocess.Popen[bytes]) -> None:
    proc = child
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


@pytest.mark.system
def test_process_info_classifies_a_process_moved_into_a_pod_cgroup(child: subprocess.Popen[bytes]) -> None:
    """A real process in a real cgroup named like a Guaranteed pod's container (cgroupfs driver)."""
    require_root()
    proc = child
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


@pytest.mark.system
def test_device_rdevs_only_char_devices_matching_patterns(tmp_path: Path) -> None:
    tmp = tmp_path
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


# --- holders ---------------------------------------------------------------------------------------


def _info(pid: int, command: str, cgroup: str, comm: str = "") -> ProcessInfo:
    return ProcessInfo(pid, 1000 + pid, command, classify_cgroup_path(cgroup), comm or command.split()[0][-15:])


POD_CGROUP = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope"
CRIO_CGROUP = f"/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope"


def test_pod_names_from_containerd_and_cri_o_bundles_else_the_uid(tmp_path: Path) -> None:
    bundle = tmp_path / "run/containerd/io.containerd.runtime.v2.task/k8s.io" / CID
    bundle.mkdir(parents=True)
    annotations = {
        "io.kubernetes.cri.sandbox-namespace": "team-a",
        "io.kubernetes.cri.sandbox-name": "train-0",
        "io.kubernetes.cri.container-name": "worker",
    }
    (bundle / "config.json").write_text(json.dumps({"process": {"env": ["TOKEN=x"]}, "annotations": annotations}))
    names = PodNames(tmp_path)
    assert names.pod(classify_cgroup_path(POD_CGROUP)) == PodRef(UID, "team-a", "train-0", "worker")
    assert PodRef(UID, "team-a", "train-0").describe() == "pod team-a/train-0"
    crio = tmp_path / "run/containers/storage/overlay-containers" / CID / "userdata"
    crio.mkdir(parents=True)
    crio_annotations = {
        "io.kubernetes.pod.namespace": "b",
        "io.kubernetes.pod.name": "p",
        "io.kubernetes.container.name": "c",
    }
    (crio / "config.json").write_text(json.dumps({"annotations": crio_annotations}))
    assert PodNames(tmp_path).pod(classify_cgroup_path(CRIO_CGROUP)) == PodRef(UID, "b", "p", "c")
    # No bundle (another runtime, or the agent without the host's /run), or a broken one: the UID names the pod.
    (crio / "config.json").write_text("{not json")
    assert PodNames(tmp_path).pod(classify_cgroup_path(CRIO_CGROUP)) == PodRef(UID)
    assert PodNames(tmp_path / "absent").pod(classify_cgroup_path(POD_CGROUP)) == PodRef(UID)
    assert PodRef(UID).describe() == f"pod {UID}"
    assert names.pod(classify_cgroup_path("/system.slice/x.service")) is None


def test_stop_commands_by_owner_name_the_real_pids() -> None:
    holders = [
        Holder(_info(12, "python train.py", "/user.slice/user-0.slice/session-3.scope")),
        Holder(_info(34, "sleep 60", "/")),
        Holder(_info(56, "python serve.py", f"/system.slice/docker-{CID}.scope")),
        Holder(_info(57, "python serve.py", f"/system.slice/docker-{CID}.scope")),
        Holder(_info(78, "podman-thing", f"/machine.slice/libpod-{CID}.scope")),
        Holder(_info(90, "daemon", "/system.slice/npu-daemon.service")),
        Holder(_info(91, "worker", POD_CGROUP), PodRef(UID, "team-a", "train-0")),
        Holder(_info(92, "worker", POD_CGROUP)),
    ]
    assert stop_hint(holders) == (
        f"kill 12 34; docker stop {CID[:12]}; podman stop {CID[:12]}; systemctl stop npu-daemon.service; "
        f"kubectl delete pod -n team-a train-0; crictl stopp $(crictl pods -q --label io.kubernetes.pod.uid={UID})"
    )


def test_podman_containers_are_stopped_with_podman_and_rootless_ones_as_their_user() -> None:
    cgroupfs = Holder(_info(41, "python train.py", f"/libpod_parent/libpod-{CID}"))
    assert cgroupfs.where() == f"podman container {CID[:12]} outside Kubernetes"
    assert stop_hint([cgroupfs]) == f"podman stop {CID[:12]}"
    rootless = Holder(
        _info(42, "python", f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{CID}.scope")
    )
    assert rootless.owner.rootless_uid == 1000
    assert rootless.where() == f"podman container {CID[:12]} (rootless, uid 1000) outside Kubernetes"
    assert stop_hint([rootless]) == f"sudo -u '#1000' XDG_RUNTIME_DIR=/run/user/1000 podman stop {CID[:12]}"
    assert classify_cgroup_path("/libpod_parent/conmon").kind == "host"  # conmon holds no device of a job
    assert classify_cgroup_path(f"/system.slice/docker-{CID}.scope").container_command("exec", "rm /x") == (
        f"docker exec {CID[:12]} rm /x"
    )
    assert classify_cgroup_path("/system.slice/x.service").container_command("stop") is None


def test_holders_are_named_by_pid_and_executable_and_the_command_line_only_when_allowed() -> None:
    secret = "/usr/bin/python3 train.py --hf-token=hf_s3cr3t"
    holder = Holder(_info(42, secret, "/", comm="python3"), things={"davinci0"}, sources={"fd"})
    assert holder.who(redact=True) == "PID 42 (python3)"
    assert holder.phrase(redact=True) == "PID 42 (python3) in host cgroup /"
    assert "s3cr3t" not in json.dumps(holder.to_dict(redact=True))
    assert holder.who(redact=False) == f"PID 42 ({secret})"
    assert holder.to_dict(redact=False)["command"] == secret
    many = [Holder(_info(pid, "sleep 1", "/")) for pid in range(1, 6)]
    assert describe_holders(many, redact=True) == (
        "PID 1 (sleep) in host cgroup /, PID 2 (sleep) in host cgroup /, PID 3 (sleep) in host cgroup / and 2 more"
    )


def test_allow_and_ignore_lists_match_the_executable_or_the_task_name() -> None:
    info = _info(7, "/usr/bin/nvidia-persistenced --user nvidia", "/", comm="nvidia-persiste")
    assert matches_command(info, ["nvidia-persistenced"])
    assert matches_command(info, ["nvidia-*"])
    assert matches_command(_info(8, "[kworker/0:1]", "/", comm="kworker/0:1"), ["kworker/*"])
    assert not matches_command(info, ["persistenced", "python*"])
    assert executable_name(_info(9, "", "/", comm="zombie")) == "zombie"


def test_a_reused_pid_is_not_the_holder_the_scan_saw(child: subprocess.Popen[bytes]) -> None:
    start = _start_time(child.pid)
    sightings = [
        Sighting(child.pid, "davinci0", "fd", start),
        Sighting(child.pid, "davinci1", "fd", start + 1),  # an earlier process with that PID
        Sighting(child.pid, "davinci0", "npu-smi"),  # a tool's list: no start time to check
    ]
    holders, vanished = collect_holders(Path("/proc"), sightings)
    assert vanished == 1
    assert [(h.pid, sorted(h.things), sorted(h.sources)) for h in holders] == [
        (child.pid, ["davinci0"], ["fd", "npu-smi"])
    ]
    assert collect_holders(Path("/proc"), sightings, exclude=[child.pid]) == ([], 0)
