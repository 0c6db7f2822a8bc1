#!/usr/bin/env python3
"""The taint budget at fleet scale: what a fleet-wide incident costs the API server, before and after.

    python benchmarks/fleet_budget.py [--nodes 2000] [--minutes 10] [--workers 8] [--only new|baseline]
    python benchmarks/fleet_budget.py --scenario devices [--nodes 2000] [--minutes 10] [--only new|baseline]

A fleet of NODES reconcilers runs in this process against the in-repo API double (tests/support/kube_double.py,
HTTP on 127.0.0.1, through the real kubernetes client), in simulated time: every agent polls every TICK
simulated seconds, on WORKERS threads so compare-and-swaps really race. The scenario, for each algorithm:

  1. every node healthy; the agents write their conditions and labels (not measured);
  2. a DNS outage fails every node at the same instant, for MINUTES simulated minutes (measured); halfway,
     half of the tainted nodes recover, so their slots are given back and taken by nodes still failing;
  3. every node recovers (not measured): no taint and no slot may be left.

Algorithms: `baseline` is the reconciler and budget of commit BASELINE_COMMIT (agent/kube.py,
agent/kube_budget.py, agent/kube_policy.py), loaded from git history: every slot request lists every node,
and a suppressed node re-reads its Node and asks (listing every node again) every 60 s. `new` is agent/kube.

Reported per algorithm: API requests and bytes served per node-minute during the incident, by kind, and
the most nodes that carried a blocking taint at any instant (checked after every write the API double
stores). The invariant (never more than the budget) is asserted here: the script exits 1 when it is broken.
Writes benchmarks/results/fleet_budget.json.

`--scenario devices` (on its own: the node scenario's baseline takes twenty minutes) is the device budget's:
NODES nodes of 8 NPUs each, published by MindCluster's DRA driver (a ResourceSlice per node, resource.k8s.io v1),
and a bad npu-smi release that marks every chip Warning on every node at the same instant (each chip asks for a
DeviceTaintRule of effect None). `new` is agent/kube with the default device budget (10% of the fleet's chips);
`baseline` is the same agent without a device budget (max_unhealthy_devices 100%). Reported: requests and bytes
per node-minute by kind, the most rules that existed at any instant (checked after every write), and what is
left once every chip is healthy again. Writes benchmarks/results/fleet_budget_devices.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import random
import subprocess
import sys
import time
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes.client
from fleet_sim import REPO, add_nodes, finish, print_run, simulate, traffic
from support.kube_double import ApiDouble
from support.kube_helpers import PREFIX, Clock, health_state, record

from agent.config import parse_config
from agent.kube import KubeAgent
from agent.state import HealthState

BASELINE_COMMIT = "2a10fe9"
BASELINE_FILES = ("agent/kube.py", "agent/kube_budget.py", "agent/kube_policy.py")
PROBES = {"network": ("network.dns",)}
BLOCKING = ("NoSchedule", "NoExecute")


def load_baseline() -> type:
    """The old KubeAgent, from git history, as the package `baseline_kube` (its agent.* imports rewired)."""
    package = types.ModuleType("baseline_kube")
    package.__path__ = []
    sys.modules["baseline_kube"] = package
    import agent.state
    from agent import ready, reasons, snapshot
    from probes.base import CATEGORIES

    # The names the old policy and reconciler import from agent.state, from where they live now.
    old_names: dict[str, Any] = {
        "CONDITION_TYPES": {c.name: c.condition_type for c in CATEGORIES.values()},
        "STALE": reasons.STALE.code,
        "WARMING_UP": reasons.WARMING_UP.code,
        "CheckState": snapshot.CheckState,
        "Snapshot": snapshot.Snapshot,
        "matches_any": ready.matches_any,
    }
    for name, value in old_names.items():
        if not hasattr(agent.state, name):
            setattr(agent.state, name, value)
    for path in ("agent/kube_policy.py", "agent/kube_budget.py", "agent/kube.py"):
        try:
            source = subprocess.run(
                ["git", "-C", str(REPO), "show", f"{BASELINE_COMMIT}:{path}"],
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            ).stdout
        except (OSError, subprocess.CalledProcessError) as exc:
            raise SystemExit(f"baseline: cannot read {path} at {BASELINE_COMMIT} from git: {exc}") from None
        source = source.replace("from agent.kube_budget ", "from baseline_kube.kube_budget ")
        source = source.replace("from agent.kube_policy ", "from baseline_kube.kube_policy ")
        name = "baseline_kube." + Path(path).stem
        spec = importlib.util.spec_from_loader(name, loader=None)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        exec(compile(source, f"{BASELINE_COMMIT}:{path}", "exec"), module.__dict__)
    return sys.modules["baseline_kube.kube"].KubeAgent  # type: ignore[no-any-return]


class TaintWatch:
    """after_write hook of the double: blocking-tainted nodes after every stored change, and the most ever."""

    def __init__(self) -> None:
        self.tainted: set[str] = set()
        self.most = 0

    def __call__(self, api: ApiDouble) -> None:
        if api.last_saved is None or api.last_saved[0] != "nodes":
            return
        node = api._store.objects[api.last_saved]
        name = api.last_saved[2]
        if any(
            t["key"].startswith(PREFIX + "/") and t["effect"] in BLOCKING
            for t in (node.get("spec") or {}).get("taints") or []
        ):
            self.tainted.add(name)
        else:
            self.tainted.discard(name)
        self.most = max(self.most, len(self.tainted))


@dataclass
class Fleet:
    """Two shared health states (healthy, failing): what each node's snapshot is depends on its set."""

    clock: Clock
    failing: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.healthy_state = self._state()
        self.failing_state = self._state()
        self.report()

    def _state(self) -> HealthState:
        return health_state("fleet", self.clock, PROBES)

    def report(self) -> None:
        """A probe run on every node: results stay fresh."""
        record(self.healthy_state, "network", "network.dns", "ok")
        record(self.failing_state, "network", "network.dns", "fail", "DnsFailed")

    def snapshot_of(self, name: str) -> Callable[[], Any]:
        return lambda: (self.failing_state if name in self.failing else self.healthy_state).snapshot


class Simulation:
    """NODES agents of one algorithm on one API double, polled every TICK simulated seconds on WORKERS threads."""

    def __init__(self, algorithm: str, nodes: int, workers: int) -> None:
        agent_class: Any = KubeAgent if algorithm == "new" else load_baseline()
        self.double = ApiDouble().start()
        self.names = [f"node-{i:05d}" for i in range(nodes)]
        add_nodes(self.double, self.names)
        self.watch = TaintWatch()
        self.double.after_write = self.watch
        self.clock = Clock()
        self.fleet = Fleet(self.clock)
        configuration = kubernetes.client.Configuration(host=self.double.host)
        configuration.connection_pool_maxsize = workers  # one connection per worker, kept alive
        client = kubernetes.client.ApiClient(configuration)
        settings = {"budget_namespace": "node-health", "budget_node_selector": "pool=accel", "max_unhealthy": "10%"}
        config = parse_config({"kubernetes": settings})
        self.limit = -(-nodes * 10 // 100)  # 10%, rounded up
        self.agents = [
            agent_class(config, name, self.fleet.snapshot_of(name), client, clock=self.clock, rng=random.Random(i))
            for i, name in enumerate(self.names)
        ]
        self.pool = ThreadPoolExecutor(max_workers=workers)

    def _step(self, agent: Any) -> None:
        if isinstance(agent, KubeAgent):
            agent.step()
        elif self.clock() >= agent._retry_at:  # the old reconciler thread's loop body
            agent._attempt()

    def advance(self, seconds: float) -> None:
        simulate(self.clock, self.pool, self._step, self.agents, self.fleet.report, seconds)

    def close(self) -> None:
        self.pool.shutdown()
        self.double.stop()


def run(algorithm: str, nodes: int, minutes: float, workers: int) -> dict[str, Any]:
    sim = Simulation(algorithm, nodes, workers)
    try:
        started = time.monotonic()
        sim.advance(60)
        start_log, start_bytes = len(sim.double.log), sim.double.bytes_sent
        sim.fleet.failing = set(sim.names)  # the outage
        sim.advance(minutes * 30)
        sim.fleet.failing -= set(sorted(sim.watch.tainted)[: len(sim.watch.tainted) // 2])
        sim.advance(minutes * 30)
        window = sim.double.log[start_log:]
        sent = sim.double.bytes_sent - start_bytes
        tainted_at_end = len(sim.watch.tainted)
        sim.fleet.failing = set()
        sim.advance(120)  # recovery, not measured
        configmap = sim.double.configmap("node-health", "node-health-budget") or {}
        node_minutes = nodes * minutes
        return {
            "algorithm": algorithm,
            "nodes": nodes,
            "minutes": minutes,
            "budget": sim.limit,
            **traffic(window, sent, node_minutes),
            "most_tainted": sim.watch.most,
            "tainted_at_end_of_incident": tainted_at_end,
            "tainted_after_recovery": len(sim.watch.tainted),
            "slots_after_recovery": len([k for k in (configmap.get("data") or {}) if not k.startswith("_")]),
            "wall_seconds": round(time.monotonic() - started, 1),
        }
    finally:
        sim.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--minutes", type=float, default=10.0, help="simulated minutes of the incident")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--only", choices=("new", "baseline"))
    parser.add_argument("--scenario", choices=("nodes", "devices"), default="nodes")
    parser.add_argument("--output", help="default: benchmarks/results/fleet_budget[_devices].json")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # 1,800 suppressed agents each say so; the figures are what matters here
    if args.scenario == "devices":
        from fleet_budget_devices import main_devices

        return main_devices(args)
    args.output = args.output or str(REPO / "benchmarks" / "results" / "fleet_budget.json")
    results = {}
    for algorithm in ("baseline", "new"):
        if args.only and algorithm != args.only:
            continue
        results[algorithm] = run(algorithm, args.nodes, args.minutes, args.workers)
        row = results[algorithm]
        print_run(row, args.nodes * args.minutes, f"most tainted {row['most_tainted']} of {row['budget']}")
    if len(results) == 2:
        old, new = results["baseline"], results["new"]
        print(
            f"new/baseline: requests x{new['requests'] / old['requests']:.3f}, bytes x{new['bytes'] / old['bytes']:.4f}"
        )
    return finish(results, args.output, "budget invariant", "most_tainted", "tainted", "taints or slots")


if __name__ == "__main__":
    sys.exit(main())
