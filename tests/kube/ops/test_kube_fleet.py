"""`node-health fleet` on a double of 20 nodes in mixed states, each put there by a real agent (the reconciler,
real client, HTTP): healthy nodes, a node taint, taints withheld by the node budget, GPUs isolated by DRA rules,
chips with public faults, device isolations withheld by the device budget, a device on the node taint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.kube_devices import publish_gpus, record_gpus, record_npus
from support.kube_double import ApiDouble
from support.kube_helpers import BUDGET_NS, Clock, health_state, make_agent, record
from support.system import REPO

from agent.config import parse_config
from agent.kube.client import KubeApi
from agent.kube.ops.fleet import fleet_view, format_fleet

PROBES = {"gpu": ("gpu.holders",), "npu": ("npu.holders",), "storage": ("storage.mounts",), "network": ("network.dns",)}
PF = {"mindcluster": {"public_fault": {"enabled": True, "namespace": "mindx-dl"}}}
SETTINGS = {"max_unhealthy": "2", "max_unhealthy_devices": "4", **PF}


def build_fleet(double: ApiDouble) -> tuple[Clock, dict[str, Any]]:
    """20 nodes: 0-5 healthy; 6 a missing mount (tainted); 7-9 DNS failing (two withheld by the node budget of 2:
    one taint for 6, one for 7); 10-12 one bad GPU each on DRA (rules); 13 a chip with a public fault; 14 two bad
    GPUs (the device budget of 4 is spent: one withheld); 15 a GPU on no slice (the node taint, withheld by the
    node budget); 16-19 healthy."""
    clock = Clock()
    double.serve_dra("1.37")
    names = [f"node-{i:02d}" for i in range(20)]
    for i, name in enumerate(names):
        double.add_node(name, labels={"pool": "accel"})
        if 10 <= i <= 14:
            publish_gpus(double, name)
    double.add_node("cpu-01", labels={"pool": "cpu"})
    agents = {}
    for i, name in enumerate(names):
        state = health_state(name, clock, PROBES)
        agents[name] = (state, make_agent(double, state, clock, seed=i, **SETTINGS))
    for _ in range(3):
        for i, name in enumerate(names):
            state, agent = agents[name]
            record(state, "storage", "storage.mounts", "fail" if i == 6 else "ok", "MountMissing" if i == 6 else "")
            record(state, "network", "network.dns", "fail" if 7 <= i <= 9 else "ok", "DnsFailed" if 7 <= i <= 9 else "")
            bad = {3: "GpuHeldOutOfBand"} if 10 <= i <= 12 or i == 15 else {}
            if i == 14:
                bad = {1: "GpuHeldOutOfBand", 2: "GpuSharedByPods"}
            record_gpus(state, bad)
            record_npus(state, {2: "NpuHeldOutOfBand"} if i == 13 else {})
            agent.reconcile_once()
        clock.advance(20)
    return clock, agents


@pytest.mark.system
def test_the_fleet_view_of_twenty_nodes_in_mixed_states(double: ApiDouble, monkeypatch: Any) -> None:
    monkeypatch.setenv("POD_NAMESPACE", BUDGET_NS)
    clock, _ = build_fleet(double)
    config = parse_config({"kubernetes": {"budget_namespace": BUDGET_NS, **SETTINGS}})
    view = fleet_view(KubeApi(double.client, 5), config, "pool=accel", clock.now)
    by_name = {n.name: n for n in view.nodes}
    assert view.total_nodes == 20
    assert set(by_name) == {f"node-{i:02d}" for i in range(6, 16)}, "only the marked nodes"
    assert all(n.ready == "false" for n in view.nodes), "every marked node here fails a check"
    assert [n.name for n in view.nodes] == sorted(by_name), "equally bad: by name"

    storage = by_name["node-06"].problems
    assert [(p.category, p.reason, p.tainted) for p in storage] == [("storage", "MountMissing", "NoSchedule")]
    assert storage[0].age_seconds == 60, "since the condition turned False"
    dns = [by_name[f"node-0{i}"] for i in (7, 8, 9)]
    assert [bool(n.withheld) for n in dns] == [False, True, True], "the node budget of 2 was spent by 06 and 07"
    assert dns[1].withheld == ["network=DnsFailed"]
    for i in (10, 11, 12):
        node = by_name[f"node-{i}"]
        assert [(d["device"], d["mechanism"]) for d in node.isolated] == [("gpu3", "dra")]
        assert node.problems[0].tainted == "", "a GPU on a rule: the node is not tainted"
    assert [(d["device"], d["mechanism"]) for d in by_name["node-13"].isolated] == [("npu2", "public_fault")]
    node14 = by_name["node-14"]
    assert [d["device"] for d in node14.isolated] == [] and node14.withheld == [
        "gpu1 (device budget)",
        "gpu2 (device budget)",
    ]
    assert [(d["device"], d["mechanism"]) for d in by_name["node-15"].isolated] == [("gpu3", "node")]
    assert view.rules == 3 and view.faults == 1
    budgets = {b.of: b for b in view.budgets}
    assert (budgets["nodes"].used, budgets["nodes"].limit) == (2, 2)
    assert (budgets["devices"].used, budgets["devices"].limit) == (4, 4)

    table = format_fleet(view)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["NODE", "READY", "PROBLEMS"]
    row = next(line for line in lines if line.startswith("node-06"))
    assert "storage=MountMissing 1m*" in row
    assert "gpu3:dra" in next(line for line in lines if line.startswith("node-10"))
    assert "npu2:fault" in next(line for line in lines if line.startswith("node-13"))
    assert "gpu1 (device budget); gpu2 (device budget)" in next(line for line in lines if line.startswith("node-14"))
    assert "node taint budget (node-health-budget): 2 of 2 used (100%)" in table
    assert "device budget (node-health-device-budget): 4 of 4 used (100%)" in table
    assert "DeviceTaintRules of the agents: 3; chips with a public fault: 1" in table
    assert len(lines) <= 16, "one screen: a line per marked node, then the budgets"


@pytest.mark.system
def test_the_fleet_command_from_a_kubeconfig(double: ApiDouble, tmp_path: Path) -> None:
    build_fleet(double)
    kubeconfig = double.write_kubeconfig(tmp_path / "kubeconfig")
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump({"kubernetes": {"kubeconfig": str(kubeconfig), "budget_namespace": BUDGET_NS, **SETTINGS}})
    )
    command = [sys.executable, "-m", "agent.cli", "fleet", "--config", str(config)]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    table = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert table.returncode == 0, table.stderr
    assert "node-10" in table.stdout and "gpu3:dra" in table.stdout
    document = subprocess.run(
        [*command, "--json", "--selector", "pool=accel"], capture_output=True, text=True, timeout=60, cwd=REPO, env=env
    )
    assert document.returncode == 0, document.stderr
    parsed = json.loads(document.stdout)
    assert len(parsed["nodes"]) == 10 and parsed["device_taint_rules"] == 3
    double.stop()
    down = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert down.returncode == 1 and "nodes not listed" in down.stderr


def test_node_fields_are_escaped_before_they_reach_a_terminal() -> None:
    from agent.kube.ops.fleet import FleetView, NodeView

    view = FleetView([NodeView("evil\x1b[2Jnode", "false", withheld=["x\ny"])], [], None, None, [], 1)
    text = format_fleet(view)
    assert "\x1b" not in text and "\\x1b[2Jnode" in text
    assert "x\\x0ay" in text


@pytest.mark.system
def test_an_agent_taint_without_its_condition_is_an_orphan_with_the_command_that_removes_it(
    double: ApiDouble, tmp_path: Path
) -> None:
    """Field failure: a node-health/storage taint left by an agent that is gone showed as `problems: []`."""
    taint = {"key": "node-health/storage", "value": "MountMissing", "effect": "NoSchedule"}
    ok = {"type": "StorageHealthy", "status": "True", "reason": "OK", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    double.add_node("gone-01", taints=[taint])  # no condition at all
    double.add_node("gone-02", taints=[taint], conditions=[ok])  # the condition says healthy
    double.add_node("other-01", taints=[{"key": "example.com/maintenance", "effect": "NoSchedule"}])
    kubeconfig = double.write_kubeconfig(tmp_path / "kubeconfig")
    config = parse_config({"kubernetes": {"kubeconfig": str(kubeconfig), "budget_namespace": BUDGET_NS}})
    view = fleet_view(KubeApi(double.client, 5), config, "", 0.0)
    by_name = {n.name: n for n in view.nodes}
    assert set(by_name) == {"gone-01", "gone-02"}, "a taint the agent does not own is not its orphan"
    assert by_name["gone-01"].orphans == [
        {
            "taint": "node-health/storage",
            "effect": "NoSchedule",
            "remove": "node-health cleanup --node gone-01",
            "kubectl": "kubectl taint nodes gone-01 node-health/storage:NoSchedule-",
        }
    ]
    table = format_fleet(view)
    assert "node-health/storage:NoSchedule ORPHAN (no condition)" in next(
        line for line in table.splitlines() if line.startswith("gone-02")
    )
    assert "remove it with `node-health cleanup --node gone-01`" in table

    # The command shown does remove it: the node leaves the view.
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"kubernetes": {"kubeconfig": str(kubeconfig), "budget_namespace": BUDGET_NS}}))
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "POD_NAMESPACE": BUDGET_NS}
    command = [sys.executable, "-m", "agent.cli", "cleanup", "--config", str(path), "--node", "gone-01"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr
    after = fleet_view(KubeApi(double.client, 5), config, "", 0.0)
    assert [n.name for n in after.nodes] == ["gone-02"]
