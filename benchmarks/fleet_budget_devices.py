"""The device scenario of benchmarks/fleet_budget.py (`--scenario devices`): a bad npu-smi release marks every chip
of a fleet Warning at once, each chip asking for a DeviceTaintRule; the device budget against no budget.

NODES nodes of 8 NPUs, each published in a ResourceSlice of MindCluster's DRA driver (resource.k8s.io v1, served
by the in-repo API double), agents of agent/kube polling every TICK simulated seconds on WORKERS threads:

  1. every chip healthy (not measured);
  2. every chip Warning on every node at the same instant, for MINUTES simulated minutes (measured);
  3. every chip healthy again (not measured): no rule and no device slot may be left.

`new`: the default device budget (10% of the fleet's chips). `baseline`: the same agents, no device budget
(max_unhealthy_devices 100%). After every write the double stores, the rules that exist are counted.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import kubernetes.client
from fleet_sim import REPO, add_nodes, finish, print_run, simulate, traffic
from support.kube_double import ApiDouble
from support.kube_dra import add_resource_slice
from support.kube_helpers import Clock, health_state

from agent.config import parse_config
from agent.kube import KubeAgent
from agent.state import HealthState
from probes.base import OBSERVED_DEVICE_MINOR, OBSERVED_PCI_BUS_ID, OBSERVED_PHYSICAL_ID, Finding, Status

CHIPS = 8
PROBES = {"npu": ("npu.health",)}


def chip_findings(status: Status) -> list[Finding]:
    reason = "NpuHealthWarning" if status == Status.WARN else "OK"
    return [
        Finding(
            "npu.health",
            f"npu{chip}",
            status,
            reason,
            f"npu{chip} (910B1, card {chip} chip 0) health is {'Warning' if status == Status.WARN else 'OK'}",
            "",
            {
                OBSERVED_PHYSICAL_ID: chip,
                OBSERVED_DEVICE_MINOR: chip,
                OBSERVED_PCI_BUS_ID: f"0000:{0xC1 + chip:02X}:00.0",
            },
            chip,
        )
        for chip in range(CHIPS)
    ]


@dataclass
class ChipFleet:
    clock: Clock
    warning: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.healthy_state, self.warning_state = self._state(), self._state()
        self.report()

    def _state(self) -> HealthState:
        return health_state("fleet", self.clock, PROBES)

    def report(self) -> None:
        self.healthy_state.record("npu", chip_findings(Status.OK))
        self.warning_state.record("npu", chip_findings(Status.WARN))

    def snapshot_of(self, name: str) -> Any:
        return lambda: (self.warning_state if name in self.warning else self.healthy_state).snapshot


class RuleWatch:
    """The rules that exist after every stored change, and the most there ever were: a create or update seen by the
    double's after_write hook adds one, a delete the double carried out takes it away."""

    def __init__(self, double: ApiDouble) -> None:
        self.names: set[str] = set()
        self.most = 0
        delete = double.delete

        def counted_delete(resource: str, namespace: str, name: str, preconditions: Any = None) -> Any:
            gone = delete(resource, namespace, name, preconditions)
            if resource == "devicetaintrules":
                self.names.discard(name)
            return gone

        double.delete = counted_delete  # type: ignore[method-assign]
        double.after_write = self

    def __call__(self, api: ApiDouble) -> None:
        if api.last_saved is not None and api.last_saved[0] == "devicetaintrules":
            self.names.add(api.last_saved[2])
            self.most = max(self.most, len(self.names))


def _double(names: list[str]) -> ApiDouble:
    double = ApiDouble().start()
    double.serve_dra("1.37")
    add_nodes(double, names)
    devices = [{"name": f"ascend910-{chip}", "attributes": {"physicId": {"int": chip}}} for chip in range(CHIPS)]
    for name in names:
        add_resource_slice(double, f"{name}-npu.huawei.com", name, "npu.huawei.com", devices)
    return double


def run(algorithm: str, nodes: int, minutes: float, workers: int) -> dict[str, Any]:
    names = [f"node-{i:05d}" for i in range(nodes)]
    double = _double(names)
    watch = RuleWatch(double)
    clock = Clock()
    fleet = ChipFleet(clock)
    configuration = kubernetes.client.Configuration(host=double.host)
    configuration.connection_pool_maxsize = workers
    client = kubernetes.client.ApiClient(configuration)
    settings = {"budget_namespace": "node-health", "budget_node_selector": "pool=accel"}
    settings["max_unhealthy_devices"] = "10%" if algorithm == "new" else "100%"
    config = parse_config({"kubernetes": settings})
    agents = [
        KubeAgent(config, name, fleet.snapshot_of(name), client, clock=clock, rng=random.Random(i))
        for i, name in enumerate(names)
    ]
    pool = ThreadPoolExecutor(max_workers=workers)

    def advance(seconds: float) -> None:
        simulate(clock, pool, lambda agent: agent.step(), agents, fleet.report, seconds)

    try:
        started = time.monotonic()
        advance(60)
        start_log, start_bytes = len(double.log), double.bytes_sent
        fleet.warning = set(names)  # the bad release reaches every node at once
        advance(minutes * 60)
        window, sent = double.log[start_log:], double.bytes_sent - start_bytes
        at_end = len(double.device_taint_rules())
        fleet.warning = set()
        advance(180)  # recovery, not measured
        budget = double.configmap("node-health", "node-health-device-budget") or {}
        node_minutes = nodes * minutes
        return {
            "algorithm": algorithm,
            "nodes": nodes,
            "devices": nodes * CHIPS,
            "minutes": minutes,
            "budget": -(-nodes * CHIPS // 10) if algorithm == "new" else nodes * CHIPS,
            **traffic(window, sent, node_minutes),
            "writes": sum(1 for r in window if r.method != "GET"),
            "most_rules": watch.most,
            "rules_at_end_of_incident": at_end,
            "rules_after_recovery": len(double.device_taint_rules()),
            "slots_after_recovery": sum(len(json.loads(v)["devices"]) for v in (budget.get("data") or {}).values()),
            "wall_seconds": round(time.monotonic() - started, 1),
        }
    finally:
        pool.shutdown()
        double.stop()


def main_devices(args: argparse.Namespace) -> int:
    output = args.output or str(REPO / "benchmarks" / "results" / "fleet_budget_devices.json")
    results = {}
    for algorithm in ("baseline", "new"):
        if args.only and algorithm != args.only:
            continue
        row = results[algorithm] = run(algorithm, args.nodes, args.minutes, args.workers)
        outcome = f"most rules {row['most_rules']} of {row['devices']} chips (budget {row['budget']})"
        print_run(row, args.nodes * args.minutes, outcome)
    if len(results) == 2:
        old, new = results["baseline"], results["new"]
        ratios = {key: new[key] / max(1, old[key]) for key in ("requests", "bytes", "writes", "most_rules")}
        print("new/baseline: " + ", ".join(f"{key} x{value:.3f}" for key, value in ratios.items()))
    return finish(results, output, "device budget invariant", "most_rules", "rules", "rules or device slots")
