#!/usr/bin/env python3
"""The npu probe's device-holder scan under a CPU limit: does it finish within its deadline?

A CPU limit in a pod spec becomes a CFS quota on the pod's cgroup: `limit` millicores are `limit x 100` us of
CPU time per 100 ms period, for every process of the container together (the agent and the scanners it forks).
This runs the npu probe exactly as the agent does (`agent.scheduler.execute`, the probe's own timeout, the scan
in forked scanners through probes/runtime/holders.py and probes/runtime/fdscan.py) in a fresh process moved into
a cgroup with that quota (cgroup v1 `cpu.cfs_quota_us`, else cgroup v2 `cpu.max`), on a host with PROCESSES
extra processes holding FDS open files each (benchmarks/holder_scan.py's spawner), one of them holding a
mknod'ed copy of davinci0 outside any pod. npu-smi is tests/support/fake_npu_smi.py answering for 16 chips.

    sudo python benchmarks/scan_quota.py [--processes 2000] [--fds 50] [--limits 100m,250m,500m] [--repeat 3]
                                         [--rivals 0]

Per limit it prints the scan's seconds against the deadline the probe gave it, the probe's seconds against
its timeout, the CPU the run took, and whether the scan was complete and found the planted holder. With
`--rivals N`, N more whole-/proc scans run beside each probe run in the same cgroup, as the gpu probe's and
network.ports' do in the agent. The process confines its children as the agent does (probes/runtime/cpulimit.py:
the scanners in a work cgroup with the limit less the server's headroom; NODE_HEALTH_CPU_CONFINE=off for the
old way). Results: benchmarks/results/scan_quota.json.
Needs root (cgroups, mknod). Every spawned process is killed and reaped, every cgroup removed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HOLDER_SCAN = REPO / "benchmarks" / "holder_scan.py"
FAKE_SMI = REPO / "tests" / "support" / "fake_npu_smi.py"
PERIOD_US = 100_000
V1_CPU = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")
NOBODYS_MAJOR = 240  # a device number no driver registers: what rival scans look for, and never find


def millicores(text: str) -> int:
    """A Kubernetes CPU quantity (`250m`, `0.25`, `1`) in millicores."""
    value = text.strip()
    try:
        number = int(value[:-1]) if value.endswith("m") else round(float(value) * 1000)
    except ValueError:
        raise ValueError(f"{text!r} is not a CPU quantity like 250m or 0.25") from None
    if number <= 0:
        raise ValueError(f"{text!r}: a CPU limit must be above 0")
    return number


def cgroup_support() -> str:
    """Why a CPU-quota cgroup cannot be made here; empty when it can."""
    if os.geteuid() != 0:
        return "not root"
    if (V1_CPU / "cpu.cfs_quota_us").is_file():
        return ""
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.is_file() and "cpu" in controllers.read_text().split():
        return ""
    return "no cgroup v1 cpu hierarchy and no cgroup v2 cpu controller"


class CpuQuota:
    """A cgroup whose CFS quota is `millicores` of one CPU per 100 ms period; removed on exit."""

    def __init__(self, millicores: int) -> None:
        self.millicores = millicores
        self.quota_us = millicores * PERIOD_US // 1000
        self.v1 = (V1_CPU / "cpu.cfs_quota_us").is_file()
        self.parent = V1_CPU if self.v1 else V2_ROOT
        self.path = self.parent / f"node-health-bench-{os.getpid()}-{millicores}m"

    def __enter__(self) -> CpuQuota:
        self.path.mkdir()
        try:
            if self.v1:
                (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(self.quota_us))
            else:
                subtree = self.parent / "cgroup.subtree_control"
                if "cpu" not in subtree.read_text().split():
                    subtree.write_text("+cpu")
                (self.path / "cpu.max").write_text(f"{self.quota_us} {PERIOD_US}")
        except BaseException:
            self.path.rmdir()
            raise
        return self

    @property
    def procs(self) -> Path:
        """Write a PID here to move that process (all its threads) into the cgroup; its children inherit it."""
        return self.path / "cgroup.procs"

    def add(self, pid: int) -> None:
        self.procs.write_text(str(pid))

    def throttling(self) -> dict[str, int]:
        """Periods, throttled periods and throttled microseconds so far (cpu.stat)."""
        fields = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if " " in line)
        throttled_us = int(fields.get("throttled_time", 0)) // 1000 if self.v1 else int(fields.get("throttled_usec", 0))
        return {
            "periods": int(fields.get("nr_periods", 0)),
            "throttled_periods": int(fields.get("nr_throttled", 0)),
            "throttled_us": throttled_us,
        }

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        deadline = time.monotonic() + 10
        while True:
            # The agent's own work and server cgroups (probes/runtime/cpulimit.py) first, then this one.
            nested = sorted((p for p in self.path.iterdir() if p.is_dir()), key=lambda p: -len(p.parts))
            for group in [*nested, self.path]:
                with contextlib.suppress(OSError):
                    for pid in (group / "cgroup.procs").read_text().split():  # still exiting: back to the root
                        with contextlib.suppress(OSError):
                            (self.parent / "cgroup.procs").write_text(pid)
            try:
                for group in nested:
                    with contextlib.suppress(FileNotFoundError):
                        group.rmdir()
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


class HolderFarm:
    """`processes` processes with `fds` open files each (pipes, sockets, /dev/null, regular files); one of them,
    `holder_pid`, also holds a mknod'ed copy of davinci0 (/dev/full's device number) outside any pod."""

    def __init__(self, work: Path, processes: int, fds: int) -> None:
        self.work, self.processes, self.fds = work, processes, fds
        self.holder_pid = 0
        self.children: list[int] = []
        self.spawn_seconds = 0.0
        self._spawner: subprocess.Popen[str] | None = None

    def __enter__(self) -> HolderFarm:
        (self.work / "container-dev").mkdir(parents=True)
        (self.work / "files").mkdir()
        os.mknod(self.work / "container-dev" / "davinci0", 0o666 | stat.S_IFCHR, os.stat("/dev/full").st_rdev)
        for index in range(16):
            (self.work / "files" / f"f{index}").write_bytes(b"x")
        started = time.monotonic()
        argv = [sys.executable, str(HOLDER_SCAN), "--spawner", str(self.work), "--processes", str(self.processes)]
        argv += ["--fds", str(self.fds), "--holders", "0"]
        self._spawner = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self._spawner.stdout is not None
        line = self._spawner.stdout.readline()
        try:
            info = json.loads(line)
            self.holder_pid, self.children = info["roles"]["copy"][0], info["children"]
        except (ValueError, KeyError, IndexError):
            self.__exit__(None, None, None)
            raise RuntimeError(f"the holder processes did not start (spawner said {line[:200]!r})") from None
        self.spawn_seconds = time.monotonic() - started
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        spawner, self._spawner = self._spawner, None
        if spawner is None:
            return
        spawner.terminate()  # it kills and reaps its children
        try:
            spawner.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(spawner.pid, signal.SIGKILL)
            spawner.wait(timeout=10)


def host_fds() -> int:
    """Open fds of every process on this host now."""
    total = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):  # exited meanwhile
                total += len(os.listdir(f"/proc/{name}/fd"))
    return total


def prepare_npu_node(work: Path) -> tuple[Path, Path]:
    """(dev dir with davinci0..15 and davinci_manager, the fake npu-smi's spec for 16 chips)."""
    from accelerator_node import build_dev, write_npu_smi_spec

    build_dev(work / "dev")
    return work / "dev", write_npu_smi_spec(work)


def run_npu_probe(quota: CpuQuota, dev: Path, spec: Path, repeat: int = 1, rivals: int = 0) -> list[dict[str, Any]]:
    """Run the npu probe `repeat` times in a fresh process inside `quota`; one summary per run (`summarize`).
    With `rivals`, that many other whole-/proc scans run alongside each probe run, in the same cgroup."""
    argv = [sys.executable, __file__, "--probe-child", str(quota.procs), str(dev), str(spec), str(repeat), str(rivals)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "benchmarks"), str(REPO / "tests")])}
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=120 + 30 * repeat)
    if done.returncode != 0:
        raise RuntimeError(f"the npu probe run failed ({done.returncode}): {done.stderr[-2000:]}")
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def probe_child(procs: str, dev: str, spec: str, repeat: int, rivals: int) -> None:
    """In the child: load the agent's modules, join the cgroup, run the npu probe as the scheduler does."""
    from agent.config import parse_config
    from agent.scheduler import execute
    from probes.npu.config import NpuConfig
    from probes.npu.npu import NpuProbe
    from probes.runtime import cpulimit
    from probes.runtime.host import Host

    config = parse_config({"npu": {"smi_command": [sys.executable, str(FAKE_SMI), spec]}})
    probe_timeout = config.schedule("npu").timeout_seconds or NpuProbe.default_timeout
    host = Host(dev=dev)
    probe = NpuProbe()  # one instance for every run, as in the agent (it caches `npu-smi info -m`)
    Path(procs).write_text(str(os.getpid()))
    confinement = cpulimit.confine()  # as run_daemon does: the scanners in the work cgroup (NODE_HEALTH_CPU_CONFINE)
    runs = []
    for _ in range(repeat):
        deadline = probe.scan_deadline(config.section(NpuConfig), probe_timeout)  # the scan runs first
        before = _cpu_seconds()
        started = time.monotonic()
        others = start_rival_scans(host, rivals)
        result, findings, _samples = execute(probe, host, config, probe_timeout)
        seconds = time.monotonic() - started
        for thread in others:
            thread.join()
        run = summarize(result, [f.to_dict() for f in findings])
        run.update(probe_seconds=round(seconds, 3), probe_timeout=probe_timeout, scan_deadline=round(deadline, 3))
        run["cpu_seconds"] = round(_cpu_seconds() - before, 3)
        run["confinement"] = confinement.status()
        runs.append(run)
    print(json.dumps(runs))


def start_rival_scans(host: Any, count: int) -> list[threading.Thread]:
    """Whole-/proc scans sharing the quota with the probe's, as the gpu probe's (fds and maps, a device scan)
    does in the agent. There they take the same lock and run one after the other; here they run at once, each
    with a share of the quota: either way the npu scan finishes about when both have read everything."""
    from probes.runtime.procfs import ScanError, scan_open_files

    def scan(key: str) -> None:
        with contextlib.suppress(ScanError):
            scan_open_files(host, rdevs={os.makedev(NOBODYS_MAJOR, 0)}, timeout=120, key=key, mappings=True)

    threads = [threading.Thread(target=scan, args=(f"rival-{index}",), daemon=True) for index in range(count)]
    for thread in threads:
        thread.start()
    return threads


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def summarize(result: str, findings: list[dict[str, Any]]) -> dict[str, Any]:
    """What a run says about the scan: the node-wide npu.holders finding's scan data and every holder found."""
    holders = [f for f in findings if f["check"] == "npu.holders"]
    node_wide = next((f for f in holders if f["subject"] == ""), {})
    observed = node_wide.get("observed", {})
    return {
        "result": result,
        "complete": bool(node_wide) and "unscanned" not in observed and "unreadable" not in observed,
        "scan_seconds": observed.get("scan_seconds"),
        "processes_scanned": observed.get("processes_scanned"),
        "unscanned": observed.get("unscanned", 0),
        "node_wide": [node_wide.get("status"), node_wide.get("reason")],
        "message": node_wide.get("message", ""),
        "held": {
            f["observed"]["device_node"]: {
                "status": f["status"],
                "reason": f["reason"],
                "pids": sorted(h["pid"] for h in f["observed"].get("holders", [])),
            }
            for f in holders
            if f["subject"] and f["observed"].get("holders")
        },
        "chip_statuses": sorted({f["status"] for f in holders if f["subject"]}),
    }


def measure(args: argparse.Namespace, limits: list[int]) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="scan-quota-"))
    rows = []
    try:
        dev, spec = prepare_npu_node(work)
        with HolderFarm(work / "farm", args.processes, args.fds) as farm:
            fds = host_fds()
            print(f"{args.processes} processes x {args.fds} fds spawned in {farm.spawn_seconds:.1f}s", flush=True)
            print(f"{len(os.listdir('/proc'))} /proc entries, {fds} fds open on the host", flush=True)
            for limit in limits:
                with CpuQuota(limit) as quota:
                    runs = run_npu_probe(quota, dev, spec, args.repeat, args.rivals)
                    throttling = quota.throttling()
                for run in runs:
                    run["found_planted_holder"] = farm.holder_pid in run["held"].get("davinci0", {}).get("pids", [])
                rows.append({"cpu_limit": f"{limit}m", "host_fds": fds, "runs": runs, "throttling": throttling})
                print_row(rows[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def print_row(row: dict[str, Any]) -> None:
    for run in row["runs"]:
        print(
            f"{row['cpu_limit']:>6}: scan {run['scan_seconds']}s of {run['scan_deadline']}s deadline, "
            f"{run['processes_scanned']} processes, complete {run['complete']}, planted holder found "
            f"{run['found_planted_holder']}; probe {run['probe_seconds']}s of {run['probe_timeout']}s "
            f"({run['result']}), CPU {run['cpu_seconds']}s",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2000)
    parser.add_argument("--fds", type=int, default=50)
    parser.add_argument("--limits", default="100m,250m,500m", help="CPU limits to try, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="npu probe runs per limit")
    parser.add_argument("--rivals", type=int, default=0, help="other whole-/proc scans alongside each run")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "scan_quota.json"))
    parser.add_argument("--probe-child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe_child:
        procs, dev, spec, repeat, rivals = args.probe_child
        probe_child(procs, dev, spec, int(repeat), int(rivals))
        return 0
    why_not = cgroup_support()
    if why_not:
        print(f"cannot make a CPU-quota cgroup: {why_not}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO))
    rows = measure(args, [millicores(text) for text in args.limits.split(",")])
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    summary = {"processes": args.processes, "fds_per_process": args.fds, "rivals": args.rivals, "limits": rows}
    Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    ok = all(run["complete"] and run["found_planted_holder"] for row in rows for run in row["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
