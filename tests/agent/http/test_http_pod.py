"""/ready?pod=<namespace>/<name>: exactly the devices the kubelet's ledger allocated to the pod.

- The mapping (agent/http/pod.py), on ledgers of every shape: NVIDIA UUIDs, MIG ids, time-sliced replicas and
  indices; Ascend chips, vNPUs and Volcano's huawei.com/AscendReal (a pod list older than the pod's first sighting
  is not trusted); DRA claims (every device); ids no result names; NPU 0 and GPU 0 kept apart.
- Over real HTTP against the real server and health state: ready for a pod whose chip is healthy while another
  fails, not ready when its own fails, 503 PodNotInLedger / LedgerUnavailable / LedgerStale beside the node-wide
  reasons, the fallback to devices=, the JSON `pod` and the text first line, a long-poll that sees the pod
  arrive, a bad pod= (400), and at most one ledger read a second however many ask. The ledger here is a read the
  test sets (`HeldLedger`); tests/agent/test_http_pod_node.py reads it from a fake kubelet over real gRPC.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest

from agent.http.pod import LEDGER_WAIT_SECONDS, MAX_LEDGER_AGE_SECONDS, PodLedger, map_devices, read_problem
from agent.http.routes import HttpServer
from agent.metrics import MetricsRenderer
from agent.ready import BadQuery, parse_pod
from agent.reasons import LEDGER_STALE, LEDGER_UNAVAILABLE, POD_DEVICES_UNKNOWN, POD_NOT_IN_LEDGER
from agent.snapshot import Snapshot
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes.base import OBSERVED_DEVICE_IDS, Finding, Status
from probes.npu.ledger_findings import FirstSeen
from probes.runtime.podresources.client import LedgerRead
from probes.runtime.podresources.ledger import ASCEND_REAL_ANNOTATION, Allocation, Ledger
from probes.runtime.podresources.pods import PodIndex, PodMeta

GPU_0 = "GPU-5f4c2a8e-0d1b-4c6e-9a3f-000000000000"
GPU_1 = "GPU-5f4c2a8e-0d1b-4c6e-9a3f-111111111111"
MIG_1 = "MIG-9a3f4c2a-8e0d-4b1c-6e5f-000000000001"
CHECKS = ("npu.health", "gpu.health", "storage.space")
ASCEND, NVIDIA = "huawei.com/Ascend910", "nvidia.com/gpu"


# --- a node: 4 NPUs (logical id = physical id but for chip 3, physical 7) and 2 GPUs ---------------------------


def npu(logical: int, status: Status = Status.OK, physical: int | None = None) -> Finding:
    observed: dict[str, Any] = {"logical_id": logical, "physical_id": logical if physical is None else physical}
    reason = "OK" if status == Status.OK else "NpuAlarm"
    return Finding(
        "npu.health", f"npu{logical}", status, reason, f"npu {logical}", "reset it", observed, device=logical
    )


def gpu(index: int, ids: list[str], status: Status = Status.OK) -> Finding:
    reason = "OK" if status == Status.OK else "GpuBroken"
    observed = {OBSERVED_DEVICE_IDS: ids}
    return Finding("gpu.health", f"gpu{index}", status, reason, f"gpu {index}", "reseat it", observed, device=index)


def node_state(
    failing_npus: tuple[int, ...] = (), failing_gpus: tuple[int, ...] = (), disk: Status = Status.OK
) -> HealthState:
    state = HealthState("node-a", HealthSettings(fail_threshold=1, recovery_threshold=1))
    state.configure(
        [
            ProbeSpec("npu", ("npu.health",), 30.0, 20.0),
            ProbeSpec("gpu", ("gpu.health",), 30.0, 20.0),
            ProbeSpec("storage", ("storage.space",), 30.0, 5.0),
        ]
    )
    feed(state, failing_npus, failing_gpus, disk)
    return state


def feed(
    state: HealthState, failing_npus: tuple[int, ...] = (), failing_gpus: tuple[int, ...] = (), disk: Status = Status.OK
) -> None:
    chips = [npu(n, Status.FAIL if n in failing_npus else Status.OK, physical=7 if n == 3 else None) for n in range(4)]
    state.record("npu", chips)
    gpus = [gpu(0, [GPU_0]), gpu(1, [GPU_1, MIG_1])]
    state.record(
        "gpu",
        [
            gpu(g.device or 0, g.observed[OBSERVED_DEVICE_IDS], Status.FAIL if g.device in failing_gpus else Status.OK)
            for g in gpus
        ],
    )
    reason = "OK" if disk == Status.OK else "DiskFull"
    state.record("storage", [Finding("storage.space", "/data", disk, reason, "40% used", "clean it")])


def grants(namespace: str, name: str, *grants: tuple[str, str]) -> list[Allocation]:
    return [Allocation(namespace, name, "main", resource, device_id) for resource, device_id in grants]


class Pods:
    """The node's pod list as the agent's Kubernetes side hands it over."""

    def __init__(self, *pods: PodMeta, fetched_at: float) -> None:
        self.index = PodIndex(pods, fetched_at)
        self.asked = 0

    def current(self) -> PodIndex:
        return self.index

    def want_fresh(self) -> None:
        self.asked += 1


KUBERNETES_OFF = None


def listed() -> Pods:
    """A pod list newer than anything: the pod is not Volcano's (no annotation)."""
    return Pods(PodMeta("uid-1", "team-a", "train-0"), fetched_at=time.time() + 3600)


def mapped(
    snapshot: Snapshot, allocations: list[Allocation], pods: Pods | None = None, seen: FirstSeen | None = None
) -> Any:
    return map_devices(snapshot, "team-a", "train-0", allocations, seen or FirstSeen(), pods)


# --- the mapping --------------------------------------------------------------------------------------------


def test_nvidia_ids_of_every_strategy_map_to_their_gpu() -> None:
    snapshot = node_state().current()
    for device_id, expected in (
        (GPU_1, ("gpu", 1)),
        (GPU_1.lower(), ("gpu", 1)),
        (f"{GPU_0}::3", ("gpu", 0)),  # a time-slicing / MPS replica: its GPU
        (MIG_1, ("gpu", 1)),  # a MIG device: judged by its GPU's results
        ("1", ("gpu", 1)),  # the plugin's index strategy
    ):
        found = mapped(snapshot, grants("team-a", "train-0", (NVIDIA, device_id)))
        assert found.known and found.devices == {expected}, device_id


def test_ascend_chips_and_vnpus_map_to_the_chip_by_its_physical_id() -> None:
    snapshot = node_state().current()
    found = mapped(snapshot, grants("team-a", "train-0", (ASCEND, "Ascend910-1"), (ASCEND, "Ascend910-7")), listed())
    assert found.devices == {("npu", 1), ("npu", 3)}, "davinci7 is the chip whose logical id is 3"
    vnpu = mapped(snapshot, grants("team-a", "train-0", ("huawei.com/Ascend910-2c", "Ascend910-2c-100-2")), listed())
    assert vnpu.devices == {("npu", 2)}
    assert vnpu.describe() == "pod team-a/train-0 (npu2 from the kubelet's ledger)"


def test_npu_and_gpu_of_the_same_index_are_told_apart() -> None:
    snapshot = node_state(failing_npus=(0,)).current()
    found = mapped(snapshot, grants("team-a", "train-0", (NVIDIA, GPU_0)))
    assert found.devices == {("gpu", 0)}


def test_volcano_real_chips_replace_the_kubelet_side_ids_once_the_pod_list_is_newer() -> None:
    snapshot = node_state().current()
    allocations = grants("team-a", "train-0", (ASCEND, "Ascend910-0"))
    seen = FirstSeen()
    seen.update([("team-a", "train-0")], 1000.0)
    pod = PodMeta("uid-1", "team-a", "train-0", {ASCEND_REAL_ANNOTATION: "Ascend910-2"})
    older = Pods(pod, fetched_at=999.0)
    found = mapped(snapshot, allocations, older, seen)
    assert found.reason is not None and found.reason.reason == POD_DEVICES_UNKNOWN.code
    assert older.asked == 1, "a newer pod list is asked for"
    found = mapped(snapshot, allocations, Pods(pod, fetched_at=1001.0), seen)
    assert found.devices == {("npu", 2)} and found.ids == ("Ascend910-2",)
    plain = PodMeta("uid-1", "team-a", "train-0")
    assert mapped(snapshot, allocations, Pods(plain, fetched_at=1001.0), seen).devices == {("npu", 0)}
    # Kubernetes off: no pod list, so Volcano's real chips can never be known: the ledger is of no use for them.
    off = mapped(snapshot, allocations, KUBERNETES_OFF, seen)
    assert off.reason is not None and off.reason.reason == LEDGER_UNAVAILABLE.code
    assert "Kubernetes is off" in off.reason.message
    # A GPU pod needs no pod list.
    assert mapped(snapshot, grants("team-a", "train-0", (NVIDIA, GPU_0)), KUBERNETES_OFF).devices == {("gpu", 0)}


def test_ids_no_result_names_are_unknown_and_claims_count_every_device() -> None:
    snapshot = node_state().current()
    stray = mapped(snapshot, grants("team-a", "train-0", (NVIDIA, "GPU-00000000-dead"), (NVIDIA, GPU_0)))
    assert stray.reason is not None and stray.reason.reason == POD_DEVICES_UNKNOWN.code
    assert "GPU-00000000-dead" in stray.reason.message
    chip = mapped(snapshot, grants("team-a", "train-0", (ASCEND, "Ascend910-5")), listed())
    assert chip.reason is not None and chip.reason.reason == POD_DEVICES_UNKNOWN.code
    claim = mapped(snapshot, grants("team-a", "train-0", ("gpu.nvidia.com", "gpu.nvidia.com/pool/gpu-0")))
    assert claim.known and claim.devices is None and "DRA claim" in claim.describe()
    cpu_only = mapped(snapshot, grants("team-a", "train-0", ("rdma/hca_shared_devices_a", "hca0")))
    assert cpu_only.known and cpu_only.devices == frozenset()
    assert cpu_only.describe() == "pod team-a/train-0 (no devices from the kubelet's ledger)"


def test_reads_that_cannot_vouch() -> None:
    now = 10_000.0  # monotonic
    assert read_problem(None, now)[0] == LEDGER_UNAVAILABLE  # type: ignore[index]
    failed = LedgerRead("unknown", "/s", code="UNAVAILABLE", why="the kubelet answered UNAVAILABLE", read_mono=now)
    problem = read_problem(failed, now)
    assert problem is not None and problem[0] == LEDGER_UNAVAILABLE and "UNAVAILABLE" in problem[1]
    missing = LedgerRead("skip", "/s", code="MISSING", why="no kubelet PodResources socket at /s")
    assert read_problem(missing, now)[0] == LEDGER_UNAVAILABLE  # type: ignore[index]
    ok = LedgerRead("ok", "/s", Ledger(), read_mono=now - MAX_LEDGER_AGE_SECONDS - 1)
    assert read_problem(ok, now)[0] == LEDGER_STALE  # type: ignore[index]
    assert read_problem(ok, now - 2) is None


def test_a_wall_clock_stepped_back_does_not_make_a_stale_read_fresh() -> None:
    """Read a minute ago by this host's monotonic clock, then NTP stepped the wall clock back 3 hours: by the
    wall clocks the read is from the future (fresh for 3 hours); it is a minute old, stale."""
    wall_then = time.time() + 3 * 3600 - 60
    read = LedgerRead("ok", "/s", Ledger(), read_at=wall_then, read_mono=time.monotonic() - 60)
    problem = read_problem(read, time.monotonic())
    assert problem is not None and problem[0] == LEDGER_STALE and "60s old" in problem[1]
    assert problem[2]["read_at"] == round(wall_then, 3), "the wall clock's stamp is what is shown"


@pytest.mark.parametrize(
    "text",
    [
        "team-a",
        "/train-0",
        "team-a/",
        "Team-A/x",
        "a/b/c",
        "a_b/c",
        "-a/b",
        "a/b..c",
        "a/" + "b" * 254,
        "a" * 64 + "/b",
    ],
)
def test_a_bad_pod_is_refused(text: str) -> None:
    with pytest.raises(BadQuery):
        parse_pod(text)


def test_good_pods_parse() -> None:
    assert parse_pod("team-a/train-0") == ("team-a", "train-0")
    assert parse_pod("a/web.example-1.b") == ("a", "web.example-1.b")
    assert parse_pod("a" * 63 + "/" + "b" * 253) == ("a" * 63, "b" * 253)


# --- over HTTP ------------------------------------------------------------------------------------------------


class HeldLedger(PodLedger):
    """The ledger's latest read as the test sets it; each read asked for counts, and brings the next of `upcoming`
    when there is one."""

    def __init__(self, read: LedgerRead | None, pods: Pods | None = None) -> None:
        super().__init__(lambda: "/unused", lambda: 1.0, lambda: pods)
        self.read = read
        self.upcoming: list[LedgerRead] = []
        self.hung = threading.Event()  # set: a read does not come back (a hung kubelet) until `release`
        self.release = threading.Event()

    def last(self) -> LedgerRead | None:
        return self.read

    def read_now(self) -> LedgerRead | None:
        if self.hung.is_set():
            self.release.wait(30)
        if self.upcoming:
            self.read = self.upcoming.pop(0)
        return self.read


def ledger_read(*allocations: Allocation, pods: tuple[tuple[str, str], ...] = (), age: float = 0.0) -> LedgerRead:
    listed = frozenset(pods) | {a.pod_key for a in allocations}
    return LedgerRead(
        "ok", "/unused", Ledger(tuple(allocations), listed), read_at=time.time() - age, read_mono=time.monotonic() - age
    )


@dataclass
class Served:
    state: HealthState
    ledger: HeldLedger
    port: int

    def get(self, path: str, accept: str = "") -> tuple[int, str]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        try:
            connection.request("GET", path, headers={"Accept": accept} if accept else {})
            response = connection.getresponse()
            return response.status, response.read().decode()
        finally:
            connection.close()

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        status, body = self.get(path)
        return status, json.loads(body)

    def reasons(self, path: str) -> list[tuple[str, str, str]]:
        return [(r["check"], r["subject"], r["reason"]) for r in self.answer(path)[1]["reasons"]]


@pytest.fixture
def served() -> Iterator[Served]:
    state = node_state(failing_npus=(0,))
    # Volcano's rule needs the pod list: every pod listed, the list newer than anything the ledger showed.
    pods = Pods(*(PodMeta(n, "team-a", n) for n in ("train-0", "held-0")), fetched_at=time.time() + 3600)
    read = ledger_read(
        *grants("team-a", "train-0", (ASCEND, "Ascend910-1")),
        *grants("team-a", "held-0", (ASCEND, "Ascend910-0")),
        *grants("team-b", "infer-0", (NVIDIA, GPU_0)),
        pods=(("team-c", "cpu-0"),),
    )
    ledger = HeldLedger(read, pods)
    server = HttpServer(
        state,
        MetricsRenderer(state.current).render,
        lambda: (True, {"problems": []}),
        lambda: CHECKS,
        address="127.0.0.1",
        port=0,
        max_wait=30.0,
        pod_ledger=ledger,
    )
    server.start()
    try:
        yield Served(state, ledger, server.port)
    finally:
        server.stop()


def test_a_pod_is_ready_when_its_chip_is_healthy_while_another_fails(served: Served) -> None:
    assert served.reasons("/ready") == [("npu.health", "npu0", "NpuAlarm")]
    status, body = served.answer("/ready?pod=team-a/train-0")
    assert status == 200 and body["reasons"] == []
    assert body["pod"] == {
        "namespace": "team-a",
        "name": "train-0",
        "devices_from": "ledger",
        "devices": [{"category": "npu", "device": 1}],
        "ledger_ids": ["Ascend910-1"],
    }
    # GPU 0 is not NPU 0: the GPU pod is ready too.
    assert served.answer("/ready?pod=team-b/infer-0")[0] == 200
    # A pod without devices: the node-wide checks only.
    assert served.answer("/ready?pod=team-c/cpu-0")[1]["pod"]["devices"] == []
    status, text = served.get("/ready?pod=team-a/train-0", accept="text/plain")
    assert (status, text) == (200, "ready on node-a for pod team-a/train-0 (npu1 from the kubelet's ledger)\n")


def test_a_pod_is_not_ready_when_its_own_chip_fails_or_the_node_does(served: Served) -> None:
    assert served.reasons("/ready?pod=team-a/held-0") == [("npu.health", "npu0", "NpuAlarm")]
    feed(served.state, failing_npus=(0,), disk=Status.FAIL)
    assert served.reasons("/ready?pod=team-a/train-0") == [("storage.space", "/data", "DiskFull")]
    feed(served.state, failing_npus=(1,), failing_gpus=(0,))
    assert served.reasons("/ready?pod=team-a/train-0") == [("npu.health", "npu1", "NpuAlarm")]
    assert served.reasons("/ready?pod=team-b/infer-0") == [("gpu.health", "gpu0", "GpuBroken")]
    assert served.reasons("/ready?pod=team-a/train-0&checks=storage") == []


def test_an_unknown_pod_is_503_with_the_reason_and_the_node_wide_ones(served: Served) -> None:
    feed(served.state, failing_npus=(0,), disk=Status.FAIL)
    status, body = served.answer("/ready?pod=team-a/nobody")
    assert status == 503 and body["ready"] is False
    assert [(r["check"], r["subject"], r["reason"], r["status"]) for r in body["reasons"]] == [
        ("ready.pod", "team-a/nobody", POD_NOT_IN_LEDGER.code, "unknown"),
        ("storage.space", "/data", "DiskFull", "fail"),
    ]
    assert body["pod"] == {"namespace": "team-a", "name": "nobody", "devices_from": None, "ledger": "PodNotInLedger"}
    status, text = served.get("/ready?pod=team-a/nobody&format=text")
    first, reason, *_ = text.splitlines()
    assert first == "not ready on node-a for pod team-a/nobody (its devices not known: PodNotInLedger): 2 reasons"
    assert reason.startswith("unknown ready.pod team-a/nobody PodNotInLedger: the kubelet's ledger (4 pods, read ")


def test_without_a_usable_ledger_devices_is_the_fallback(served: Served) -> None:
    for read, reason in (
        (None, LEDGER_UNAVAILABLE),
        (
            LedgerRead("unknown", "/s", code="TIMEOUT", why="no answer within 1s (kubelet hung?)", read_at=time.time()),
            LEDGER_UNAVAILABLE,
        ),
        (ledger_read(*grants("team-a", "train-0", (ASCEND, "Ascend910-1")), age=60), LEDGER_STALE),
    ):
        served.ledger.read = read
        assert served.reasons("/ready?pod=team-a/train-0") == [("ready.pod", "team-a/train-0", reason.code)]
        status, body = served.answer("/ready?pod=team-a/train-0&devices=1")
        assert status == 200 and body["pod"]["devices_from"] == "devices" and body["pod"]["ledger"] == reason.code
        assert served.reasons("/ready?pod=team-a/train-0&devices=0") == [("npu.health", "npu0", "NpuAlarm")]
    # devices= is only the fallback: with the ledger readable, the pod's own chip counts.
    served.ledger.read = ledger_read(*grants("team-a", "train-0", (ASCEND, "Ascend910-1")))
    assert served.answer("/ready?pod=team-a/train-0&devices=0")[1]["pod"]["devices_from"] == "ledger"
    assert served.answer("/ready?pod=team-a/train-0&devices=0")[0] == 200


def test_a_stale_read_stays_stale_after_the_wall_clock_steps_back(served: Served) -> None:
    read = ledger_read(*grants("team-a", "train-0", (ASCEND, "Ascend910-1")), age=60)
    served.ledger.read = replace(read, read_at=read.read_at + 3 * 3600)  # the wall clock was 3 h ahead then
    assert served.reasons("/ready?pod=team-a/train-0") == [("ready.pod", "team-a/train-0", LEDGER_STALE.code)]


def test_a_long_poll_sees_the_pod_arrive_in_the_ledger(served: Served) -> None:
    before = served.ledger.read
    assert before is not None and before.ledger is not None
    arrived = Allocation("team-d", "late-0", "main", NVIDIA, GPU_1)
    # The first read does not list the pod yet; the one a second later does.
    served.ledger.upcoming = [ledger_read(*before.ledger.allocations), ledger_read(*before.ledger.allocations, arrived)]
    assert served.reasons("/ready?pod=team-d/late-0") == [("ready.pod", "team-d/late-0", "PodNotInLedger")]
    started = time.monotonic()
    status, body = served.answer("/ready?pod=team-d/late-0&wait=10")
    assert status == 200 and body["pod"]["devices"] == [{"category": "gpu", "device": 1}]
    assert served.ledger.refreshes == 2 and time.monotonic() - started < 8


def test_at_most_one_ledger_read_a_second_however_many_ask(served: Served) -> None:
    started = time.monotonic()
    for _ in range(40):
        assert served.answer("/ready?pod=team-a/train-0")[0] == 200
    elapsed = time.monotonic() - started
    assert 1 <= served.ledger.refreshes <= 2 + elapsed
    # After a failed read, one every 5 s.
    served.ledger.read = LedgerRead("unknown", "/s", code="UNAVAILABLE", why="restarting", read_at=time.time())
    time.sleep(1.1)
    before = served.ledger.refreshes
    for _ in range(20):
        served.answer("/ready?pod=team-a/train-0")
    assert served.ledger.refreshes - before <= 1


def test_a_read_that_hangs_never_makes_the_answer_late(served: Served) -> None:
    """A pre-flight that gets no answer in time may fail open: the answer comes within LEDGER_WAIT_SECONDS."""
    served.ledger.hung.set()
    try:
        for read, expected in (
            (served.ledger.read, 200),  # judged by the last read, recent enough
            (ledger_read(*grants("team-a", "train-0", (ASCEND, "Ascend910-1")), age=60), 503),  # LedgerStale
        ):
            served.ledger.read = read
            time.sleep(1.1)  # a read is due again
            started = time.monotonic()
            status, body = served.answer("/ready?pod=team-a/train-0")
            assert status == expected, body
            assert time.monotonic() - started < LEDGER_WAIT_SECONDS + 1.0
        assert [r["reason"] for r in body["reasons"]] == [LEDGER_STALE.code]
    finally:
        served.ledger.release.set()


@pytest.mark.parametrize("pod", ["team-a", "Team-A/x", "a/b/c", "%2e%2e/x", "a/" + "b" * 300])
def test_a_bad_pod_is_a_400_naming_it(served: Served, pod: str) -> None:
    status, body = served.answer(f"/ready?pod={pod}")
    assert status == 400 and body["error"].startswith("pod=") and len(body["error"]) < 300
    assert served.ledger.refreshes == 0, "nothing is read for a malformed question"


def test_without_a_ledger_the_server_says_so(served: Served) -> None:
    state = node_state()
    server = HttpServer(state, lambda: b"", lambda: (True, {}), lambda: CHECKS, address="127.0.0.1", port=0)
    server.start()
    try:
        plain = Served(state, served.ledger, server.port)
        assert plain.reasons("/ready?pod=team-a/train-0") == [("ready.pod", "team-a/train-0", "LedgerUnavailable")]
    finally:
        server.stop()


@pytest.mark.parametrize("device_id", ["²", "Ascend910-²", "Ascend910-٣", "GPU-0::²", "٣"])
def test_a_non_ascii_digit_id_is_pod_devices_unknown_never_a_500(served: Served, device_id: str) -> None:
    """Field failure: `²` passed str.isdigit() and int() raised: 500, and a fail-open pre-flight started the job
    unchecked. ASCII digits only: an id that maps nowhere is PodDevicesUnknown (503)."""
    resource = ASCEND if device_id.startswith("Ascend") else NVIDIA
    served.ledger.read = ledger_read(*grants("team-a", "train-0", (resource, device_id)))  # listed: not Volcano's
    status, body = served.answer("/ready?pod=team-a/train-0")
    assert status == 503, body
    odd = next(r for r in body["reasons"] if r["check"] == "ready.pod")
    assert (odd["subject"], odd["reason"]) == ("team-a/train-0", POD_DEVICES_UNKNOWN.code)
    assert "which no npu or gpu result of this node names" in odd["message"], odd
