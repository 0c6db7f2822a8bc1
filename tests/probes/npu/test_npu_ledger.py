"""npu.holders and npu.ledger against the device plugin's ledger, end to end: a fake kubelet serving real gRPC on a
unix socket (tests/support/fake_kubelet.py), real processes in pod cgroups holding mknod'ed davinci nodes, the
pods named by containerd's OCI bundles; the ledger read by the real reader child.

Each case of the ledger: a chip held by a pod it was not allocated to (to no pod, to another pod), a chip the
plugin no longer offers, HBM in use on a chip the ledger has free, vNPUs and Volcano's huawei.com/AscendReal
(sharing and real chips by design); a kubelet that hangs, one that answers UNAVAILABLE, the rate limit, no socket.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.fake_kubelet import FakeKubelet
from support.fake_npu_smi import FakeSmi, context, make_dev, run_probe, table
from support.pod_cgroups import PodCgroup, containerd_bundle, holding, idle_devices, pod_cgroups
from support.system import require

from probes.base import OBSERVED_ALLOCATED_TO, Finding, ProbeContext, Status
from probes.npu.npu import NpuProbe
from probes.runtime.podresources.client import COLLECT_GRACE_SECONDS, ledger_source
from probes.runtime.podresources.pods import KubeletAccess, PodIndex, PodMeta

TABLE = "910b1-8card-healthy-1proc-info-24.1.0.txt"  # chips 0..7, physical id = logical id
ASCEND = "huawei.com/Ascend910"
ALL_CHIPS = [f"Ascend910-{n}" for n in range(8)]


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSmi:
    smi = FakeSmi(tmp_path / "fake")
    monkeypatch.setenv("PATH", f"{smi.bin}{os.pathsep}{os.environ.get('PATH', '')}")
    smi.answer({"info": table(TABLE)})
    return smi


@pytest.fixture
def kubelet() -> Iterator[FakeKubelet]:
    with FakeKubelet() as server:
        server.offer(ASCEND, *ALL_CHIPS)
        yield server


class StaticPods:
    """The node's pod list as the agent's Kubernetes side would hand it over: listed when asked (the pods' latest
    state), or at `fetched_at`."""

    def __init__(self, *pods: PodMeta, fetched_at: float | None = None) -> None:
        self.pods, self.fetched_at = pods, fetched_at
        self.asked = 0

    def current(self) -> PodIndex:
        return PodIndex(self.pods, time.time() if self.fetched_at is None else self.fetched_at)

    def want_fresh(self) -> None:
        self.asked += 1


def ctx_for(tmp_path: Path, dev: Path, server: FakeKubelet, pods: StaticPods | None = None) -> ProbeContext:
    ctx = context(tmp_path, proc=Path("/proc"), dev=dev, kubelet=KubeletAccess(server.socket, 2.0, pods))
    ctx.host.root = tmp_path / "host"
    return ctx


def named_pod(tmp_path: Path, cgroup: PodCgroup, namespace: str, name: str, container: str = "main") -> PodMeta:
    containerd_bundle(tmp_path / "host", cgroup.container_id, namespace, name, container)
    return PodMeta(cgroup.uid, namespace, name)


def mine(finding: Finding, *pids: int) -> Finding:
    """The finding, after checking no other process of this machine holds the test's device."""
    others = [h for h in finding.observed.get("holders", []) if h["pid"] not in pids]
    require(not others, f"no other process of this machine holding the test's device (held by {others})")
    return finding


# --- (a), (b): held outside the allocation ------------------------------------------------------------


@pytest.mark.system
def test_a_pod_holding_a_chip_allocated_to_no_pod_fails(tmp_path: Path, fake: FakeSmi, kubelet: FakeKubelet) -> None:
    """A privileged debug pod that mounts /dev and opens davinci0: the ledger gave the chip to no pod."""
    (device,) = idle_devices(1)
    dev = make_dev(tmp_path / "dev", {"davinci0": device})
    with pod_cgroups(1) as (cgroup,), holding(dev / "davinci0") as child:
        cgroup.add(child.pid)
        pod = named_pod(tmp_path, cgroup, "ops", "debug-shell", "shell")
        kubelet.add_pod("ops", "debug-shell", "shell")
        findings, samples = run_probe(ctx_for(tmp_path, dev, kubelet, StaticPods(pod)))
        child.kill()
    held = mine(findings[("npu.holders", "npu0")], child.pid)
    assert (held.status, held.reason, held.device) == (Status.FAIL, "NpuHeldOutsideAllocation", 0), held.message
    assert f"held by pod ops/debug-shell container shell (PID {child.pid}" in held.message
    assert "allocated it to no pod" in held.message
    assert "kubectl delete pod -n ops debug-shell" in held.hint
    assert held.observed["held_outside_allocation"][0]["name"] == "debug-shell"
    chip = findings[("npu.ledger", "npu0")]
    assert (chip.status, chip.observed[OBSERVED_ALLOCATED_TO]) == (Status.OK, [])
    assert "free in the ledger" in chip.message
    allocated = [s for s in samples if s.name == "nodehealth_device_allocated" and s.labels["chip"] == "0"]
    assert [(s.value, s.labels["pod"]) for s in allocated] == [(0.0, "")]


@pytest.mark.system
def test_a_chip_allocated_to_one_pod_and_held_by_another_names_both(
    tmp_path: Path, fake: FakeSmi, kubelet: FakeKubelet
) -> None:
    (device,) = idle_devices(1)
    dev = make_dev(tmp_path / "dev", {"davinci3": device})
    with pod_cgroups(1) as (cgroup,), holding(dev / "davinci3") as child:
        cgroup.add(child.pid)
        pod = named_pod(tmp_path, cgroup, "team-b", "stray-0", "worker")
        kubelet.add_pod("team-b", "stray-0", "worker")
        kubelet.allocate("team-a", "train-0", "worker", ASCEND, "Ascend910-3")
        pods = StaticPods(pod, PodMeta("uid-train-0", "team-a", "train-0"))
        findings, samples = run_probe(ctx_for(tmp_path, dev, kubelet, pods))
        child.kill()
    held = mine(findings[("npu.holders", "npu3")], child.pid)
    assert (held.status, held.reason) == (Status.FAIL, "NpuHeldOutsideAllocation")
    assert "held by pod team-b/stray-0 container worker" in held.message
    assert "allocated it to pod team-a/train-0 container worker" in held.message
    assert held.observed[OBSERVED_ALLOCATED_TO] == [
        {
            "namespace": "team-a",
            "name": "train-0",
            "container": "worker",
            "resource": ASCEND,
            "device_id": "Ascend910-3",
        }
    ]
    ledger = findings[("npu.ledger", "npu3")]
    assert ledger.status == Status.OK and "allocated to pod team-a/train-0 container worker" in ledger.message
    labels = next(s.labels for s in samples if s.name == "nodehealth_npu_health" and s.labels["chip"] == "3")
    assert (labels["pod"], labels["namespace"], labels["container"], labels["id"]) == (
        "train-0",
        "team-a",
        "worker",
        "3",
    )


@pytest.mark.system
def test_a_holder_pod_without_a_bundle_is_named_by_the_node_pod_list(
    tmp_path: Path, fake: FakeSmi, kubelet: FakeKubelet
) -> None:
    """No OCI bundle names the pod (another runtime's layout): its cgroup's UID, through the node's pod list."""
    (device,) = idle_devices(1)
    dev = make_dev(tmp_path / "dev", {"davinci4": device})
    with pod_cgroups(1) as (cgroup,), holding(dev / "davinci4") as child:
        cgroup.add(child.pid)
        kubelet.add_pod("ops", "debug-shell")
        pods = StaticPods(PodMeta(cgroup.uid, "ops", "debug-shell"))
        findings, _ = run_probe(ctx_for(tmp_path, dev, kubelet, pods))
        # Known by UID only: not judged (it may be a pod the list has not caught up with), a fresh list asked.
        unknown = StaticPods()
        time.sleep(1.1)
        unnamed = run_probe(ctx_for(tmp_path, dev, kubelet, unknown))[0]
        child.kill()
    held = mine(findings[("npu.holders", "npu4")], child.pid)
    assert (held.status, held.reason) == (Status.FAIL, "NpuHeldOutsideAllocation")
    assert "held by pod ops/debug-shell (PID" in held.message
    assert unnamed[("npu.holders", "npu4")].status == Status.OK and unknown.asked >= 1
    assert unnamed[("npu.holders", "npu4")].observed["holders_not_named"] == 1


@pytest.mark.system
def test_the_pod_the_chip_is_allocated_to_may_hold_it(tmp_path: Path, fake: FakeSmi, kubelet: FakeKubelet) -> None:
    (device,) = idle_devices(1)
    dev = make_dev(tmp_path / "dev", {"davinci2": device})
    with pod_cgroups(1) as (cgroup,), holding(dev / "davinci2") as child:
        cgroup.add(child.pid)
        pod = named_pod(tmp_path, cgroup, "team-a", "train-0", "worker")
        kubelet.allocate("team-a", "train-0", "worker", ASCEND, "Ascend910-2")
        findings, samples = run_probe(ctx_for(tmp_path, dev, kubelet, StaticPods(pod)))
        child.kill()
    held = mine(findings[("npu.holders", "npu2")], child.pid)
    assert held.status == Status.OK and held.observed["allocated_to"][0]["name"] == "train-0"
    allocated = next(s for s in samples if s.name == "nodehealth_device_allocated" and s.labels["chip"] == "2")
    assert (allocated.value, allocated.labels["pod"], allocated.labels["resource"]) == (1.0, "train-0", ASCEND)


@pytest.mark.system
def test_a_pods_own_ascend_real_never_fails_the_chip_the_kubelet_gave_it(
    tmp_path: Path, fake: FakeSmi, kubelet: FakeKubelet, double: Any
) -> None:
    """Field failure: a pod of the default scheduler, given davinci0 by the kubelet, wrote its own
    huawei.com/AscendReal: Ascend910-3, and its own chip became NpuHeldOutsideAllocation (fail, a taint). The
    agent's Kubernetes side (NodePods on the API double) reads AscendReal only on pods Volcano placed."""
    from agent.kube.client import KubeApi
    from agent.kube.pods import NodePods

    (device,) = idle_devices(1)
    dev = make_dev(tmp_path / "dev", {"davinci0": device})
    double.add_node("node-a")
    with pod_cgroups(1) as (cgroup,), holding(dev / "davinci0") as child:
        cgroup.add(child.pid)
        named_pod(tmp_path, cgroup, "team-a", "own-0", "main")
        forged = {"huawei.com/AscendReal": "Ascend910-3"}
        double.add_pod("team-a", "own-0", "node-a", uid=cgroup.uid, annotations=forged)
        kubelet.allocate("team-a", "own-0", "main", ASCEND, "Ascend910-0")
        pods = NodePods(lambda: KubeApi(double.client, 5), "node-a")
        probe = NpuProbe()
        run_probe(ctx_for(tmp_path, dev, kubelet, pods), probe)  # the pod first seen in the ledger
        time.sleep(1.1)  # the kubelet's rate limit
        assert pods.refresh()  # a list newer than that sighting: the holders are compared
        findings, _ = run_probe(ctx_for(tmp_path, dev, kubelet, pods), probe)
        child.kill()
    ledger = findings[("npu.ledger", "")]
    assert ledger.observed["compared_with_holders"] is True, ledger.message
    held = mine(findings[("npu.holders", "npu0")], child.pid)
    assert (held.status, held.reason) == (Status.OK, "OK"), held.message
    assert held.observed["allocated_to"][0]["device_id"] == "Ascend910-0"


@pytest.mark.system
def test_volcanos_annotation_against_what_the_pod_holds_is_a_warn_naming_both(
    tmp_path: Path, fake: FakeSmi, kubelet: FakeKubelet
) -> None:
    """A Volcano pod whose AscendReal names davinci6 while it holds davinci0, the chip the kubelet-side id gave it:
    the holder scan is believed; at most a warn that names both, never a fail on the annotation's word."""
    (device,) = idle_devices(1)
    dev = make_dev(tmp_path / "dev", {"davinci0": device})
    with pod_cgroups(1) as (cgroup,), holding(dev / "davinci0") as child:
        cgroup.add(child.pid)
        meta = named_pod(tmp_path, cgroup, "team-a", "vc-job-0", "worker")
        kubelet.allocate("team-a", "vc-job-0", "worker", ASCEND, "Ascend910-0")
        real = PodMeta(meta.uid, meta.namespace, meta.name, {"huawei.com/AscendReal": "Ascend910-6"})
        findings, _ = run_probe(ctx_for(tmp_path, dev, kubelet, StaticPods(real)))
        child.kill()
    held = mine(findings[("npu.holders", "npu0")], child.pid)
    assert (held.status, held.reason) == (Status.WARN, "NpuAllocationDisagrees"), held.message
    assert "held by pod team-a/vc-job-0" in held.message and "AscendReal names Ascend910-6" in held.message
    assert held.observed["annotation_disagrees"][0]["annotation"] == "Ascend910-6"
    assert not any(f.status == Status.FAIL for f in findings.values()), [f for f in findings.values()]


# --- (c) no longer offered, (d) free in the ledger ---------------------------------------------------------


@pytest.mark.system
def test_a_chip_the_plugin_no_longer_offers_warns_beside_the_agents_verdict(
    tmp_path: Path, fake: FakeSmi, kubelet: FakeKubelet
) -> None:
    kubelet.clear()
    kubelet.offer(ASCEND, *(chip for chip in ALL_CHIPS if chip != "Ascend910-5"))
    findings, _ = run_probe(context(tmp_path, kubelet=KubeletAccess(kubelet.socket, 2.0)))
    unhealthy = findings[("npu.ledger", "npu5")]
    assert (unhealthy.status, unhealthy.reason, unhealthy.device) == (Status.WARN, "DevicePluginUnhealthy", 5)
    assert "no longer offers it (absent from GetAllocatableResources)" in unhealthy.message
    assert "the agent's own verdict: npu.health ok" in unhealthy.message
    assert findings[("npu.ledger", "npu4")].status == Status.OK
    node = findings[("npu.ledger", "")]
    assert node.status == Status.OK and "7 chips offered" in node.message
    strict = context(tmp_path, {"device_plugin_unhealthy_status": "fail"}, kubelet=KubeletAccess(kubelet.socket, 2.0))
    time.sleep(1.1)  # past the reuse window: a read of its own
    assert run_probe(strict)[0][("npu.ledger", "npu5")].status == Status.FAIL


@pytest.mark.system
def test_hbm_in_use_with_no_process_says_the_chip_is_free_in_the_ledger(
    tmp_path: Path, fake: FakeSmi, kubelet: FakeKubelet
) -> None:
    fake.answer({"info": table("910b2c-2card-1proc-info-23.0.2.1-trailing-spaces.txt")})
    kubelet.offer(ASCEND, "Ascend910-0", "Ascend910-1")
    findings, _ = run_probe(context(tmp_path, kubelet=KubeletAccess(kubelet.socket, 2.0)))
    leaked = findings[("npu.hbm", "npu1")]
    assert (leaked.status, leaked.reason) == (Status.FAIL, "NpuHbmLeaked")
    assert leaked.message.endswith("; free in the ledger") and leaked.observed["ledger"] == "free in the ledger"
    kubelet.allocate("team-a", "train-0", "worker", ASCEND, "Ascend910-1")
    time.sleep(1.1)
    leaked = run_probe(context(tmp_path, kubelet=KubeletAccess(kubelet.socket, 2.0)))[0][("npu.hbm", "npu1")]
    assert leaked.message.endswith("; allocated to pod team-a/train-0 container worker in the ledger")


# --- sharing and real chips by design ---------------------------------------------------------------------


@pytest.mark.system
def test_vnpus_of_one_chip_in_two_pods_are_shared_by_design(
    tmp_path: Path, fake: FakeSmi, kubelet: FakeKubelet
) -> None:
    (device,) = idle_devices(1)
    dev = make_dev(tmp_path / "dev", {"davinci1": device})
    with pod_cgroups(2) as (one, two), holding(dev / "davinci1") as first, holding(dev / "davinci1") as second:
        one.add(first.pid)
        two.add(second.pid)
        pods = StaticPods(named_pod(tmp_path, one, "team-a", "infer-0"), named_pod(tmp_path, two, "team-b", "infer-1"))
        kubelet.allocate("team-a", "infer-0", "main", "huawei.com/Ascend910-2c", "Ascend910-2c-100-1")
        kubelet.allocate("team-b", "infer-1", "main", "huawei.com/Ascend910-2c", "Ascend910-2c-101-1")
        findings, samples = run_probe(ctx_for(tmp_path, dev, kubelet, pods))
        # Without the ledger the same two pods on one chip are NpuSharedByPods.
        unshared = run_probe(context(tmp_path, proc=Path("/proc"), dev=dev))[0][("npu.holders", "npu1")]
        first.kill()
        second.kill()
    held = mine(findings[("npu.holders", "npu1")], first.pid, second.pid)
    assert held.status == Status.OK and held.observed["pods"] == 2
    assert held.observed["shared_by_design"] == "vNPU 2c (template)"
    assert (unshared.status, unshared.reason) == (Status.FAIL, "NpuSharedByPods")
    allocated = next(s for s in samples if s.name == "nodehealth_device_allocated" and s.labels["chip"] == "1")
    assert (allocated.value, allocated.labels["pod"]) == (2.0, "")  # shared: counted, no one pod named


@pytest.mark.system
def test_volcano_ascend_real_names_the_chips_really_mounted(
    tmp_path: Path, fake: FakeSmi, kubelet: FakeKubelet
) -> None:
    """Under Volcano the kubelet-side id (Ascend910-0) is not the chip mounted: AscendReal says davinci6."""
    (device,) = idle_devices(1)
    dev = make_dev(tmp_path / "dev", {"davinci6": device})
    with pod_cgroups(1) as (cgroup,), holding(dev / "davinci6") as child:
        cgroup.add(child.pid)
        meta = named_pod(tmp_path, cgroup, "team-a", "vc-job-0", "worker")
        kubelet.allocate("team-a", "vc-job-0", "worker", ASCEND, "Ascend910-0")
        real = PodMeta(meta.uid, meta.namespace, meta.name, {"huawei.com/AscendReal": "Ascend910-6"})
        findings, _ = run_probe(ctx_for(tmp_path, dev, kubelet, StaticPods(real)))
        # The pod list read before the pod's allocation may lack the annotation: no verdict, a fresh list asked.
        stale = StaticPods(meta, fetched_at=time.time() - 3600)
        time.sleep(1.1)
        before = run_probe(ctx_for(tmp_path, dev, kubelet, stale), NpuProbe())[0]
        # Without the node's pod list the chips of a Volcano pod cannot be known: not compared.
        time.sleep(1.1)
        blind = run_probe(ctx_for(tmp_path, dev, kubelet, None))[0]
        child.kill()
    held = mine(findings[("npu.holders", "npu6")], child.pid)
    assert held.status == Status.OK and held.observed["allocated_to"][0]["device_id"] == "Ascend910-6"
    assert findings[("npu.ledger", "npu0")].observed[OBSERVED_ALLOCATED_TO] == []
    assert "allocated to pod team-a/vc-job-0" in findings[("npu.ledger", "npu6")].message
    assert before[("npu.holders", "npu6")].status == Status.OK and stale.asked == 1
    assert "newer than the node's pod list" in before[("npu.ledger", "")].message
    assert blind[("npu.holders", "npu6")].status == Status.OK
    assert blind[("npu.ledger", "")].observed["compared_with_holders"] is False


# --- a kubelet that does not answer, the rate limit, no socket --------------------------------------------


@pytest.mark.system
def test_a_hung_kubelet_leaves_the_holder_checks_as_they_are(tmp_path: Path, fake: FakeSmi) -> None:
    """The same run against a kubelet that answers and one that never does: the hung one adds at most the collect
    grace (and noise), not the read's deadline (4 s here, which a run waiting for the read would add)."""
    (device,) = idle_devices(1)
    dev = make_dev(tmp_path / "dev", {"davinci0": device})
    elapsed: dict[str, float] = {}
    runs: dict[str, dict[tuple[str, str], Finding]] = {}
    with holding(dev / "davinci0") as child:
        for mode in ("ok", "hang"):
            with FakeKubelet(mode=mode) as server:  # each its own socket: its own reader child to start
                ctx = context(tmp_path, proc=Path("/proc"), dev=dev, kubelet=KubeletAccess(server.socket, 4.0))
                started = time.monotonic()
                runs[mode], _ = run_probe(ctx)
                elapsed[mode] = time.monotonic() - started
        child.kill()
    assert elapsed["hang"] < 2 * elapsed["ok"] + COLLECT_GRACE_SECONDS + 0.75, elapsed
    assert runs["ok"][("npu.ledger", "")].status == Status.OK
    ledger = runs["hang"][("npu.ledger", "")]
    assert (ledger.status, ledger.reason) == (Status.UNKNOWN, "PodResourcesUnavailable")
    assert ledger.observed["ledger_error"]["code"] == "PENDING" and "kubelet slow or hung" in ledger.message
    for findings in runs.values():
        held = findings[("npu.holders", "npu0")]
        assert (held.status, held.reason) == (Status.FAIL, "NpuHeldOutOfBand")  # as without a ledger
    assert ("npu.ledger", "npu0") not in runs["hang"]


@pytest.mark.system
def test_an_unavailable_kubelet_is_unknown_and_named(tmp_path: Path, fake: FakeSmi) -> None:
    with FakeKubelet(mode="unavailable") as server:
        findings, samples = run_probe(context(tmp_path, kubelet=KubeletAccess(server.socket, 2.0)))
    ledger = findings[("npu.ledger", "")]
    assert (ledger.status, ledger.reason) == (Status.UNKNOWN, "PodResourcesUnavailable")
    assert "UNAVAILABLE" in ledger.message and "kubelet restarting" in ledger.message
    assert findings[("npu.holders", "npu0")].status == Status.OK
    assert not [s for s in samples if s.name == "nodehealth_device_allocated"]


@pytest.mark.system
def test_reads_stay_within_the_kubelets_rate_limit(tmp_path: Path, fake: FakeSmi, kubelet: FakeKubelet) -> None:
    """Twenty runs back to back, as a 1 s interval would never even do: one read per run at most, each two calls,
    never one refused by the kubelet's limit (100 QPS, burst 10)."""
    probe = NpuProbe()
    for _ in range(20):
        findings, _ = run_probe(context(tmp_path, kubelet=KubeletAccess(kubelet.socket, 2.0)), probe)
        assert findings[("npu.ledger", "")].status == Status.OK
    reads = ledger_source(kubelet.socket).reads
    assert 1 <= reads <= 20 and kubelet.calls == {"List": reads, "GetAllocatableResources": reads}
    assert kubelet.limited == 0


@pytest.mark.system
def test_a_kubelet_that_refuses_over_its_rate_limit_leaves_the_ledger_unknown(tmp_path: Path, fake: FakeSmi) -> None:
    with FakeKubelet(rate=0.001, burst=1) as server:  # one call, then none for a long while
        server.offer(ASCEND, *ALL_CHIPS)
        findings, _ = run_probe(context(tmp_path, kubelet=KubeletAccess(server.socket, 2.0)))
        limited = server.limited
    ledger = findings[("npu.ledger", "")]
    assert (ledger.status, ledger.observed["ledger_error"]["code"]) == (Status.UNKNOWN, "RESOURCE_EXHAUSTED")
    assert limited == 1 and findings[("npu.holders", "npu0")].status == Status.OK


def test_no_socket_is_a_skip_with_the_reason(tmp_path: Path, fake: FakeSmi) -> None:
    findings, _ = run_probe(context(tmp_path))
    skip = findings[("npu.ledger", "")]
    assert (skip.status, skip.reason) == (Status.SKIP, "NotApplicable")
    assert "no kubelet PodResources socket at" in skip.message
