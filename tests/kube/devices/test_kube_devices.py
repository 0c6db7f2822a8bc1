"""Device isolation through DRA DeviceTaintRules, by the real reconciler on the API double (real client, HTTP)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from support.kube_devices import (
    ASCEND,
    CHIPS,
    GPUS,
    NVIDIA,
    nvidia_devices,
    publish_gpus,
    publish_npus,
    record_gpus,
    record_npus,
)
from support.kube_double import ApiDouble
from support.kube_dra import add_resource_slice
from support.kube_helpers import Clock, conditions, health_state, make_agent, our_taints, record

from agent.kube.client import KubeApi, PartialDeviceSelector
from agent.kube.devices import acting
from agent.kube.devices.match import rule_name

PROBES = {"gpu": ("gpu.holders",), "npu": ("npu.holders",), "storage": ("storage.mounts",)}
GPU3_RULE = rule_name("node-health", "gpu", "n1", NVIDIA, "gpu-5")  # GPU index 3 is /dev/nvidia5


def rules(double: ApiDouble) -> dict[str, dict[str, Any]]:
    return {r["metadata"]["name"]: r for r in double.device_taint_rules()}


def isolated(node: dict[str, Any]) -> list[dict[str, Any]]:
    return list(json.loads((node["metadata"].get("annotations") or {}).get("node-health/isolated-devices", "[]")))


def setup(double: ApiDouble, release: str = "1.37", **kube: Any) -> tuple[Any, Any, Clock]:
    clock = Clock()
    double.serve_dra(release)
    double.add_node("n1")
    publish_gpus(double, "n1")
    publish_npus(double, "n1")
    state = health_state("n1", clock, PROBES)
    agent = make_agent(double, state, clock, max_unhealthy="100%", max_unhealthy_devices="100%", **kube)
    record(state, "storage", "storage.mounts", "ok")
    record_npus(state)
    return state, agent, clock


@pytest.mark.system
@pytest.mark.parametrize("release", ["1.37", "1.36"])
def test_one_bad_gpu_gets_one_rule_and_no_node_taint(double: ApiDouble, release: str) -> None:
    state, agent, _clock = setup(double, release)
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    agent.reconcile_once()

    stored = rules(double)
    assert list(stored) == [GPU3_RULE], "exactly one rule, for the GPU the finding is about"
    rule = stored[GPU3_RULE]
    version = "v1" if release == "1.37" else "v1beta2"
    assert rule["apiVersion"] == f"resource.k8s.io/{version}"
    assert rule["spec"]["deviceSelector"] == {"driver": NVIDIA, "pool": "n1", "device": "gpu-5"}
    assert {k: v for k, v in rule["spec"]["taint"].items() if k != "timeAdded"} == {
        "key": "node-health/gpu",
        "value": "GpuHeldOutOfBand",
        "effect": "NoSchedule",
    }
    assert rule["spec"]["taint"]["timeAdded"], "set by the server"
    assert rule["metadata"]["labels"] == {
        "app.kubernetes.io/name": "node-health",
        "app.kubernetes.io/component": "device-taint",
        "node-health/node": "n1",
        "node-health/category": "gpu",
    }
    creates = [w for w in double.writes if w.method == "POST" and "devicetaintrules" in w.path]
    assert len(creates) == 1 and creates[0].status == 201

    node = double.node("n1")
    assert "gpu" not in our_taints(node), "the other seven GPUs stay schedulable"
    condition = conditions(node)["GPUHealthy"]
    assert condition["status"] == "False" and condition["reason"] == "GpuHeldOutOfBand"
    assert f"gpu3 isolated by DeviceTaintRule {GPU3_RULE} (NoSchedule)" in condition["message"]
    assert isolated(node) == [
        {
            "device": "gpu3",
            "category": "gpu",
            "reason": "GpuHeldOutOfBand",
            "mechanism": "dra",
            "effect": "NoSchedule",
            "rules": [GPU3_RULE],
        }
    ]
    assert agent.status()["devices"]["isolated"][0]["mechanism"] == "dra"


@pytest.mark.system
def test_reason_change_updates_the_rule_and_recovery_deletes_it(double: ApiDouble) -> None:
    state, agent, clock = setup(double)
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    agent.reconcile_once()
    added = rules(double)[GPU3_RULE]["spec"]["taint"]["timeAdded"]

    clock.advance(30)
    record_gpus(state, {3: "GpuSharedByPods"})
    agent.reconcile_once()
    rule = rules(double)[GPU3_RULE]
    assert rule["spec"]["taint"]["value"] == "GpuSharedByPods"
    assert rule["spec"]["taint"]["timeAdded"] == added, "the effect did not change"
    assert rule["metadata"]["generation"] == 2
    patches = [w for w in double.writes if w.method == "PATCH" and "devicetaintrules" in w.path]
    assert len(patches) == 1 and patches[0].content_type == "application/merge-patch+json"
    assert patches[0].body["metadata"]["resourceVersion"], "guarded by the rule's resourceVersion"

    clock.advance(30)
    before = len(double.writes)
    agent.reconcile_once()
    assert len(double.writes) == before, "nothing changed: nothing written"

    clock.advance(30)
    record_gpus(state)
    agent.reconcile_once()
    assert rules(double) == {}
    node = double.node("n1")
    assert conditions(node)["GPUHealthy"]["status"] == "True"
    assert "node-health/isolated-devices" not in (node["metadata"].get("annotations") or {})
    deletes = [w for w in double.writes if w.method == "DELETE"]
    # The controller's status write made the held resourceVersion stale: the 409 is read again and retried at once.
    assert [w.status for w in deletes] == [409, 200] and deletes[1].body["preconditions"]["resourceVersion"]


@pytest.mark.system
def test_one_bad_npu_on_an_ascend_slice_is_matched_by_physical_id(double: ApiDouble) -> None:
    state, agent, _clock = setup(double)
    record_gpus(state)
    record_npus(state, {2: "NpuHeldOutOfBand"})
    agent.reconcile_once()
    chip = CHIPS[2]
    name = rule_name("node-health", "npu", "n1", ASCEND, f"ascend910-{chip.physical_id}")
    assert list(rules(double)) == [name]
    assert rules(double)[name]["spec"]["deviceSelector"]["device"] == "ascend910-6"
    node = double.node("n1")
    assert our_taints(node) == {}
    assert f"npu2 isolated by DeviceTaintRule {name}" in conditions(node)["NPUHealthy"]["message"]


@pytest.mark.system
def test_without_dra_the_node_is_tainted_as_today(double: ApiDouble) -> None:
    state, agent, _clock = setup(double, "none")
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    agent.reconcile_once()
    node = double.node("n1")
    assert our_taints(node) == {"gpu": ("GpuHeldOutOfBand", "NoSchedule")}
    assert rules(double) == {}
    message = conditions(node)["GPUHealthy"]["message"]
    assert "gpu3 falls back to the node taint: the cluster serves no resource.k8s.io (no DRA)" in message
    assert isolated(node)[0]["mechanism"] == "node"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in agent.samples()}
    assert samples[("nodehealth_devices_isolated", (("mechanism", "node"),))] == 1.0
    assert samples[("nodehealth_devices_isolated", (("mechanism", "dra"),))] == 0.0


@pytest.mark.system
def test_dra_without_taint_rules_falls_back_and_says_why(double: ApiDouble, monkeypatch: pytest.MonkeyPatch) -> None:
    """1.36 with DRADeviceTaintRules off serves the rules and ignores them: no controller ever writes a rule's
    status, so the rule is not counted as an isolation; the device is on the node taint and the rule stays (made
    and deleted on every pass, it could never be seen acted on)."""
    monkeypatch.setattr(acting, "CONFIRM_SECONDS", 1.0)
    state, agent, clock = setup(double, "1.36-no-taint-rules")
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    agent.reconcile_once()
    node = double.node("n1")
    assert our_taints(node) == {"gpu": ("GpuHeldOutOfBand", "NoSchedule")}
    assert "does not act on DeviceTaintRules" in conditions(node)["GPUHealthy"]["message"]
    assert isolated(node)[0]["mechanism"] == "node"
    assert list(rules(double)) == [GPU3_RULE]
    assert "does not act" in agent.status()["devices"]["isolated"][0]["why"]
    labels = {s.labels.get("why") for s in agent.samples() if s.name == "nodehealth_device_isolation"}
    assert labels == {"not_acted"}
    clock.advance(30)
    before = len(double.writes)
    agent.reconcile_once()
    assert [(w.method, w.path) for w in double.writes[before:]] == [], "judged once: no rewrite on the next pass"


@pytest.mark.system
def test_an_unmappable_device_gets_the_node_taint_and_the_fallback_is_reported(double: ApiDouble) -> None:
    clock = Clock()
    double.serve_dra("1.37")
    double.add_node("n1")
    publish_gpus(double, "n1", GPUS[:3])  # the slice lists gpu0..gpu2 only
    state = health_state("n1", clock, PROBES)
    agent = make_agent(double, state, clock, max_unhealthy="100%")
    record(state, "storage", "storage.mounts", "ok")
    record_npus(state)
    record_gpus(state, {1: "GpuHeldOutOfBand", 6: "GpuHeldOutOfBand"})
    agent.reconcile_once()
    node = double.node("n1")
    assert list(rules(double)) == [rule_name("node-health", "gpu", "n1", NVIDIA, "gpu-1")]
    assert our_taints(node) == {"gpu": ("GpuHeldOutOfBand", "NoSchedule")}, "gpu6 is on no slice: the node"
    message = conditions(node)["GPUHealthy"]["message"]
    assert "gpu6 falls back to the node taint: gpu6 is not published in a ResourceSlice of this node" in message
    by_device = {entry["device"]: entry for entry in agent.status()["devices"]["isolated"]}
    assert by_device["gpu6"]["mechanism"] == "node" and by_device["gpu1"]["mechanism"] == "dra"
    metric = [s for s in agent.samples() if s.name == "nodehealth_device_isolation" and s.labels["device"] == "gpu6"]
    assert metric[0].labels["why"] == "not_published"


@pytest.mark.system
def test_storage_failing_at_the_same_time_still_taints_the_node(double: ApiDouble) -> None:
    state, agent, _clock = setup(double)
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    record(state, "storage", "storage.mounts", "fail", "MountMissing")
    agent.reconcile_once()
    node = double.node("n1")
    assert our_taints(node) == {"storage": ("MountMissing", "NoSchedule")}
    assert list(rules(double)) == [GPU3_RULE]


@pytest.mark.system
def test_a_device_published_outside_its_node_pool_is_not_tainted(double: ApiDouble) -> None:
    clock = Clock()
    double.serve_dra("1.37")
    double.add_node("n1")
    add_resource_slice(double, "n1-gpus", "n1", NVIDIA, nvidia_devices(), pool="shared-pool")
    state = health_state("n1", clock, PROBES)
    agent = make_agent(double, state, clock, max_unhealthy="100%")
    record(state, "storage", "storage.mounts", "ok")
    record_npus(state)
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    agent.reconcile_once()
    assert rules(double) == {}
    assert our_taints(double.node("n1")) == {"gpu": ("GpuHeldOutOfBand", "NoSchedule")}
    assert "pool 'shared-pool' is not the node's name" in agent.status()["devices"]["slice_notes"][0]


def test_a_partial_selector_is_refused_before_it_is_sent() -> None:
    """An empty or partial deviceSelector matches every device of the cluster: the client never sends one."""
    calls: list[str] = []

    class NoClient:
        def param_serialize(self, **kwargs: Any) -> Any:
            calls.append(kwargs["resource_path"])
            raise AssertionError("sent")

    api = KubeApi(lambda: NoClient(), 1.0)  # type: ignore[arg-type,return-value]
    taint = {"key": "node-health/gpu", "value": "X", "effect": "NoSchedule"}
    for selector in (
        {},
        {"driver": NVIDIA},
        {"driver": NVIDIA, "pool": "n1"},
        {"driver": NVIDIA, "pool": "n1", "device": ""},
        {"driver": NVIDIA, "pool": "n1", "device": "gpu-3", "deviceClassName": "gpu.nvidia.com"},
        None,
    ):
        spec: dict[str, Any] = {"taint": taint}
        if selector is not None:
            spec["deviceSelector"] = selector
        body = {"metadata": {"name": "r"}, "spec": spec}
        with pytest.raises(PartialDeviceSelector):
            api.create_device_taint_rule("v1", body)
        with pytest.raises(PartialDeviceSelector):
            api.patch_device_taint_rule("v1", "r", body)
    assert calls == []


# --- lifecycle ---------------------------------------------------------------------------------------------------


@pytest.mark.system
def test_a_restart_or_stale_results_keep_the_rule_until_fresh_results_decide(double: ApiDouble) -> None:
    state, agent, clock = setup(double)
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    agent.reconcile_once()
    assert list(rules(double)) == [GPU3_RULE]

    restarted = health_state("n1", clock, PROBES)  # a new run: every check WarmingUp
    again = make_agent(double, restarted, clock, max_unhealthy="100%", max_unhealthy_devices="100%")
    again.reconcile_once()
    assert list(rules(double)) == [GPU3_RULE], "kept while the gpu checks have no result"
    assert "gpu" not in our_taints(double.node("n1"))

    clock.advance(200)  # the first run's results are now stale
    agent.reconcile_once()
    assert list(rules(double)) == [GPU3_RULE], "kept while the results are stale"

    record(restarted, "storage", "storage.mounts", "ok")
    record_npus(restarted)
    record_gpus(restarted)
    again.reconcile_once()
    assert rules(double) == {}, "fresh results: recovered"


@pytest.mark.system
def test_a_device_that_disappears_goes_to_the_node_taint_and_its_rule_is_collected(double: ApiDouble) -> None:
    state, agent, clock = setup(double)
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    agent.reconcile_once()
    gone = [d for d in nvidia_devices() if d["name"] != "gpu-5"]
    double.mutate("resourceslices", "", "n1-gpu.nvidia.com-x7k2p", lambda s: s["spec"].update({"devices": gone}))
    clock.advance(700)  # past dra_recheck_seconds: the slices are read again
    record(state, "storage", "storage.mounts", "ok")
    record_npus(state)
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    order: list[str] = []
    double.before_write = lambda method, path: order.append(f"{method} {path}")
    agent.reconcile_once()
    assert rules(double) == {}
    assert our_taints(double.node("n1")) == {"gpu": ("GpuHeldOutOfBand", "NoSchedule")}
    node_patch = order.index("PATCH /api/v1/nodes/n1")
    rule_delete = next(i for i, w in enumerate(order) if w.startswith("DELETE"))
    assert node_patch < rule_delete, "the node taint is on before the rule goes: never neither"


@pytest.mark.system
@pytest.mark.parametrize(
    "change",
    [{"disabled_reasons": ["GpuHeldOutOfBand"]}, {"disabled_checks": ["gpu.holders"]}, {"device_isolation": False}],
)
def test_the_config_no_longer_producing_a_rule_collects_it(double: ApiDouble, change: dict[str, Any]) -> None:
    from support.kube_helpers import kube_config

    state, agent, _clock = setup(double)
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    agent.reconcile_once()
    assert list(rules(double)) == [GPU3_RULE]
    agent.reconfigure(kube_config(max_unhealthy="100%", max_unhealthy_devices="100%", **change))
    agent.reconcile_once()
    assert rules(double) == {}
    tainted = our_taints(double.node("n1"))
    assert tainted == ({"gpu": ("GpuHeldOutOfBand", "NoSchedule")} if "device_isolation" in change else {})


@pytest.mark.system
def test_a_foreign_rule_of_the_same_name_is_left_alone_and_the_node_is_tainted(double: ApiDouble) -> None:
    state, agent, _clock = setup(double)
    foreign = {
        "metadata": {"name": GPU3_RULE, "labels": {"team": "ml"}},
        "spec": {
            "deviceSelector": {"driver": NVIDIA, "pool": "n1", "device": "gpu-5"},
            "taint": {"key": "team/maintenance", "effect": "NoSchedule"},
        },
    }
    double.create("devicetaintrules", "", foreign, api_version="resource.k8s.io/v1")
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    agent.reconcile_once()
    assert rules(double)[GPU3_RULE]["spec"]["taint"]["key"] == "team/maintenance", "untouched"
    node = double.node("n1")
    assert our_taints(node) == {"gpu": ("GpuHeldOutOfBand", "NoSchedule")}
    assert "exists and is not ours" in conditions(node)["GPUHealthy"]["message"]


@pytest.mark.system
def test_rules_refused_by_the_api_fall_back_to_the_node_taint(double: ApiDouble) -> None:
    state, agent, _clock = setup(double)
    double.inject(path="devicetaintrules$", method="POST", status=403, times=-1)
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    agent.reconcile_once()
    node = double.node("n1")
    assert our_taints(node) == {"gpu": ("GpuHeldOutOfBand", "NoSchedule")}, "fail closed"
    assert agent.status()["devices"]["errors"] == {"forbidden": 1}
    assert agent.status()["errors"] == {}, "the pass itself succeeded"
    assert agent.status()["devices"]["isolated"][0]["why"].startswith("DeviceTaintRule not written: HTTP 403")


@pytest.mark.system
def test_a_warning_is_an_informational_rule_and_noexecute_needs_allowing(double: ApiDouble) -> None:
    state, agent, _clock = setup(double, allow_noexecute=True, effects={"GpuEccUncorrectable": "NoExecute"})
    from support.kube_devices import GPUS, gpu_finding

    findings = [gpu_finding(g, "gpu.holders") for g in GPUS]
    findings[1] = gpu_finding(GPUS[1], "gpu.holders", "warn", "GpuHeldOutOfBand")
    findings[2] = gpu_finding(GPUS[2], "gpu.holders", "fail", "GpuEccUncorrectable")
    state.record("gpu", findings)
    agent.reconcile_once()
    effects = {r["spec"]["deviceSelector"]["device"]: r["spec"]["taint"]["effect"] for r in rules(double).values()}
    assert effects == {"gpu-1": "None", "gpu-2": "NoExecute"}
    assert our_taints(double.node("n1")) == {}


@pytest.mark.system
def test_dry_run_writes_no_rule(double: ApiDouble) -> None:
    state, agent, _clock = setup(double, dry_run=True)
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    agent.reconcile_once()
    assert rules(double) == {}
    assert [w for w in double.writes if "devicetaintrules" in w.path] == []
    would = agent.status()["devices"]["would_write"]
    assert {w["kind"] for w in would} == {"device_budget", "device_rule"}
    assert any(GPU3_RULE in w["what"] for w in would)


# --- device-plugin clusters: the fallback --------------------------------------------------------------------


@pytest.mark.system
@pytest.mark.parametrize(
    "mode,bad,taint",
    [
        ("node", {3: "GpuHeldOutOfBand"}, ("GpuHeldOutOfBand", "NoSchedule")),
        ("prefer", {3: "GpuHeldOutOfBand"}, ("GpuHeldOutOfBand", "PreferNoSchedule")),
        ("prefer", dict.fromkeys(range(4), "GpuHeldOutOfBand"), ("GpuHeldOutOfBand", "NoSchedule")),
        ("none", {3: "GpuHeldOutOfBand"}, None),
    ],
)
def test_device_fallback_modes(double: ApiDouble, mode: str, bad: dict[int, str], taint: Any) -> None:
    state, agent, _clock = setup(double, "none", device_fallback=mode)
    record_gpus(state, bad)
    agent.reconcile_once()
    node = double.node("n1")
    assert our_taints(node).get("gpu") == taint
    entries = isolated(node)
    assert {e["device"] for e in entries} == {f"gpu{i}" for i in bad}, "the annotation in every mode"
    assert {e["mechanism"] for e in entries} == {mode}
    if mode == "none":
        assert "the pre-flight turns jobs away" in conditions(node)["GPUHealthy"]["message"]


@pytest.mark.system
def test_status_and_metrics_do_not_wait_for_a_slow_device_api(double: ApiDouble) -> None:
    import threading
    import time

    state, agent, _ = setup(double)
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    double.inject(path="/resourceslices$", method="GET", delay=3.0)
    reconciling = threading.Thread(target=agent.reconcile_once)
    reconciling.start()
    while not any(r.endswith("/resourceslices") for _, r in double.requests):
        time.sleep(0.01)  # until the pass waits on the slow slice list
    status, samples = agent.status(), agent.samples()
    assert reconciling.is_alive(), "answered while the pass still waits for the API"
    assert status["devices"]["isolated"] == [] and samples
    reconciling.join()
    assert list(rules(double)) == [GPU3_RULE]


@pytest.mark.system
def test_a_rule_deleted_by_hand_is_made_again_after_the_recheck_by_name(double: ApiDouble) -> None:
    state, agent, clock = setup(double)
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    agent.reconcile_once()
    double.delete("devicetaintrules", "", GPU3_RULE)
    clock.advance(700)  # past dra_recheck_seconds
    record(state, "storage", "storage.mounts", "ok")
    record_npus(state)
    record_gpus(state, {3: "GpuHeldOutOfBand"})
    start = len(double.log)
    agent.reconcile_once()
    assert list(rules(double)) == [GPU3_RULE], "made again"
    checks = [r for r in double.log[start:] if "devicetaintrules" in r.path and r.method == "GET"]
    assert [r.path.rsplit("/", 1)[-1] for r in checks] == [GPU3_RULE], "read back by name, not a list of every rule"


@pytest.mark.system
def test_a_gpu_with_a_mig_device_published_apart_gets_a_rule_for_each(double: ApiDouble) -> None:
    from support.kube_devices import gpu_finding

    clock = Clock()
    double.serve_dra("1.37")
    double.add_node("n1")
    gpu = GPUS[3]
    mig = "MIG-0a1b2c3d-0000-5555-6666-777788889999"
    devices = [
        *nvidia_devices(GPUS[:3]),
        {"name": "gpu-5", "attributes": {"uuid": {"string": gpu.uuid}}},
        {"name": "gpu-5-mig-1g10gb-0", "attributes": {"uuid": {"string": mig}, "parentUUID": {"string": gpu.uuid}}},
    ]
    add_resource_slice(double, "n1-gpus", "n1", NVIDIA, devices)
    state = health_state("n1", clock, PROBES)
    agent = make_agent(double, state, clock, max_unhealthy_devices="100%")
    record(state, "storage", "storage.mounts", "ok")
    record_npus(state)
    held = gpu_finding(gpu, "gpu.holders", "fail", "GpuHeldOutOfBand")
    held = type(held)(**{**held.__dict__, "observed": {**held.observed, "device_ids": [gpu.uuid, mig]}})
    state.record("gpu", [held])
    agent.reconcile_once()
    selected = sorted(r["spec"]["deviceSelector"]["device"] for r in rules(double).values())
    assert selected == ["gpu-5", "gpu-5-mig-1g10gb-0"]
    assert "gpu" not in our_taints(double.node("n1"))
