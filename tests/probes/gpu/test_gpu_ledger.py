"""gpu.holders and gpu.ledger against the device plugin's ledger: the fake NVML library, a fake kubelet serving real
gRPC on a unix socket (tests/support/fake_kubelet.py), real processes in pod cgroups holding mknod'ed nvidiaN
nodes, the pods named by containerd's OCI bundles.

NVIDIA time-slicing (`GPU-<uuid>::N` replicas in two pods), MPS (an MPS server pod beside its client pods) and
MIG devices are sharing by design; a GPU held by a pod the ledger gave it to no pod, or to another pod, fails
naming the pods; a GPU the plugin no longer offers warns beside the agent's own verdict; framebuffer in use with no
process says whether the ledger has the GPU free; a hung kubelet is not waited for.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.fake_kubelet import FakeKubelet
from support.fake_nvml.build import build_fake_nvml, device_config
from support.fake_nvml.runner import Run, run_probe
from support.pod_cgroups import containerd_bundle, idle_devices, pod_cgroups
from support.system import require

pytestmark = pytest.mark.system  # mknod, cgroups

GPU = "nvidia.com/gpu"
UUID0, UUID1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-00000000-0000-0000-0000-000000000001"
MIG0, MIG1 = "MIG-11111111-2222-3333-4444-555555555555", "MIG-66666666-7777-8888-9999-000000000000"


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require(shutil.which("gcc") is not None or shutil.which("cc") is not None, "gcc to build the fake NVML")
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Pods a (team-a/train-0) and b (team-b/train-1), one process each holding dev/nvidia0; named by their
    containerd bundles under the host root."""
    dev, root = tmp_path / "dev", tmp_path / "host"
    dev.mkdir()
    (major, minor), (major1, minor1) = idle_devices(2)
    os.mknod(dev / "nvidia0", 0o600 | stat.S_IFCHR, os.makedev(major, minor))
    os.mknod(dev / "nvidia1", 0o600 | stat.S_IFCHR, os.makedev(major1, minor1))
    hold = 'exec 3<"$0"; exec sleep 60'
    with pod_cgroups(2) as (a, b):
        procs = [subprocess.Popen(["bash", "-c", hold, str(dev / "nvidia0")]) for _ in (a, b)]
        try:
            for proc, pod, (namespace, name) in zip(
                procs, (a, b), (("team-a", "train-0"), ("team-b", "train-1")), strict=True
            ):
                pod.add(proc.pid)
                containerd_bundle(root, pod.container_id, namespace, name, "worker")
            _wait_exec(procs)
            yield {"dev": dev, "root": root, "pids": [p.pid for p in procs]}
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=10)


def _wait_exec(procs: list[subprocess.Popen[bytes]], comm: str = "sleep") -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if all(Path(f"/proc/{p.pid}/comm").read_text().strip() == comm for p in procs):
            return
        time.sleep(0.02)


def run(tmp_path: Path, fake_nvml: Path, node: dict[str, Any], kubelet: FakeKubelet, *gpus: dict[str, Any]) -> Run:
    top = {"kubernetes": {"pod_resources_socket": kubelet.socket, "pod_resources_timeout_seconds": 2.0}}
    text = device_config(*(gpus or ({}, {})))
    return run_probe(tmp_path, fake_nvml.parent, text, dev_dir=node["dev"], host_root=node["root"], top=top)


def test_time_sliced_replicas_in_two_pods_are_shared_by_design(
    tmp_path: Path, fake_nvml: Path, node: dict[str, Any]
) -> None:
    with FakeKubelet() as kubelet:
        kubelet.offer(GPU, f"{UUID0}::0", f"{UUID0}::1", f"{UUID1}::0", f"{UUID1}::1")
        kubelet.allocate("team-a", "train-0", "worker", GPU, f"{UUID0}::0")
        kubelet.allocate("team-b", "train-1", "worker", GPU, f"{UUID0}::1")
        result = run(tmp_path, fake_nvml, node, kubelet)
        # The same two pods without a ledger: GpuSharedByPods (gpu.shared_ok is off).
        kubelet.mode = "unavailable"
        kubelet.clear()
        time.sleep(1.1)
        blind = run(tmp_path, fake_nvml, node, kubelet)
    held = result.finding("gpu.holders", "gpu0")
    assert (held["status"], held["observed"]["pods"]) == ("ok", 2), held["message"]
    assert held["observed"]["shared_by_design"].startswith("replica ")
    assert [a["name"] for a in held["observed"]["allocated_to"]] == ["train-0", "train-1"]
    assert blind.finding("gpu.holders", "gpu0")["reason"] == "GpuSharedByPods"
    assert blind.finding("gpu.ledger", "")["reason"] == "PodResourcesUnavailable"
    assert result.sample("nodehealth_device_allocated", gpu="0", UUID=UUID0) == 2
    assert result.sample("nodehealth_device_allocated", gpu="1", UUID=UUID1) == 0


def test_a_gpu_allocated_to_one_pod_and_held_by_another_names_both(
    tmp_path: Path, fake_nvml: Path, node: dict[str, Any]
) -> None:
    with FakeKubelet() as kubelet:
        kubelet.offer(GPU, UUID0, UUID1)
        kubelet.allocate("team-a", "train-0", "worker", GPU, UUID0)
        kubelet.add_pod("team-b", "train-1", "worker")
        result = run(tmp_path, fake_nvml, node, kubelet)
    held = result.finding("gpu.holders", "gpu0")
    assert (held["status"], held["reason"], held["device"]) == ("fail", "GpuHeldOutsideAllocation", 0)
    assert "gpu0 is held by pod team-b/train-1 container worker (PID" in held["message"]
    assert "allocated it to pod team-a/train-0 container worker" in held["message"]
    assert "kubectl delete pod -n team-b train-1" in held["hint"]
    assert "GpuSharedByPods" not in held["message"] and "2 pods" not in held["message"]
    labels = {"gpu": "0", "UUID": UUID0, "pod": "train-0", "namespace": "team-a", "container": "worker"}
    assert result.sample("nodehealth_device_allocated", **labels) == 1
    assert result.sample("nodehealth_gpu_temperature_celsius", **labels) > 0


def test_a_gpu_allocated_to_no_pod_held_by_pods_fails(tmp_path: Path, fake_nvml: Path, node: dict[str, Any]) -> None:
    """Both pods hold gpu0 (privileged debug pods that mount /dev): the kubelet lists them, the ledger gave gpu0 to
    no pod."""
    with FakeKubelet() as kubelet:
        kubelet.offer(GPU, UUID0, UUID1)
        kubelet.add_pod("team-a", "train-0", "worker")
        kubelet.add_pod("team-b", "train-1", "worker")
        result = run(tmp_path, fake_nvml, node, kubelet)
    held = result.finding("gpu.holders", "gpu0")
    assert (held["status"], held["reason"], held["device"]) == ("fail", "GpuHeldOutsideAllocation", 0), held["message"]
    pid_a, pid_b = node["pids"]
    assert f"gpu0 is held by pod team-a/train-0 container worker (PID {pid_a} " in held["message"]
    assert f"pod team-b/train-1 container worker (PID {pid_b} " in held["message"]
    assert held["message"].endswith("but the device plugin's ledger allocated it to no pod")
    assert "kubectl delete pod -n team-a train-0" in held["hint"]
    assert held["observed"]["allocated_to"] == []
    assert sorted(p["name"] for p in held["observed"]["held_outside_allocation"]) == ["train-0", "train-1"]
    assert "GpuSharedByPods" not in held["message"] and "2 pods" not in held["message"]
    for gpu in ("gpu0", "gpu1"):
        free = result.finding("gpu.ledger", gpu)
        assert (free["status"], free["message"]) == ("ok", f"{gpu}: free in the ledger")
    assert result.sample("nodehealth_device_allocated", gpu="0", UUID=UUID0) == 0


def test_an_mps_server_beside_its_allocated_client_pods_is_sharing_by_design(
    tmp_path: Path, fake_nvml: Path, node: dict[str, Any]
) -> None:
    """The device plugin's MPS control daemon runs the MPS server in a pod of its own, with no allocation of the
    GPU, while the client pods hold their replicas: nothing outside the allocation, no GpuSharedByPods."""
    mps = 'exec 3<"$0"; exec -a nvidia-cuda-mps-server sleep 60'
    with pod_cgroups(1) as (daemon,):
        server = subprocess.Popen(["bash", "-c", mps, str(node["dev"] / "nvidia0")])
        try:
            daemon.add(server.pid)
            containerd_bundle(node["root"], daemon.container_id, "nvidia", "mps-control-daemon", "mps-server")
            _wait_exec([server], "nvidia-cuda-mps")  # comm is cut at 15 characters
            with FakeKubelet() as kubelet:
                kubelet.offer(GPU, f"{UUID0}::0", f"{UUID0}::1", f"{UUID1}::0", f"{UUID1}::1")
                kubelet.allocate("team-a", "train-0", "worker", GPU, f"{UUID0}::0")
                kubelet.allocate("team-b", "train-1", "worker", GPU, f"{UUID0}::1")
                kubelet.add_pod("nvidia", "mps-control-daemon", "mps-server")  # listed: judged if it were a tenant
                result = run(tmp_path, fake_nvml, node, kubelet)
        finally:
            server.kill()
            server.wait(timeout=10)
    held = result.finding("gpu.holders", "gpu0")
    assert (held["status"], held["reason"]) == ("ok", "OK"), held["message"]
    assert held["observed"]["shared_by_design"].startswith("replica ")
    assert "held_outside_allocation" not in held["observed"]
    in_pods = {h["pid"] for h in held["observed"]["in_pods"]}
    assert in_pods == {*node["pids"], server.pid}  # the server was seen, and excused
    assert [a["name"] for a in held["observed"]["allocated_to"]] == ["train-0", "train-1"]


def test_a_hung_kubelet_leaves_the_gpu_ledger_unknown_without_waiting(
    tmp_path: Path, fake_nvml: Path, node: dict[str, Any]
) -> None:
    """The read that has not come back when the run's own checks are done is not waited for (it would answer
    TIMEOUT after its 2 s deadline): the run says PENDING, and the holders stand as without a ledger."""
    with FakeKubelet(mode="hang") as kubelet:
        result = run(tmp_path, fake_nvml, node, kubelet)
    ledger = result.finding("gpu.ledger", "")
    assert (ledger["status"], ledger["reason"]) == ("unknown", "PodResourcesUnavailable")
    assert ledger["observed"]["ledger_error"]["code"] == "PENDING", ledger["message"]
    assert result.finding("gpu.holders", "gpu0")["reason"] == "GpuSharedByPods"
    assert ("gpu.ledger", "gpu0") not in {(f["check"], f["subject"]) for f in result.findings}


def test_mig_devices_belong_to_their_gpu(tmp_path: Path, fake_nvml: Path, node: dict[str, Any]) -> None:
    with FakeKubelet() as kubelet:
        kubelet.offer("nvidia.com/mig-1g.10gb", MIG0, MIG1)
        kubelet.offer(GPU, UUID1)
        kubelet.allocate("team-a", "train-0", "worker", "nvidia.com/mig-1g.10gb", MIG0)
        kubelet.allocate("team-b", "train-1", "worker", "nvidia.com/mig-1g.10gb", MIG1)
        result = run(tmp_path, fake_nvml, node, kubelet, {"mig_uuid": [MIG0, MIG1]}, {})
    held = result.finding("gpu.holders", "gpu0")
    assert held["status"] == "ok", held["message"]
    assert [a["device_id"] for a in held["observed"]["allocated_to"]] == [MIG0, MIG1]
    assert held["observed"]["shared_by_design"] == "MIG devices of one GPU"
    assert result.finding("gpu.ledger", "gpu0")["observed"]["offered"] is True


def test_a_gpu_the_plugin_no_longer_offers_warns_and_a_leak_says_free_in_the_ledger(
    tmp_path: Path, fake_nvml: Path
) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    with FakeKubelet() as kubelet:
        kubelet.offer(GPU, UUID0)  # GPU 1 marked unhealthy by the plugin
        top = {"kubernetes": {"pod_resources_socket": kubelet.socket}}
        text = device_config({}, {"memory_used_mib": 4096})
        result = run_probe(tmp_path, fake_nvml.parent, text, dev_dir=dev, top=top)
    unoffered = result.finding("gpu.ledger", "gpu1")
    assert (unoffered["status"], unoffered["reason"], unoffered["device"]) == ("warn", "DevicePluginUnhealthy", 1)
    assert (
        "no longer offers it" in unoffered["message"]
        and "the agent's own verdict: gpu.health ok" in unoffered["message"]
    )
    assert result.finding("gpu.ledger", "gpu0")["status"] == "ok"
    leak = result.finding("gpu.memory", "gpu1")
    assert leak["reason"] == "GpuMemoryLeaked" and "no process on the GPU (free in the ledger)" in leak["message"]
