"""What the fleet benchmarks share (benchmarks/fleet_budget.py, both scenarios): the nodes, simulated time, the
traffic summary by kind of request, the printed rows and the verdict."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from support.kube_double import ApiDouble, Request  # noqa: E402
from support.kube_helpers import Clock  # noqa: E402

TICK = 5.0


def add_nodes(double: ApiDouble, names: list[str]) -> None:
    for i, name in enumerate(names):
        double.add_node(
            name,
            labels={
                "kubernetes.io/hostname": name,
                "node.kubernetes.io/instance-type": "accel-8x",
                "topology.kubernetes.io/zone": f"zone-{i % 3}",
                "pool": "accel",
            },
        )


def simulate(
    clock: Clock,
    pool: ThreadPoolExecutor,
    step: Callable[[Any], None],
    agents: list[Any],
    report: Callable[[], None],
    seconds: float,
) -> None:
    """`seconds` of simulated time: every agent steps once per TICK (on the pool's threads), the probes report
    every 30 s."""
    end = clock.now + seconds
    while clock.now < end:
        list(pool.map(step, agents))
        clock.advance(TICK)
        if int(clock.now) % 30 < TICK:
            report()


def traffic(window: list[Request], sent: int, node_minutes: float) -> dict[str, Any]:
    """What the incident cost the API: requests and bytes, in all, per node-minute and by kind."""
    return {
        "requests": len(window),
        "bytes": sent,
        "requests_per_node_minute": len(window) / node_minutes,
        "bytes_per_node_minute": sent / node_minutes,
        "requests_by_kind": dict(sorted(Counter(kind(r) for r in window).items())),
        "conflicts": sum(1 for r in window if r.status == 409),
    }


def print_run(row: dict[str, Any], node_minutes: float, outcome: str) -> None:
    """One algorithm's line (its cost and `outcome`), then its requests by kind."""
    print(
        f"{row['algorithm']:8}  {row['requests_per_node_minute']:8.3f} requests/node-minute  "
        f"{row['bytes_per_node_minute'] / 1024:10.2f} KiB/node-minute  {outcome}  ({row['wall_seconds']} s)"
    )
    for name, count in row["requests_by_kind"].items():
        print(f"          {name:48} {count / node_minutes:10.4f} per node-minute")


def finish(results: dict[str, dict[str, Any]], output: str, invariant: str, most: str, unit: str, left: str) -> int:
    """Writes the results; prints per algorithm whether the `most` it ever had stayed within its budget, and which
    left something after recovery (a row's `*_after_recovery`: `left` says what). The exit status: 1 if either."""
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(results, indent=2))
    broken = [r for r in results.values() if r[most] > r["budget"]]
    leftovers = [r for r in results.values() if any(v for k, v in r.items() if k.endswith("_after_recovery"))]
    for row in results.values():
        verdict = "OK" if row[most] <= row["budget"] else "BROKEN"
        print(f"{invariant} ({row['algorithm']}): {row[most]} <= {row['budget']} {unit}: {verdict}")
    if leftovers:
        print(f"{left} left after recovery: {[r['algorithm'] for r in leftovers]}")
    return 1 if broken or leftovers else 0


def kind(request: Request) -> str:
    method, path = request.method, request.path
    if path.startswith("/apis/"):
        return _dra_kind(request)
    if path.endswith("/node-health-device-budget"):
        metadata = " (metadata only)" if "PartialObjectMetadata" in request.accept else ""
        return f"{method} device budget{metadata}"
    if "/configmaps" in path:
        metadata = " (metadata only)" if "PartialObjectMetadata" in request.accept else ""
        return f"{method} configmap{metadata}"
    if "/events" in path:
        return f"{method} event"
    if path == "/api/v1/nodes":
        selector = request.query.get("labelSelector", [""])[0]
        return "LIST nodes (labelled tainted)" if "tainted" in selector else "LIST nodes (all)"
    return f"{method} node" + ("/status" if path.endswith("/status") else "")


def _dra_kind(request: Request) -> str:
    method, path, query = request.method, request.path, request.query
    if path.count("/") == 3:
        return "GET discovery"
    if "resourceslices" in path:
        return "LIST resourceslices (" + ("this node" if "fieldSelector" in query else "all: the count") + ")"
    if method == "GET" and path.endswith("/devicetaintrules"):
        mine = "node-health/node=" in query.get("labelSelector", [""])[0]
        return "LIST devicetaintrules (" + ("this node's" if mine else "all the agents': verification") + ")"
    return f"{method} devicetaintrule"
