"""Agent footprint, profile by profile: peak RSS and average CPU, what the DaemonSet's requests and limits rest on.

    sudo python benchmarks/footprint.py [--seconds 600] [--short-seconds 180] [--short-interval 5]
                                        [--processes 2000] [--fds 50] [--profiles NAME,...] [--cpu-limit 500m]

Profiles, in one run (each `--seconds` long unless said otherwise):

- baseline: a bare Python interpreter that imports the agent's third-party packages (prometheus_client,
  pydantic, yaml, psutil) and sleeps, the floor no agent written in Python can go under (30 s);
- baseline-kube: the same plus the `kubernetes` client (30 s);
- default: `node-health run --no-kube` with the built-in defaults, on this host as it is;
- a3-kube: the fake 16-NPU + 8-GPU node of benchmarks/accelerator_node.py (fake npu-smi for 16 chips, the fake
  NVML library for 8 GPUs, mknod'ed device nodes, the shipped config's logging and kubernetes sections),
  Kubernetes on, the agent reconciling its Node on the API double (tests/support/kube_double.py), the device
  plugins' ledger on (a fake kubelet's PodResources socket: npu and gpu read it in a child every run); every
  probe at its default interval;
- a3-kube-no-ledger: a3-kube without the PodResources socket (kubernetes.pod_resources_socket empty), the
  baseline of the ledger's cost;
- a3-kube-busy: a3-kube on a busy node: PROCESSES more processes holding FDS open files each (so every holder
  scan, npu's and gpu's, reads ~PROCESSES x FDS fds), default intervals;
- a3-kube-short: a3-kube-busy with every probe every `--short-interval` seconds (`--short-seconds` long), so each
  probe runs many times: the peak.

For each: the agent's peak RSS (VmHWM), its RSS at the end, the peak of the PSS summed over the agent and its
children (sampled every 0.5 s: forked scanners, npu-smi, each shared page counted once, as the memory cgroup
of the pod charges it), and the average CPU of the agent and its children over the measured window, which
starts once the agent serves and every probe has run once (startup CPU is reported apart). The fake tools are Python
scripts: their CPU (interpreter start) is in the children's share. Probe runs by result come from /metrics; the
a3 profiles also poll /status every 15 s for the holder scans' seconds and completeness. With `--cpu-limit`
the a3 agents run in a cgroup with that CPU quota (benchmarks/scan_quota.py), as in a pod with that limit.
Results: benchmarks/results/footprint.json. Needs root (mknod, cgroups) and gcc (the fake NVML library).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
from scan_quota import millicores

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "tests"), str(REPO)]

from support.processes import stop  # noqa: E402

FLOOR = "import prometheus_client, pydantic, yaml, psutil, time; print('ready', flush=True); time.sleep(86400)"
FLOOR_KUBE = FLOOR.replace("psutil,", "psutil, kubernetes,")
PROFILES = ("baseline", "baseline-kube", "default", "a3-kube", "a3-kube-no-ledger", "a3-kube-busy", "a3-kube-short")
MIB = 1024 * 1024


def cpu_split(pid: int) -> tuple[float, float]:
    """(CPU of the process itself, CPU of the children it has reaped: its scanners and the tools it ran), in
    seconds: utime + stime and cutime + cstime of /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = [int(value) for value in handle.read().rsplit(")", 1)[1].split()[11:15]]
    tick = os.sysconf("SC_CLK_TCK")
    return (fields[0] + fields[1]) / tick, (fields[2] + fields[3]) / tick


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmHWM:")) / 1024


def tree_memory_mib(pid: int) -> tuple[float, float]:
    """(RSS of the process, PSS summed over it and its descendants) now, in MiB. PSS splits a page shared by
    n processes (a forked scanner's copy-on-write pages) into n parts, so the sum counts each page once, as the
    memory cgroup charges it."""
    try:
        process = psutil.Process(pid)
        own = process.memory_full_info()
        total = own.pss
        for child in process.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += child.memory_full_info().pss
    except psutil.Error:
        return 0.0, 0.0
    return own.rss / MIB, total / MIB


def watch(
    pid: int, seconds: float, alive: Callable[[], bool], poll: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Sample the process tree for `seconds`; its CPU over the window, peak and final RSS. `poll` is called
    every 15 s (it asks the agent something, which costs the agent a little CPU)."""
    started_split, started = cpu_split(pid), time.monotonic()
    started_cpu = sum(started_split)
    tree_peak, polled = 0.0, started
    while time.monotonic() - started < seconds:
        if not alive():
            raise RuntimeError(f"process {pid} exited during the measurement")
        tree_peak = max(tree_peak, tree_memory_mib(pid)[1])
        if poll is not None and time.monotonic() - polled >= 15:
            poll()
            polled = time.monotonic()
        time.sleep(0.5)
    window = time.monotonic() - started
    own, children = (end - start for end, start in zip(cpu_split(pid), started_split, strict=True))
    used = own + children
    return {
        "seconds": round(window, 1),
        "peak_rss_mib": round(peak_rss_mib(pid), 1),
        "end_rss_mib": round(tree_memory_mib(pid)[0], 1),
        "tree_peak_pss_mib": round(tree_peak, 1),
        "startup_cpu_seconds": round(started_cpu, 2),
        "cpu_seconds": round(used, 2),
        "avg_cpu_millicores": round(1000 * used / window, 1),
        "agent_cpu_millicores": round(1000 * own / window, 1),  # the agent process alone, its children apart
    }


@contextlib.contextmanager
def started(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        yield proc
    finally:
        stop(proc)


def floor_profile(code: str, seconds: float) -> dict[str, Any]:
    with started([sys.executable, "-c", code]) as proc:
        time.sleep(5)  # the imports
        return watch(proc.pid, seconds, lambda: proc.poll() is None)


def probe_runs(metrics_url: str) -> dict[str, dict[str, int]]:
    """nodehealth_probe_runs_total by probe and result."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    runs: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "nodehealth_probe_runs_total" and sample.value:
                runs.setdefault(sample.labels["probe"], {})[sample.labels["result"]] = int(sample.value)
    return runs


def wait_serving(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the agent exited ({proc.returncode})")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=2).close()
            return
        time.sleep(0.2)
    raise RuntimeError(f"the agent did not serve {url} within {timeout:g}s")


def default_profile(seconds: float, work: Path) -> dict[str, Any]:
    config = work / "default.yaml"
    config.write_text("http: {address: 127.0.0.1, port: 19100}\n")
    with started([sys.executable, "-m", "agent.cli", "run", "--no-kube", "--config", str(config)]) as proc:
        wait_serving("http://127.0.0.1:19100/healthz", proc)
        time.sleep(10)  # the first run of every probe
        measured = watch(proc.pid, seconds, lambda: proc.poll() is None)
        measured["probe_runs"] = probe_runs("http://127.0.0.1:19100/metrics")
    return measured


class ScanWatch:
    """The holder scans' seconds and completeness, as the npu.holders and gpu.holders findings report them."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status
        self.seconds: dict[str, float] = {}
        self.incomplete: dict[str, int] = {}

    def __call__(self) -> None:
        incomplete: set[str] = set()
        for finding in self.status()["findings"]:
            family = finding["check"].split(".")[0]
            observed = finding.get("observed") or {}
            if not finding["check"].endswith(".holders") or "scan_seconds" not in observed:
                continue
            self.seconds[family] = max(self.seconds.get(family, 0.0), observed["scan_seconds"])
            if observed.get("unscanned") or observed.get("unreadable") or observed.get("scan_error"):
                incomplete.add(family)
        for family in incomplete:  # polls that found the family's last scan incomplete
            self.incomplete[family] = self.incomplete.get(family, 0) + 1

    def report(self) -> dict[str, Any]:
        return {"max_scan_seconds": self.seconds, "polls_seeing_an_incomplete_scan": self.incomplete}


def a3_profile(
    seconds: float,
    work: Path,
    interval: float | None,
    farm: tuple[int, int] | None,
    cpu_limit: int | None,
    ledger: bool = True,
) -> dict[str, Any]:
    from accelerator_node import AcceleratorNode
    from scan_quota import CpuQuota, HolderFarm
    from support.system import FIXTURES

    with contextlib.ExitStack() as stack:
        if farm:
            stack.enter_context(HolderFarm(work / "farm", *farm))
        procs = stack.enter_context(CpuQuota(cpu_limit)).procs if cpu_limit else None
        node = stack.enter_context(
            AcceleratorNode(work / "node", FIXTURES, interval=interval, cgroup_procs=procs, ledger=ledger)
        )
        assert node.agent is not None and node.api is not None
        agent = node.agent
        scans = ScanWatch(node.status)
        measured = watch(agent.pid, seconds, lambda: agent.poll() is None, scans)
        scans()
        measured.update(scans.report())
        measured["probe_runs"] = probe_runs(node.url("/metrics"))
        measured["cpu_limit"] = f"{cpu_limit}m" if cpu_limit else "none"
        measured["node_writes"] = len(node.api.node_writes(node.node_name))
        measured["interval_seconds"] = interval or "default"
        measured["extra_processes"] = f"{farm[0]} x {farm[1]} fds" if farm else "none"
        measured["ledger"] = "on" if ledger else "off"
        if node.kubelet is not None:
            measured["ledger_calls"] = node.kubelet.calls
    return measured


def run_profile(name: str, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"footprint-{name}-"))
    farm = (args.processes, args.fds)
    try:
        if name == "baseline":
            return floor_profile(FLOOR, min(args.seconds, 30))
        if name == "baseline-kube":
            return floor_profile(FLOOR_KUBE, min(args.seconds, 30))
        if name == "default":
            return default_profile(args.seconds, work)
        limit = millicores(args.cpu_limit) if args.cpu_limit else None
        if name == "a3-kube":
            return a3_profile(args.seconds, work, None, None, limit)
        if name == "a3-kube-no-ledger":
            return a3_profile(args.seconds, work, None, None, limit, ledger=False)
        if name == "a3-kube-busy":
            return a3_profile(args.seconds, work, None, farm, limit)
        return a3_profile(args.short_seconds, work, args.short_interval, farm, limit)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def describe(name: str, result: dict[str, Any]) -> str:
    runs = result.get("probe_runs")
    fewest = min(((sum(r.values()), p) for p, r in runs.items()), default=None) if runs else None
    not_ok = {p: {k: v for k, v in r.items() if k not in ("ok", "skip")} for p, r in (runs or {}).items()}
    not_ok = {p: r for p, r in not_ok.items() if r}
    line = (
        f"{name:<14} {result['seconds']:>6.0f}s  peak RSS {result['peak_rss_mib']:>6.1f} MiB  "
        f"(end {result['end_rss_mib']:.1f}, tree PSS peak {result['tree_peak_pss_mib']:.1f})  "
        f"CPU {result['avg_cpu_millicores']:>6.1f}m (agent alone {result['agent_cpu_millicores']:.1f}m)"
    )
    if result.get("max_scan_seconds"):
        incomplete = result["polls_seeing_an_incomplete_scan"] or 0
        line += f"  scans: {result['max_scan_seconds']}s max, incomplete in {incomplete} polls"
    if fewest:
        line += f"  fewest runs: {fewest[1]} {fewest[0]}"
    if not_ok:
        line += f"  not ok: {not_ok}"
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600, help="window of the default-interval profiles")
    parser.add_argument("--short-seconds", type=float, default=180)
    parser.add_argument("--short-interval", type=float, default=5.0)
    parser.add_argument("--processes", type=int, default=2000, help="extra processes on the busy profiles")
    parser.add_argument("--fds", type=int, default=50, help="open files of each extra process")
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--cpu-limit", help="run the a3 agents in a cgroup with this CPU quota (e.g. 250m)")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "footprint.json"))
    args = parser.parse_args()
    names = [name.strip() for name in args.profiles.split(",") if name.strip()]
    unknown = sorted(set(names) - set(PROFILES))
    if unknown:
        parser.error(f"unknown profiles {unknown}; known: {', '.join(PROFILES)}")
    results: dict[str, Any] = {}
    for name in names:
        results[name] = run_profile(name, args)
        print(describe(name, results[name]), flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    keys = ("seconds", "short_seconds", "short_interval", "processes", "fds", "cpu_limit")
    settings = {key: getattr(args, key) for key in keys}
    Path(args.output).write_text(json.dumps({"settings": settings, "profiles": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
