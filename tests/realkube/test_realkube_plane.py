"""The real control plane itself: the release asked for answers /version, Nodes are born tainted, and the
device-taint-eviction controller writes a DeviceTaintRule's status only with the device-taint gates on."""

from __future__ import annotations

import pytest
from support.realkube import plane, wait_for

pytestmark = [pytest.mark.system, pytest.mark.realkube]


@pytest.mark.parametrize("release", ["1.37", "1.36"])
def test_a_real_plane_serves_its_release_and_registers_born_tainted_nodes(release: str) -> None:
    real = plane(release)
    assert real.version.startswith(f"v{release}."), real.version
    node = real.register_node("born-tainted")
    taints = {t["key"]: t["effect"] for t in node["spec"].get("taints") or []}
    assert taints == {"node.kubernetes.io/not-ready": "NoSchedule"}, "admission taints every new Node"


@pytest.mark.parametrize(("release", "version"), [("1.37", "v1"), ("1.36", "v1beta2")])
def test_the_eviction_controller_writes_rule_status_with_the_gates_on(release: str, version: str) -> None:
    real = plane(release)
    path = f"/apis/resource.k8s.io/{version}/devicetaintrules"
    rule = {
        "metadata": {"name": "status-probe"},
        "spec": {
            "deviceSelector": {"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"},
            "taint": {"key": "node-health/gpu", "value": "Probe", "effect": "NoSchedule"},
        },
    }
    status, created = real.request("POST", path, rule)
    assert status == 201, created
    stored = wait_for("the rule's status", lambda: (real.request("GET", f"{path}/status-probe")[1] or {}).get("status"))
    assert stored.get("conditions"), stored


def test_with_the_gates_off_136_serves_rules_and_nothing_acts_on_them() -> None:
    """The difference the double had wrong: the rules are served with DRADeviceTaintRules off, and ignored."""
    import time

    real = plane("1.36", taint_rules=False)
    path = "/apis/resource.k8s.io/v1beta2/devicetaintrules"
    rule = {
        "metadata": {"name": "ignored"},
        "spec": {
            "deviceSelector": {"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"},
            "taint": {"key": "node-health/gpu", "value": "Probe", "effect": "NoSchedule"},
        },
    }
    status, created = real.request("POST", path, rule)
    assert status == 201, created
    time.sleep(5)  # five times what the controller takes with the gates on
    assert not (real.request("GET", f"{path}/ignored")[1] or {}).get("status")
