#!/usr/bin/env python3
"""The cost of the per-chip NPU checks (npu.roce through hccn_tool, npu.grade and npu.ecc through npu-smi) on a
16-NPU fake node, against the npu probe's own run on the same node in the same run (the named baseline).

The node: /dev/davinci0..15 (mknod), the fake npu-smi of tests/support/fake_npu_smi.py serving the 16-chip A3
table of benchmarks/accelerator_node.py with `-t health` and `-t ecc` per chip, and the fake hccn_tool of
tests/support/fake_hccn_tool.py serving the sourced healthy outputs. Those fakes are Python scripts: each call
costs an interpreter start (~35 ms of CPU here), far more than the agent's own work per call. So every case is
measured twice in the same run: with the Python fakes, and with thin fakes (a /bin/sh script that execs `cat` of
the same outputs, rendered beforehand), which leave the agent's own cost per child (fork, exec, pipes, deadline,
parsing, judging) plus a minimal process. The budget is judged on the thin fakes; a real hccn_tool's own latency
(a DCMI query to the chip's firmware) is not measured here.

    sudo python3 benchmarks/npu_links.py [--repeat 5]

Reported per case: wall time (median), CPU seconds of the agent and its children (median), children spawned.
Cases: the baseline npu probe run; npu.roce's first run (every read), a steady run at the default intervals
(`link` of every chip), a steady run with every read due (capped at npu.hccn_max_calls_per_run); npu.grade;
npu.ecc; and hccn_tool children per 60 s interval over a simulated hour at the default intervals.
Budget (DESIGN.md, interconnect checks): a whole steady run <= 1 s wall and <= 32 short-lived children per
interval. Exit 0 when met, 1 when not.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from support.fake_hccn_tool import FakeHccn  # noqa: E402
from support.fake_npu_smi import FakeSmi, context, make_dev, npu_fixture  # noqa: E402

from benchmarks.accelerator_node import a3_info_table, a3_mapping_table  # noqa: E402
from probes.base import Probe, ProbeContext  # noqa: E402
from probes.npu.ecc import EccProbe  # noqa: E402
from probes.npu.grade import GradeProbe  # noqa: E402
from probes.npu.npu import NpuProbe  # noqa: E402
from probes.npu.roce import RoceProbe  # noqa: E402

CHIPS, CARDS, DIES = 16, 8, 2
WALL_BUDGET_S, CHILDREN_BUDGET = 1.0, 32


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(run: Callable[[], Any], count: Callable[[], int], repeat: int) -> dict[str, float]:
    walls, cpus, children = [], [], []
    for _ in range(repeat):
        before_cpu, before_count = cpu_seconds(), count()
        started = time.perf_counter()
        run()
        walls.append(time.perf_counter() - started)
        cpus.append(cpu_seconds() - before_cpu)
        children.append(count() - before_count)
    return {
        "wall_s": round(statistics.median(walls), 3),
        "cpu_s": round(statistics.median(cpus), 3),
        "children": statistics.median(children),
    }


THIN = """#!/bin/sh
echo "$*" >> "{directory}.log"
IFS=_
exec cat "{directory}/$*"
"""


def thin_tool(path: Path, outputs: dict[str, str]) -> Path:
    """A /bin/sh tool printing outputs[" ".join(args)] (rendered to files named by the args joined with `_`)."""
    directory = path.parent / f"{path.name}-outputs"
    directory.mkdir(parents=True)
    for args, text in outputs.items():
        (directory / args.replace(" ", "_")).write_text(text)
    (path.parent / f"{path.name}-outputs.log").write_text("")
    path.write_text(THIN.format(directory=directory))
    path.chmod(0o755)
    return path


def hccn_outputs() -> dict[str, str]:
    from support.fake_hccn_tool import FIXTURES, HEALTHY

    return {
        f"-i {n} -{verb} -g": (FIXTURES / answer["file"]).read_text().replace("devid 0]", f"devid {n}]")
        for n in range(CHIPS)
        for verb, answer in HEALTHY.items()
    }


def smi_responses() -> dict[str, dict[str, Any]]:
    health = npu_fixture("910a-t-health-OK-i0-c0-faultdiag.txt").read_text()
    ecc = npu_fixture("910a-t-ecc-i1-ddr-and-hbm-docexample-mindcluster.txt").read_text()
    responses: dict[str, dict[str, Any]] = {
        "info": {"stdout": a3_info_table()},
        "info -m": {"stdout": a3_mapping_table()},
    }
    for card in range(CARDS):
        for die in range(DIES):
            responses[f"info -t health -i {card} -c {die}"] = {"stdout": health}
            responses[f"info -t ecc -i {card} -c {die}"] = {"stdout": ecc}
    return responses


def simulated_children(intervals: int = 60) -> tuple[float, int]:
    """hccn_tool calls per 60 s run at the default intervals over `intervals` runs after the first: (mean, max)."""
    from probes.npu.chipmap import ChipRef
    from probes.npu.config import NpuConfig
    from probes.npu.hccn import Call

    probe, settings = RoceProbe(), NpuConfig()
    chips = tuple(ChipRef(n, n, n // DIES, n % DIES) for n in range(CHIPS))
    counts = []
    for run in range(intervals + 1):
        now = run * 60.0
        due = probe.due(settings, chips, now)
        probe._calls.update({key: (Call(key[0], key[1], ""), now) for key in due})
        if run:
            counts.append(len(due))
    return statistics.mean(counts), max(counts)


def cases(
    tmp: Path, dev: Path, smi_command: list[str], hccn_command: list[str], count: Callable[[], int], repeat: int
) -> dict[str, dict[str, float]]:
    def ctx(**npu: Any) -> ProbeContext:
        settings = {
            "state_dir": str(tmp / "state"),
            "hccn_conf": str(tmp / "hccn.conf"),
            "smi_command": smi_command,
            "hccn_command": hccn_command,
            **npu,
        }
        return context(tmp, settings, dev=dev, timeout=30.0)

    def once(probe: Probe, **npu: Any) -> Callable[[], Any]:
        return lambda: probe.run(ctx(**npu))

    results: dict[str, dict[str, float]] = {}
    results["baseline: npu probe"] = measure(once(NpuProbe()), count, repeat)
    results["npu.roce first run"] = measure(lambda: RoceProbe().run(ctx()), count, repeat)
    steady = RoceProbe()
    steady.run(ctx())
    results["npu.roce steady (defaults)"] = measure(once(steady), count, repeat)
    every = {f"{k}_interval_seconds": 0 for k in ("link_stat", "net_health", "address", "optical")}
    busy = RoceProbe()
    busy.run(ctx(**every))
    results["npu.roce steady (all due, capped)"] = measure(once(busy, **every), count, repeat)
    results["npu.grade"] = measure(once(GradeProbe()), count, repeat)
    results["npu.ecc"] = measure(once(EccProbe()), count, repeat)
    baseline = results["baseline: npu probe"]
    for figures in results.values():
        figures["wall_vs_baseline"] = round(figures["wall_s"] / baseline["wall_s"], 2)
        figures["cpu_vs_baseline"] = round(figures["cpu_s"] / baseline["cpu_s"], 2)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="npu-links-") as tmp_name:
        tmp = Path(tmp_name)
        smi, hccn = FakeSmi(tmp / "smi"), FakeHccn(tmp / "hccn")
        smi.answer(smi_responses())
        dev = make_dev(tmp / "dev", {f"davinci{n}": (236, n) for n in range(CHIPS)})

        def python_calls() -> int:
            return len(smi.calls()) + len(hccn.calls())

        results["python fakes"] = cases(
            tmp, dev, [str(smi.bin / "npu-smi")], [str(hccn.tool)], python_calls, args.repeat
        )
        outputs = {k: v.get("stdout", "") for k, v in smi_responses().items()}
        thin_smi = thin_tool(tmp / "thin" / "npu-smi", outputs)
        thin_hccn = thin_tool(tmp / "thin" / "hccn_tool", hccn_outputs())
        logs = [tmp / "thin" / "npu-smi-outputs.log", tmp / "thin" / "hccn_tool-outputs.log"]

        def thin_calls() -> int:
            return sum(len(log.read_text().splitlines()) for log in logs)

        results["thin fakes"] = cases(tmp, dev, [str(thin_smi)], [str(thin_hccn)], thin_calls, args.repeat)
    mean, most = simulated_children()
    results["hccn_tool children per 60 s interval (simulated hour, defaults)"] = {"mean": round(mean, 1), "max": most}
    print(json.dumps(results, indent=2))
    thin = results["thin fakes"]
    worst = thin["npu.roce steady (all due, capped)"]
    ok = worst["wall_s"] <= WALL_BUDGET_S and worst["children"] <= CHILDREN_BUDGET and most <= CHILDREN_BUDGET
    print(
        f"budget (thin fakes: a steady run <= {WALL_BUDGET_S:g} s wall, <= {CHILDREN_BUDGET} children per interval): "
        + ("met" if ok else "NOT met")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
