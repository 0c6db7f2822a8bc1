"""The `<prefix>/isolated-devices` annotation is checked before it is sent: kube-apiserver refuses (422) a Node
whose annotations pass 256 KiB in all. Sixteen chips at their longest (every field at its bound, a long API error
as the why) stay well under the annotation's own budget; past it the entries lose their why and rule names; and a
Node whose other annotations leave no room gets its taints and labels without the annotation."""

from __future__ import annotations

import json
from dataclasses import replace

from support.kube_devices import longest_isolation
from support.kube_helpers import finding, kube_config, node_object, snapshot_of

from agent.kube.devices.isolation import ANNOTATION_LIMIT, WHY_LIMIT, annotation_value
from agent.kube.node.plan import ANNOTATIONS_LIMIT, SlotView, plan_desired
from agent.kube.node.policy import desired_state

POLICY = kube_config().kubernetes


def test_sixteen_chips_at_their_longest_fit_with_room_to_spare() -> None:
    value = annotation_value([longest_isolation(i) for i in range(16)])
    assert value is not None
    entries = json.loads(value)
    assert len(entries) == 16 and all(len(e["why"]) <= WHY_LIMIT and len(e["rules"]) == 3 for e in entries)
    assert len(value.encode()) <= ANNOTATION_LIMIT < ANNOTATIONS_LIMIT // 4, len(value.encode())


def test_past_its_budget_the_annotation_drops_whys_and_rule_names() -> None:
    value = annotation_value([longest_isolation(i) for i in range(200)])
    assert value is not None and len(value.encode()) <= ANNOTATIONS_LIMIT // 4
    entries = json.loads(value)
    assert len(entries) == 200 and not any("why" in e or "rules" in e for e in entries)
    assert entries[0]["device"] == "npu0" and entries[0]["mechanism"] == "node"


def test_no_room_left_by_other_annotations_keeps_the_taint_and_leaves_the_annotation_out() -> None:
    snapshot = snapshot_of(finding("storage.mounts", "fail", "MountMissing", "/data is not mounted"))
    desired = desired_state(snapshot, POLICY)
    key = "node-health/isolated-devices"
    desired = replace(desired, annotations=((key, annotation_value([longest_isolation(0)])),))
    node = node_object()
    node["metadata"]["annotations"] = {"example.com/big": "x" * (ANNOTATIONS_LIMIT - 100)}
    p = plan_desired(desired, node, POLICY, now=1_800_000_000.0, slot=SlotView("held"))
    assert p.node_patch is not None and p.node_patch["spec"]["taints"], "the taint still goes"
    assert "annotations" not in p.node_patch["metadata"]
    assert f"annotation {key} not written" in p.node_change
    node["metadata"]["annotations"] = {"example.com/big": "x" * 1000}
    p = plan_desired(desired, node, POLICY, now=1_800_000_000.0, slot=SlotView("held"))
    assert p.node_patch is not None and key in p.node_patch["metadata"]["annotations"]
