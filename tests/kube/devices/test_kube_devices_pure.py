"""The pure parts of device isolation: names, matching, effects, the public-fault plan, the device budget's census."""

from __future__ import annotations

import re

from agent.config import parse_config
from agent.kube.devices.budget import apply_census
from agent.kube.devices.match import (
    DeviceRef,
    Identity,
    Published,
    device_effect,
    matching,
    node_label_value,
    published_devices,
    rule_name,
)
from agent.kube.devices.publicfault import MAX_FAULTS, ActiveFault, plan_faults
from probes.base import Status

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def test_rule_names_are_deterministic_dns_subdomains_of_at_most_253_characters() -> None:
    name = rule_name("node-health", "gpu", "gpu-node-7", "gpu.nvidia.com", "gpu-3")
    assert name == "node-health.gpu.gpu-node-7.gpu.nvidia.com.gpu-3"
    long_node = "n" * 63 + "." + "a" * 63 + "." + "b" * 63 + "." + "c" * 40
    long = rule_name("node-health", "npu", long_node, "npu.huawei.com", "ascend910-3")
    assert len(long) <= 253 and DNS_SUBDOMAIN.match(long) and ".." not in long
    assert long == rule_name("node-health", "npu", long_node, "npu.huawei.com", "ascend910-3"), "deterministic"
    assert long != rule_name("node-health", "npu", long_node, "npu.huawei.com", "ascend910-4"), "per device"
    odd = rule_name("node-health", "gpu", "Node_A", "gpu.nvidia.com", "gpu-0")
    assert DNS_SUBDOMAIN.match(odd) and odd != rule_name("node-health", "gpu", "node-a", "gpu.nvidia.com", "gpu-0")
    assert node_label_value("gpu-node-7") == "gpu-node-7" and node_label_value("x" * 64) is None


def published(name: str, **ids: object) -> Published:
    return Published("gpu.nvidia.com", "n1", name, "s", **ids)  # type: ignore[arg-type]


def test_matching_by_uuid_then_bus_then_physical_id_never_by_name_or_position() -> None:
    gpu3 = Identity(DeviceRef("gpu", 3), {"GPU-3", "MIG-3a"}, {"0000:1b:00.0"}, None, 3)
    devices = [
        published("gpu-3", uuids=frozenset({"GPU-other"}), bus_id="0000:99:00.0"),  # the same name, another GPU
        published("gpu-5", uuids=frozenset({"GPU-3"}), bus_id="0000:1b:00.0"),
        published("gpu-5-mig-1", uuids=frozenset({"MIG-3a"}), bus_id="0000:1b:00.0"),
    ]
    assert [p.name for p in matching(gpu3, devices)] == ["gpu-5", "gpu-5-mig-1"], "the GPU and its MIG device"
    by_bus = [published("gpu-9", bus_id="0000:1b:00.0"), published("gpu-3")]
    assert [p.name for p in matching(gpu3, by_bus)] == ["gpu-9"]
    assert matching(gpu3, [published("gpu-3")]) == [], "a name alone is no match"
    chip = Identity(DeviceRef("npu", 0), set(), set(), 6, 6)
    ascend = [Published("npu.huawei.com", "n1", f"ascend910-{i}", "s", physical_id=i) for i in range(8)]
    assert [p.name for p in matching(chip, ascend)] == ["ascend910-6"]
    gpu_with_phys = Identity(DeviceRef("gpu", 6), set(), set(), 6, 6)
    assert matching(gpu_with_phys, ascend) == [], "a physical id matches only NPUs"


def test_published_devices_of_this_node_and_its_pool_only() -> None:
    slices = [
        {
            "metadata": {"name": "old"},
            "spec": {
                "driver": "gpu.nvidia.com",
                "nodeName": "n1",
                "pool": {"name": "n1"},
                "devices": [{"name": "gpu-0", "basic": {"attributes": {"uuid": {"string": "GPU-0"}}}}],
            },
        },
        {
            "metadata": {"name": "bus"},
            "spec": {
                "driver": "gpu.nvidia.com",
                "nodeName": "n1",
                "pool": {"name": "n1"},
                "devices": [{"name": "gpu-1", "attributes": {"gpu.nvidia.com/pcieBusID": {"string": "0000:3B:00.0"}}}],
            },
        },
        {"metadata": {"name": "other"}, "spec": {"driver": "gpu.nvidia.com", "nodeName": "n2", "pool": {"name": "n2"}}},
        {"metadata": {"name": "shared"}, "spec": {"driver": "gpu.nvidia.com", "nodeName": "n1", "pool": {"name": "p"}}},
        {"metadata": {"name": "cpu"}, "spec": {"driver": "dra.cpu", "nodeName": "n1", "pool": {"name": "n1"}}},
    ]
    found, notes = published_devices(slices, "n1", ["gpu.nvidia.com"])
    assert [(p.name, p.uuids, p.bus_id) for p in found] == [
        ("gpu-0", frozenset({"GPU-0"}), None),  # v1beta1: attributes under `basic`
        ("gpu-1", frozenset(), "0000:3b:00.0"),  # an older release's pcieBusID, normalized
    ]
    assert notes == ["slice shared of gpu.nvidia.com: pool 'p' is not the node's name"]


def test_device_effects() -> None:
    policy = parse_config(
        {"kubernetes": {"allow_noexecute": True, "effects": {"A": "NoExecute", "B": "PreferNoSchedule", "C": "None"}}}
    ).kubernetes
    assert device_effect(Status.FAIL, "A", policy) == "NoExecute"
    assert device_effect(Status.FAIL, "B", policy) == "None", "DRA has no PreferNoSchedule"
    assert device_effect(Status.FAIL, "C", policy) == "None"
    assert device_effect(Status.FAIL, "D", policy) == "NoSchedule"
    assert device_effect(Status.WARN, "A", policy) == "None", "a warn is informational"


def test_public_fault_plan_keeps_instances_and_recoveries_within_clusterds_limit() -> None:
    active = {(2, "160010001"): ActiveFault("npu2", 2, "160010001", "held")}
    first = plan_faults([], active, set(), "n1", 1_800_000_000_000)
    assert [(f["assertion"], f["faultTime"]) for f in first] == [("occur", 1_800_000_000_000)]
    assert plan_faults(first, active, set(), "n1", 1_800_000_060_000) == first, "unchanged: the same message"
    recovered = plan_faults(first, {}, set(), "n1", 1_800_000_120_000)
    assert recovered == [{**first[0], "assertion": "recover"}]
    assert plan_faults(first, {}, {(2, "160010001")}, "n1", 1) == first, "kept: not recovered yet"
    again = plan_faults(recovered, active, set(), "n1", 1_800_000_180_000)
    assert [f["assertion"] for f in again] == ["occur"] and again[0]["faultId"] != first[0]["faultId"]
    many = [
        {**first[0], "faultId": f"nh.x.{i}", "faultCode": f"1600{i:05d}", "faultTime": 1_800_000_000_000 + i}
        for i in range(MAX_FAULTS + 20)
    ]
    capped = plan_faults([{**f, "assertion": "recover"} for f in many], active, set(), "n1", 1_800_000_300_000)
    assert len(capped) == MAX_FAULTS and capped[0]["assertion"] == "occur"
    assert min(f["faultTime"] for f in capped[1:]) == 1_800_000_000_000 + 21, "the oldest recoveries go first"


def test_device_budget_census_prunes_old_slots_and_adopts_isolations() -> None:
    now = 10_000.0
    slots = {
        "dead": (frozenset({"gpu0"}), now - 3600),  # its agent died: nothing isolated any more
        "young": (frozenset({"npu1"}), now - 10),  # taken a moment ago: its rule is on its way
        "shrunk": (frozenset({"gpu1", "gpu2"}), now - 3600),
    }
    found = {"shrunk": frozenset({"gpu2"}), "orphan": frozenset({"npu3"})}
    assert apply_census(slots, found, 120, now) == {
        "young": (frozenset({"npu1"}), now - 10),
        "shrunk": (frozenset({"gpu2"}), now - 3600),
        "orphan": (frozenset({"npu3"}), now),
    }
