"""Agent footprint at default intervals: peak RSS and average CPU of `node-health run --no-kube`.

    python benchmarks/footprint.py [--seconds 600] [--config FILE]

Baseline in the same run: a bare Python interpreter that imports the same third-party packages and
sleeps (the floor no agent written in Python can go under). Budget (DESIGN.md): peak RSS <= 80 MiB and
<= 1% of one core on average, node-problem-detector's own limits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FLOOR = "import prometheus_client, pydantic, yaml, psutil, time; print('ready', flush=True); time.sleep(86400)"


def usage(pid: int) -> tuple[float, float]:
    """(peak RSS MiB, CPU seconds) of a live process."""
    with open(f"/proc/{pid}/status") as fh:
        hwm = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return hwm / 1024, (int(fields[11]) + int(fields[12])) / ticks


def observe(argv: list[str], seconds: float) -> dict[str, float]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        time.sleep(seconds)
        rss, cpu = usage(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {
        "peak_rss_mib": round(rss, 1),
        "cpu_seconds": round(cpu, 2),
        "avg_cpu_percent": round(100 * cpu / seconds, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--config", help="agent config (default: built-in defaults, port 19100)")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "footprint.json"))
    args = parser.parse_args()
    config = args.config
    if config is None:
        config = "/tmp/node-health-footprint.yaml"
        Path(config).write_text("http: {address: 127.0.0.1, port: 19100}\n")
    agent = observe([sys.executable, "-m", "agent.cli", "run", "--no-kube", "--config", config], args.seconds)
    floor = observe([sys.executable, "-c", FLOOR], min(args.seconds, 30))
    print(f"agent ({args.seconds:.0f}s): peak RSS {agent['peak_rss_mib']} MiB, average CPU {agent['avg_cpu_percent']}%")
    print(f"baseline (python + same imports): peak RSS {floor['peak_rss_mib']} MiB")
    print(
        f"agent RSS / baseline: {agent['peak_rss_mib'] / floor['peak_rss_mib']:.2f}x; budget 80 MiB, 1% CPU: "
        + ("within" if agent["peak_rss_mib"] <= 80 and agent["avg_cpu_percent"] <= 1 else "OVER")
    )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps({"agent": agent, "baseline_python_imports": floor, "seconds": args.seconds}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
