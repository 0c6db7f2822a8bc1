"""The planner on its own: hand-built snapshots and Node objects in, the patch to send out (no API)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from support.kube_helpers import finding, kube_config, node_object, snapshot_of, warming
from support.kube_semantics import strategic_merge

from agent.config import ConfigError, parse_config
from agent.kube.node.plan import Plan, SlotView, plan, plan_cleanup
from agent.reasons import PROBE_TIMEOUT, STALE
from probes.base import Event

POLICY = kube_config().kubernetes
NOW = 1_800_000_000.0
STAMP = "2027-01-15T08:00:00Z"
FOREIGN = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
FOREIGN_SOFT = {"key": "dedicated", "value": "infer", "effect": "PreferNoSchedule"}
FOREIGN_CONDITION = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting"}


def ours(category: str, reason: str, effect: str = "NoSchedule") -> dict[str, str]:
    return {"key": f"node-health/{category}", "value": reason, "effect": effect}


def items(p: Plan) -> dict[str, dict[str, Any]]:
    return {i["type"]: i for i in (p.status_patch or {}).get("status", {}).get("conditions", [])}


def test_healthy_node_gets_the_ready_label_and_true_conditions() -> None:
    snapshot = snapshot_of(finding("storage.mounts"), finding("time.sync"))
    p = plan(snapshot, node_object(labels={"team": "ml"}), POLICY, now=NOW, slot=SlotView("free"))
    assert p.node_patch == {"metadata": {"resourceVersion": "7", "labels": {"node-health/ready": "true"}}}
    assert p.slot_request == "" and not p.release and not p.blocking
    conditions = items(p)
    assert set(conditions) == {"StorageHealthy", "ClockSynced"}, "categories without checks get no condition"
    assert conditions["StorageHealthy"] == {
        "type": "StorageHealthy",
        "status": "True",
        "reason": "Healthy",
        "message": "1 of 1 checks passed",
        "lastHeartbeatTime": STAMP,
        "lastTransitionTime": STAMP,
    }
    assert p.events == (), "a condition appearing True is not news"


def test_a_first_blocking_taint_waits_for_a_slot_and_keeps_foreign_taints_in_place() -> None:
    node = node_object(taints=[FOREIGN, FOREIGN_SOFT], conditions=[FOREIGN_CONDITION])
    snapshot = snapshot_of(finding("storage.mounts", "fail", "MountMissing", "/data is not mounted"))
    asking = plan(snapshot, node, POLICY, now=NOW, slot=SlotView("free"))
    assert asking.slot_request == "acquire"
    assert asking.node_patch is None and asking.status_patch is None, "nothing is written before the slot"
    assert asking.blocking_taints == "storage=MountMissing"

    p = plan(snapshot, node, POLICY, now=NOW, slot=SlotView("held"))
    assert p.node_patch == {
        "metadata": {
            "resourceVersion": "7",
            "labels": {"node-health/ready": "false", "node-health/tainted": "true"},
        },
        "spec": {"taints": [FOREIGN, FOREIGN_SOFT, ours("storage", "MountMissing")]},
    }
    assert p.blocking and not p.release
    condition = items(p)["StorageHealthy"]
    assert (condition["status"], condition["reason"]) == ("False", "MountMissing")
    assert condition["message"] == "fail: MountMissing (storage.mounts) — storage.mounts: /data is not mounted"
    assert "Ready" not in items(p), "a foreign condition is never in a plan"
    assert [(e.reason, e.warning) for e in p.events] == [("MountMissing", True)]


def test_own_taint_goes_when_the_problem_clears_and_the_slot_with_it() -> None:
    node = node_object(
        taints=[ours("storage", "MountMissing"), FOREIGN],
        labels={"node-health/ready": "false", "node-health/tainted": "true", "team": "ml"},
    )
    p = plan(snapshot_of(finding("storage.mounts")), node, POLICY, now=NOW, slot=SlotView("held"))
    assert p.node_patch == {
        "metadata": {"resourceVersion": "7", "labels": {"node-health/ready": "true", "node-health/tainted": None}},
        "spec": {"taints": [FOREIGN]},
    }
    assert p.release and not p.blocking
    assert p.node_change == "-taint node-health/storage=MountMissing:NoSchedule, label node-health/ready=true, " + (
        "-label node-health/tainted"
    )


def test_a_refused_slot_withholds_the_taint_and_the_condition_says_why() -> None:
    snapshot = snapshot_of(finding("network.dns", "fail", "DnsFailed", "no answer from 10.0.0.10"))
    p = plan(snapshot, node_object(taints=[FOREIGN]), POLICY, now=NOW, slot=SlotView("denied", 10, 10))
    assert p.suppressed == {"network": "DnsFailed"}
    assert p.node_patch == {"metadata": {"resourceVersion": "7", "labels": {"node-health/ready": "false"}}}
    condition = items(p)["NetworkHealthy"]
    assert (condition["status"], condition["reason"]) == ("False", "DnsFailed"), "False carries the failing reason"
    assert condition["message"] == (
        "taint node-health/network=DnsFailed withheld: the cluster taint budget is spent; fail: DnsFailed "
        "(network.dns) — 10 of 10 slots taken; network.dns: no answer from 10.0.0.10"
    )
    assert [e.reason for e in p.events] == ["TaintSuppressedByBudget"]
    assert not p.release, "a refused node holds no slot"


def test_a_previous_runs_taint_stays_and_registers_its_slot() -> None:
    node = node_object(taints=[ours("storage", "MountMissing")], labels={"node-health/ready": "false"})
    snapshot = snapshot_of(finding("storage.mounts", "fail", "MountMissing"))
    p = plan(snapshot, node, POLICY, now=NOW, slot=SlotView("unknown"))
    assert p.slot_request == "register"
    assert p.node_patch == {"metadata": {"resourceVersion": "7", "labels": {"node-health/tainted": "true"}}}


def test_no_fresh_result_holds_taints_conditions_and_the_label() -> None:
    old = {
        "type": "StorageHealthy",
        "status": "False",
        "reason": "MountMissing",
        "message": "fail: MountMissing (storage.mounts)",
        "lastTransitionTime": "2027-01-01T00:00:00Z",
    }
    node = node_object(
        taints=[ours("storage", "MountMissing")],
        labels={"node-health/ready": "false", "node-health/tainted": "true"},
        conditions=[old],
    )
    p = plan(snapshot_of(warming("storage.mounts")), node, POLICY, now=NOW, slot=SlotView("unknown"))
    assert p.node_patch is None and p.status_patch is None
    assert p.blocking and not p.release
    stale = snapshot_of(finding("storage.mounts", "unknown", STALE.code, "result is 200 s old"))
    p = plan(stale, node, POLICY, now=NOW, slot=SlotView("held"))
    assert p.node_patch is None, "a stale result keeps the taint"
    assert (items(p)["StorageHealthy"]["status"], items(p)["StorageHealthy"]["reason"]) == ("Unknown", STALE.code)

    fresh_node = node_object()
    p = plan(snapshot_of(warming("storage.mounts")), fresh_node, POLICY, now=NOW, slot=SlotView("unknown"))
    assert (items(p)["StorageHealthy"]["status"], items(p)["StorageHealthy"]["reason"]) == ("Unknown", "WarmingUp")
    assert p.events == ()


@pytest.mark.parametrize(
    ("findings", "status", "reason", "message"),
    [
        (
            [finding("time.sync", "warn", "ClockUnsynced", "offset 2.1 s")],
            "True",
            "Healthy",
            "warn: ClockUnsynced (time.sync); 1 of 1 checks passed — time.sync: offset 2.1 s",
        ),
        (
            [finding("time.sync", "fail", "ClockSkew", "skew 9 s"), finding("time.ntp", "warn", "NtpSlow", "slow")],
            "False",
            "ClockSkew",
            "fail: ClockSkew (time.sync); warn: NtpSlow (time.ntp) — time.sync: skew 9 s",
        ),
        (
            [finding("time.sync", "unknown", PROBE_TIMEOUT.code, "chronyc hung")],
            "Unknown",
            PROBE_TIMEOUT.code,
            "unknown: ProbeTimeout (time.sync) — time.sync: chronyc hung",
        ),
        (
            [finding("time.sync", "fail", "Muted", "x"), finding("time.ntp")],
            "True",
            "Healthy",
            "1 of 2 checks passed — disabled by kubernetes.disabled_reasons: time.sync: Muted: x",
        ),
    ],
    ids=["warn", "fail-and-warn", "timeout", "disabled"],
)
def test_conditions_read_right(findings: list[Any], status: str, reason: str, message: str) -> None:
    policy = kube_config(disabled_reasons=["Muted"]).kubernetes
    p = plan(snapshot_of(*findings), node_object(), policy, now=NOW, slot=SlotView("held"))
    condition = items(p)["ClockSynced"]
    assert (condition["status"], condition["reason"], condition["message"]) == (status, reason, message)


def test_the_strongest_effect_names_the_taint_and_noexecute_needs_allowing() -> None:
    for key, value in (("default_effect", "NoExecute"), ("effects", {"NpuHealthCritical": "NoExecute"})):
        with pytest.raises(ConfigError, match=rf"config key kubernetes\.{key}: .*kubernetes\.allow_noexecute: true"):
            parse_config({"kubernetes": {key: value}})
    policy = kube_config(allow_noexecute=True, effects={"NpuHealthCritical": "NoExecute"}).kubernetes
    snapshot = snapshot_of(
        finding("npu.health", "fail", "NpuHealthAlarm", subject="0"),
        finding("npu.health", "fail", "NpuHealthCritical", subject="1"),
    )
    p = plan(snapshot, node_object(), policy, now=NOW, slot=SlotView("held"))
    assert p.node_patch is not None
    assert p.node_patch["spec"]["taints"] == [ours("npu", "NpuHealthCritical", "NoExecute")]
    assert items(p)["NPUHealthy"]["reason"] == "NpuHealthCritical", "the worst: the strongest effect"
    assert items(p)["NPUHealthy"]["message"].startswith("fail: NpuHealthCritical (npu.health), NpuHealthAlarm")
    default = plan(snapshot, node_object(), POLICY, now=NOW, slot=SlotView("held"))
    assert default.node_patch is not None
    assert {t["effect"] for t in default.node_patch["spec"]["taints"]} == {"NoSchedule"}


def test_measured_numbers_wait_for_the_heartbeat_but_a_new_problem_is_written_at_once() -> None:
    before = plan(
        snapshot_of(finding("time.sync", "warn", "ClockUnsynced", "offset 2.1 s")), node_object(), POLICY, now=NOW
    )
    written = {**items(before)["ClockSynced"], "lastTransitionTime": "2027-01-01T00:00:00Z"}
    node = node_object(conditions=[written])
    later = snapshot_of(finding("time.sync", "warn", "ClockUnsynced", "offset 2.7 s"))
    assert plan(later, node, POLICY, now=NOW + 60).status_patch is None
    heartbeat = items(plan(later, node, POLICY, now=NOW + 600, heartbeat=True))["ClockSynced"]
    assert heartbeat["message"].endswith("offset 2.7 s")
    assert heartbeat["lastTransitionTime"] == "2027-01-01T00:00:00Z", "the status did not change"
    other = snapshot_of(finding("time.sync", "warn", "ClockUnsynced", "x"), finding("time.ntp", "warn", "NtpSlow", "y"))
    p = plan(other, node, POLICY, now=NOW + 60)
    assert items(p)["ClockSynced"]["message"].startswith("warn: ClockUnsynced (time.sync), NtpSlow (time.ntp)")
    assert [e.reason for e in p.events] == ["Healthy"]


def test_a_removed_category_loses_its_condition() -> None:
    node = node_object(conditions=[FOREIGN_CONDITION, {"type": "NPUHealthy", "status": "True", "reason": "Healthy"}])
    p = plan(snapshot_of(finding("npu.health", "skip", "NoNpu")), node, POLICY, now=NOW)
    assert items(p) == {"NPUHealthy": {"type": "NPUHealthy", "$patch": "delete"}}


def test_cleanup_takes_only_what_is_ours() -> None:
    node = node_object(
        taints=[FOREIGN, ours("network", "DnsFailed"), FOREIGN_SOFT, ours("npu", "X", "PreferNoSchedule")],
        labels={"team": "ml", "node-health/ready": "false", "node-health/tainted": "true", "node-healthy": "x"},
        conditions=[FOREIGN_CONDITION, {"type": "NetworkHealthy", "status": "False", "reason": "DnsFailed"}],
    )
    p = plan_cleanup(node, "node-health")
    assert p.node_patch == {
        "metadata": {"resourceVersion": "7", "labels": {"node-health/ready": None, "node-health/tainted": None}},
        "spec": {"taints": [FOREIGN, FOREIGN_SOFT]},
    }
    assert p.status_patch == {"status": {"conditions": [{"type": "NetworkHealthy", "$patch": "delete"}]}}
    assert p.removed == (
        "taint node-health/network=DnsFailed:NoSchedule",
        "taint node-health/npu=X:PreferNoSchedule",
        "label node-health/ready",
        "label node-health/tainted",
        "condition NetworkHealthy",
    )
    assert plan_cleanup(node_object(taints=[FOREIGN], labels={"team": "ml"}), "node-health") == (
        plan_cleanup(node_object(), "node-health")
    )


def test_no_command_line_reaches_the_node() -> None:
    secret = "python train.py --hf-token=hf_SECRET"
    snapshot = snapshot_of(
        finding(
            "npu.holders",
            "fail",
            "DeviceHeldOutsidePod",
            "pid 4242 (python) holds /dev/davinci0",
            observed={"cmdline": secret, "pid": 4242},
            event=Event("HolderFound", "pid 4242 (python) holds /dev/davinci0"),
        )
    )
    p = plan(snapshot, node_object(), POLICY, now=NOW, slot=SlotView("held"), heartbeat=True)
    assert "hf_SECRET" not in json.dumps([p.node_patch, p.status_patch, [e.message for e in p.events]])


def applied(node: dict[str, Any], p: Plan) -> dict[str, Any]:
    """The Node after the plan's patches, merged as the API server merges them."""
    for patch in (p.node_patch, p.status_patch):
        if patch is not None:
            body = json.loads(json.dumps(patch))
            body.get("metadata", {}).pop("resourceVersion", None)
            node = strategic_merge(node, body)
    return node


@pytest.mark.parametrize(
    ("findings", "slot"),
    [
        ([finding("storage.mounts"), finding("time.sync", "warn", "ClockUnsynced", "offset 2 s")], "free"),
        ([finding("storage.mounts", "fail", "MountMissing"), finding("npu.health", "fail", "NpuHealthAlarm")], "held"),
        ([finding("network.dns", "fail", "DnsFailed", "no answer")], "denied"),
        ([finding("time.sync", "unknown", PROBE_TIMEOUT.code, "hung"), warming("storage.mounts")], "unknown"),
        ([finding("npu.health", "fail", "Muted"), finding("host.memory", "warn", "MemoryLow")], "free"),
    ],
    ids=["healthy-and-warn", "failing", "withheld", "unknown-and-warming", "disabled"],
)
def test_a_plan_applied_and_planned_again_writes_nothing(findings: list[Any], slot: str) -> None:
    policy = kube_config(disabled_reasons=["Muted"]).kubernetes
    view = SlotView(slot, 200, 200)  # type: ignore[arg-type]
    node = node_object(taints=[FOREIGN], labels={"team": "ml"}, conditions=[FOREIGN_CONDITION])
    first = plan(snapshot_of(*findings), node, policy, now=NOW, slot=view)
    assert first.node_patch or first.status_patch
    later = snapshot_of(*(replace(f, message=f.message + " (measured again)") for f in findings))
    again = plan(later, applied(node, first), policy, now=NOW + 30, slot=view)
    assert (again.node_patch, again.status_patch, again.events) == (None, None, ())
