"""Soak: the agent with every probe failing, run after run, for half an hour; does its memory stay flat?

    sudo python benchmarks/soak.py [--minutes 30] [--interval 2] [--window 10] [--sample-every 10]

A fake node (tests/support/fake_node.py) with every probe given something that fails: a process holding an NPU
outside any pod, nvidia-smi missing, a fatal PCIe AER count, host memory and /dev/shm below absurd minimums, a
GPU XID appended to the kernel log every run, a DNS name that does not exist, an egress target that refuses,
an NTP server 30 s off, a missing mount, a full disk by the thresholds, a write probe into a missing directory,
a stale torch lock. Every probe runs every `--interval` seconds; the agent reconciles its Node on the API
double (taint budget 0: every taint withheld, conditions and events written). Meanwhile /ready is asked every
second, /healthz every 10 s and /metrics and /status every 15 s, as pre-flights, kubelet and Prometheus would.

Every `--sample-every` seconds: the agent's RSS, open fds, threads and child processes. The result is the
slope of RSS (least squares, MiB/min) over the last `--window` minutes and over the whole run after the
first two minutes, with the first and last samples. Writes benchmarks/results/soak.json (the samples too).
Exit status 1 when the last window's slope is 0.05 MiB/min or more.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO)]

from support.fake_node import FakeNode  # noqa: E402
from support.netservers import SntpTestServer  # noqa: E402
from support.processes import free_port  # noqa: E402
from support.system import FIXTURES  # noqa: E402

MIB = 1024 * 1024
SLOPE_LIMIT = 0.05  # MiB/min
XID_RECORD = "3,{seq},{usec},-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n"


class FailingNode(FakeNode):
    """FakeNode whose every probe has something failing to find."""

    def prepare(self) -> dict[str, Any]:
        config = super().prepare()
        work = self.workdir
        sntp = SntpTestServer(skew=30.0)
        self._started.append(sntp)
        self.kmsg = work / "kmsg-soak"
        self.kmsg.write_text("")
        config["gpu"]["smi_command"] = [str(work / "no-such-nvidia-smi")]
        config["host"]["memory"] = {"min_available_mib": 10**9}
        config["host"]["shm"] = {"min_size_mib": 10**9}
        config["kernel_log"] = {"path": str(self.kmsg)}
        config["network"]["dns"]["names"] = ["absent.node-health.test"]
        config["network"]["egress"][0]["port"] = free_port()  # nobody listens there
        config["time"] = {"ntp_servers": [sntp.address]}
        storage = config["storage"]
        storage["mounts"] = [{"path": str(work / "no-such-mount"), "fstype": "*"}]
        storage["space"] = [{"path": str(work), "warn_percent": 1, "fail_percent": 1}]
        storage["write_probes"] = [{"path": str(work / "no-such-dir"), "bytes": 4096}]
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.raise_fatal_aer()
        return config


def least_squares_slope(points: list[tuple[float, float]]) -> float:
    """Slope of y over x (per unit of x) by least squares; 0 with fewer than two points."""
    if len(points) < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0


def poller(node: FakeNode, path: str, every: float, stop: threading.Event, answers: dict[str, int]) -> threading.Thread:
    def loop() -> None:
        while not stop.wait(every):
            try:
                with urllib.request.urlopen(node.url(path), timeout=5) as response:
                    response.read()
                    code = response.status
            except urllib.error.HTTPError as exc:
                exc.read()
                code = exc.code
            except OSError:
                code = 0
            answers[f"{path} {code}"] = answers.get(f"{path} {code}", 0) + 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def sample(process: psutil.Process, started: float) -> dict[str, float]:
    with process.oneshot():
        return {
            "minute": round((time.monotonic() - started) / 60.0, 3),
            "rss_mib": round(process.memory_info().rss / MIB, 3),
            "fds": process.num_fds(),
            "threads": process.num_threads(),
            "children": len(process.children(recursive=True)),
        }


def run(minutes: float, interval: float, window: float, every: float, workdir: Path) -> dict[str, Any]:
    node = FailingNode(workdir, FIXTURES, node_name="soak-node", interval=interval, kube=True)
    stop = threading.Event()
    answers: dict[str, int] = {}
    samples: list[dict[str, float]] = []
    with node:
        assert node.agent is not None
        process = psutil.Process(node.agent.pid)
        threads = [
            poller(node, "/ready", 1.0, stop, answers),
            poller(node, "/healthz", 10.0, stop, answers),
            poller(node, "/metrics", 15.0, stop, answers),
            poller(node, "/status", 15.0, stop, answers),
        ]
        started = time.monotonic()
        end = started + minutes * 60.0
        seq, next_sample, next_xid = 1, started, started
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_xid:
                with node.kmsg.open("a") as log:
                    log.write(XID_RECORD.format(seq=seq, usec=int(now * 1e6)))
                seq += 1
                next_xid += interval
            if now >= next_sample:
                samples.append(sample(process, started))
                next_sample += every
                line = samples[-1]
                print(f"  {line['minute']:6.1f} min  RSS {line['rss_mib']:7.2f} MiB  fds {line['fds']:.0f}", flush=True)
            if node.agent.poll() is not None:
                raise RuntimeError(f"the agent exited: {node.log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        stop.set()
        for thread in threads:
            thread.join(10)
        status = node.status()
        findings = status["findings"]
        results = {p["name"]: p["result"] for p in status["probes"]}
    last = [(s["minute"], s["rss_mib"]) for s in samples if s["minute"] >= minutes - window]
    settled = [(s["minute"], s["rss_mib"]) for s in samples if s["minute"] >= 2.0]
    failing = sorted({f["check"] for f in findings if f["status"] in ("fail", "unknown", "warn")})
    return {
        "minutes": minutes,
        "interval_seconds": interval,
        "window_minutes": window,
        "slope_last_window_mib_per_min": round(least_squares_slope(last), 4),
        "slope_after_2_min_mib_per_min": round(least_squares_slope(settled), 4),
        "rss_first_mib": samples[0]["rss_mib"],
        "rss_last_mib": samples[-1]["rss_mib"],
        "rss_peak_mib": max(s["rss_mib"] for s in samples),
        "fds_first_last": [samples[0]["fds"], samples[-1]["fds"]],
        "threads_first_last": [samples[0]["threads"], samples[-1]["threads"]],
        "not_ok_checks": failing,
        "probe_results_at_end": results,
        "answers": answers,
        "samples": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=2.0, help="every probe's interval, seconds")
    parser.add_argument("--window", type=float, default=10.0, help="minutes at the end the slope is judged on")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="node-health-soak-"))
    try:
        result = run(args.minutes, args.interval, args.window, args.sample_every, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out = REPO / "benchmarks" / "results" / "soak.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    with contextlib.suppress(Exception):
        print(f"wrote {out.relative_to(REPO)}")
    return 0 if result["slope_last_window_mib_per_min"] < SLOPE_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
