"""What one read of the device plugins' ledger costs: the reader child kept serving (what the agent does) against a
child started for each read (the baseline), on the fake kubelet of tests/support/fake_kubelet.py.

    python benchmarks/ledger_read.py [--reads 20] [--chips 16]

For each way: CPU of the reader child per read (user + system), wall time per read (median), the child's RSS.
The agent process itself never imports the gRPC client; these figures are its child's. Results:
benchmarks/results/ledger_read.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support.fake_kubelet import FakeKubelet  # noqa: E402

from probes.runtime.podresources.client import ReaderProcess, read_once  # noqa: E402

MIB = 1024 * 1024


def resident(socket: str, reads: int) -> dict[str, Any]:
    reader = ReaderProcess()
    try:
        assert read_once(socket, 2.0, reader).ok  # starts the child: not counted
        assert reader._proc is not None
        child = psutil.Process(reader._proc.pid)
        cpu_before = sum(child.cpu_times()[:2])
        walls = []
        for _ in range(reads):
            started = time.monotonic()
            assert read_once(socket, 2.0, reader).ok
            walls.append(time.monotonic() - started)
        cpu = sum(child.cpu_times()[:2]) - cpu_before
        return {
            "cpu_ms_per_read": round(1000 * cpu / reads, 1),
            "wall_ms_median": round(1000 * statistics.median(walls), 1),
            "child_rss_mib": round(child.memory_info().rss / MIB, 1),
            "child_starts": reader.starts,
        }
    finally:
        reader.close()


def one_child_per_read(socket: str, reads: int) -> dict[str, Any]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    walls = []
    for _ in range(reads):
        started = time.monotonic()
        assert read_once(socket, 2.0).ok
        walls.append(time.monotonic() - started)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "cpu_ms_per_read": round(1000 * cpu / reads, 1),
        "wall_ms_median": round(1000 * statistics.median(walls), 1),
        "child_peak_rss_mib": round(after.ru_maxrss / 1024, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reads", type=int, default=20)
    parser.add_argument("--chips", type=int, default=16)
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "ledger_read.json"))
    args = parser.parse_args()
    with FakeKubelet(rate=1000, burst=1000) as kubelet:  # the limit is not what is measured here
        kubelet.offer("huawei.com/Ascend910", *(f"Ascend910-{chip}" for chip in range(args.chips)))
        for chip in range(0, args.chips, 2):
            kubelet.allocate("team-a", f"train-{chip}", "worker", "huawei.com/Ascend910", f"Ascend910-{chip}")
        results = {
            "resident_child": resident(kubelet.socket, args.reads),
            "child_per_read": one_child_per_read(kubelet.socket, args.reads),
        }
    results["load_average"] = [round(x, 1) for x in psutil.getloadavg()]
    for name, figures in results.items():
        print(f"{name:<16} {figures}", flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"settings": vars(args), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
