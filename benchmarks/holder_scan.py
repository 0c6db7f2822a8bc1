#!/usr/bin/env python3
"""Device-holder scan benchmark: our one-pass /proc/*/fd and /proc/*/maps scan against `fuser` and `lsof`, same
devices, same run.

Spawns PROCESSES processes holding FDS open files each (regular files, pipes, sockets, /dev/null); some
hold device nodes mknod'ed in a temp dev dir (davinci0, davinci1, davinci_manager), one holds a mknod'ed copy
of davinci0 in another directory: same major:minor, different inode, like the node runc creates in a
container's /dev, and one has mmap'ed such a copy of davinci_manager (/dev/zero's number: /dev/full does not map)
and closed the fd (a holder only /proc/PID/maps shows), and one (tests/support/leaderless/leaderless.c, built with
gcc) holds davinci1 from a thread after its main thread called pthread_exit(): its /proc/PID/fd reads empty, and
only /proc/PID/task/TID/fd shows the device.
`fuser` and `lsof` match by inode, so they miss both; the scan, which matches S_ISCHR + st_rdev (of the fd's
file, and of each mapped file through /proc/PID/map_files), finds them. `fuser` reads every process's maps
too, so the agent's scan (fds and maps, forked scanners) is the one held to the budget; the fd-only scan is
timed beside it, and in-process with statx(AT_STATX_DONT_SYNC), what the agent uses, and with plain stat(2),
the old way, to show what never blocking on a hung mount costs.

    sudo python benchmarks/holder_scan.py [--processes 2000] [--fds 50] [--repeat 5]

Needs root (mknod), psmisc (`fuser`), lsof and gcc. Every spawned process is killed and reaped at the end.
Budget: at least as fast as fuser over the same device list (wall clock; CPU seconds are reported beside it,
steadier on a shared machine). The exit status is 0 when the scan found every holder and met the budget.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import resource
import select
import shutil
import signal
import socket
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probes.runtime.host import Host
from probes.runtime.procfs import STATX_AVAILABLE, device_rdevs, scan_in_process, scan_open_files

# Device nodes copied by major:minor from the host's memory devices: they open on any Linux.
DEVICES = {"davinci0": "/dev/full", "davinci1": "/dev/random", "davinci_manager": "/dev/zero"}
DEVICE_PATTERNS = ["davinci[0-9]*", "davinci_manager"]
T = TypeVar("T")
ROUND_KEYS = {
    "ours: scan_open_files (fork+scan)": "ours",
    "ours: fds only (fork+scan)": "fds_only",
    "ours: in-process, statx": "inproc",
    "ours: in-process, plain stat": "plain",
    "fuser DEVICES": "fuser",
}
JSON_KEYS = {
    "ours: scan_open_files (fork+scan)": "ours_seconds",
    "ours: fds only (fork+scan)": "ours_fds_only_seconds",
    "ours: in-process, statx": "ours_inprocess_statx_seconds",
    "ours: in-process, plain stat": "ours_inprocess_stat_seconds",
    "fuser DEVICES": "fuser_seconds",
    "lsof -t DEVICES": "lsof_seconds",
}


def spawner_main(work: Path, processes: int, fds: int, holders: int) -> None:
    """Runs in its own session: forks the holders, reports their pids, kills and reaps them on SIGTERM."""
    children: list[int] = []
    roles: dict[str, list[int]] = {name: [] for name in [*DEVICES, "copy", "mapped"]}
    plain = [work / "files" / f"f{i}" for i in range(16)]

    def stop(_signum: int, _frame: object) -> None:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    ready_read, ready_write = os.pipe()  # each child writes one byte once its fds are open
    device_names = list(DEVICES)
    for index in range(processes):
        if index == 0:
            role, device = "copy", work / "container-dev" / "davinci0"  # the mknod'ed copy
        elif index == 1 and holders > 0:
            role, device = "mapped", work / "container-dev" / "davinci_manager"  # mapped, then the fd closed
        elif index <= holders:
            role = device_names[index % len(device_names)]
            device = work / "dev" / role
        else:
            role, device = "", None
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            held = [os.open(device, os.O_RDONLY)] if device else []
            if role == "mapped":
                map_and_close(held.pop())
            while len(held) < fds:
                kind = len(held) % 5
                if kind == 0:
                    held.extend(os.pipe())
                elif kind == 1:
                    held.append(socket.socket().detach())
                elif kind == 2:
                    held.append(os.open("/dev/null", os.O_RDONLY))
                else:
                    held.append(os.open(plain[(index + len(held)) % len(plain)], os.O_RDONLY))
            os.write(ready_write, b".")
            while True:
                signal.pause()
        children.append(pid)
        if role:
            roles[role].append(pid)
    os.close(ready_write)
    ready = 0
    while ready < processes:
        if not select.select([ready_read], [], [], 1.0)[0]:
            died, status = os.waitpid(-1, os.WNOHANG)
            if died:  # a child failed before it was ready (the others would wait for it forever)
                sys.stderr.write(f"holder {died} exited with status {status} before it was ready\n")
                stop(signal.SIGTERM, None)
            continue
        chunk = os.read(ready_read, 65536)
        if not chunk:
            break  # every child died: report what there is
        ready += len(chunk)
    sys.stdout.write(json.dumps({"children": children, "roles": roles}) + "\n")
    sys.stdout.flush()
    while True:
        signal.pause()


def map_and_close(fd: int) -> None:
    """mmap one page of the device (MAP_PRIVATE, as /dev/zero allows) and close the fd; the mapping stays.
    Python's mmap module keeps a dup of the fd, so libc's mmap is called directly."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    address = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap of the device copy failed")
    os.close(fd)


LEADERLESS = Path(__file__).resolve().parent.parent / "tests" / "support" / "leaderless" / "leaderless.c"


def start_leaderless(work: Path) -> subprocess.Popen[bytes]:
    """The holder whose main thread has exited, holding work/dev/davinci1; returned once its leader is gone."""
    binary = work / "leaderless"
    subprocess.run(["gcc", "-O1", "-pthread", "-o", str(binary), str(LEADERLESS)], check=True, timeout=120)
    process = subprocess.Popen(
        [str(binary), "-", str(work / "dev" / "davinci1")], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    process.stdout.readline()
    deadline = time.monotonic() + 30
    while os.listdir(f"/proc/{process.pid}/fd") and time.monotonic() < deadline:
        time.sleep(0.01)  # the main thread exits just after it printed its port
    return process


def cpu_seconds() -> float:
    """CPU seconds (user and system) of this process and of its reaped children: fuser, lsof, and the forked
    scanners, which are reaped before their scan returns."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def interleaved(methods: dict[str, Callable[[], Any]], repeat: int) -> dict[str, tuple[float, float, Any]]:
    """Each method once per round, `repeat` rounds: name → (median wall time, median CPU time, the last call's
    result)."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    results: dict[str, Any] = {}
    for _ in range(repeat):
        for name, fn in methods.items():
            started, cpu_started = time.perf_counter(), cpu_seconds()
            results[name] = fn()
            times[name].append(time.perf_counter() - started)
            cpu[name].append(cpu_seconds() - cpu_started)
    return {name: (statistics.median(times[name]), statistics.median(cpu[name]), results[name]) for name in methods}


def median_seconds(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    """Median wall time of `repeat` calls, and the last call's result."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def pids_of(text: str | None) -> set[int]:
    return {int(tok) for tok in (text or "").split() if tok.isdigit()}


def run_tool(argv: list[str], timeout: float) -> str | None:
    """A baseline tool's stdout, or None when it did not finish: fuser and lsof stat every open file and
    mount, so a hung FUSE/NFS mount on the machine blocks them (the very thing the scan must survive)."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired:
        return None


def measure(args: argparse.Namespace, work: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Time our scan (forked scanners with and without maps, and in-process with statx and with plain stat),
    fuser and lsof."""
    host = Host()
    rdevs = device_rdevs(work / "dev", DEVICE_PATTERNS)
    device_args = [str(work / "dev" / name) for name in DEVICES]
    fuser, lsof = shutil.which("fuser") or "fuser", shutil.which("lsof") or "lsof"
    # The agent's scan and fuser take turns, round after round, so a load that comes and goes on the machine
    # weighs on both alike; lsof (slow) is timed after.
    rounds = interleaved(
        {
            "ours": lambda: scan_open_files(host, rdevs=rdevs, timeout=120, mappings=True),
            "fds_only": lambda: scan_open_files(host, rdevs=rdevs, timeout=120),
            "inproc": lambda: scan_in_process(
                str(host.proc), frozenset(rdevs), frozenset(), frozenset(), mappings=True
            ),
            "plain": lambda: scan_in_process(
                str(host.proc), frozenset(rdevs), frozenset(), frozenset(), use_statx=False, mappings=True
            ),
            "fuser": lambda: run_tool([fuser, *device_args], args.tool_timeout),
        },
        args.repeat,
    )
    ours, fuser_out = rounds["ours"][2], rounds["fuser"][2]
    lsof_seconds, lsof_out = median_seconds(
        lambda: run_tool([lsof, "-n", "-P", "-w", "-t", *device_args], args.tool_timeout), max(1, args.repeat // 2)
    )
    spawned = set(info["children"])
    return {
        "hung": [name for name, out in (("fuser DEVICES", fuser_out), ("lsof -t DEVICES", lsof_out)) if out is None],
        "ours": ours,
        "device_args": device_args,
        "seconds": {**{name: rounds[key][0] for name, key in ROUND_KEYS.items()}, "lsof -t DEVICES": lsof_seconds},
        "cpu": {name: rounds[key][1] for name, key in ROUND_KEYS.items()},
        "found": {
            "ours: scan_open_files (fork+scan)": {m.pid for m in ours.matches} & spawned,
            "fuser DEVICES": pids_of(fuser_out) & spawned,
            "lsof -t DEVICES": pids_of(lsof_out) & spawned,
        },
    }


def report(work: Path, info: dict[str, Any], measured: dict[str, Any], spawn_seconds: float) -> bool:
    """Print the table and a JSON line; True when ours found every holder and beat fuser."""
    roles: dict[str, list[int]] = info["roles"]
    ours, seconds, found = measured["ours"], measured["seconds"], measured["found"]
    expected = {pid for pids in roles.values() for pid in pids}
    copy_holder, mapped_holder, leaderless_holder = roles["copy"][0], roles["mapped"][0], roles["leaderless"][0]
    copy_match = [m for m in ours.matches if m.pid == copy_holder]
    mapped_match = [m for m in ours.matches if m.pid == mapped_holder]
    base = seconds["ours: scan_open_files (fork+scan)"]
    cpu = measured["cpu"]
    cpu_base = cpu["ours: scan_open_files (fork+scan)"]
    print(f"processes on the host:  {ours.processes}, fds: {ours.fds}  (spawned in {spawn_seconds:.1f} s)")
    print(f"device list:            {', '.join(measured['device_args'])}")
    print(f"holders spawned:        {len(expected)} (one holds the mknod'ed copy {work}/container-dev/davinci0,")
    print("                        one has a copy of davinci_manager mapped and no fd,")
    print("                        one holds davinci1 after its main thread exited)")
    print(f"{'method':<36} {'median s':>9} {'ratio':>7} {'CPU s':>7} {'ratio':>7} {'holders found':>14}")
    for name, value in seconds.items():
        count = len(found[name]) if name in found else ""
        timed_out = " (did not finish: a hung mount?)" if name in measured["hung"] else ""
        cpu_text = f"{cpu[name]:>7.3f} {cpu[name] / cpu_base:>6.2f}x" if name in cpu else f"{'':>7} {'':>7}"
        print(f"{name:<36} {value:>9.3f} {value / base:>6.2f}x {cpu_text} {count:>14}{timed_out}")
    fuser_pids, lsof_pids = found["fuser DEVICES"], found["lsof -t DEVICES"]
    ours_pids = found["ours: scan_open_files (fork+scan)"]
    print(f"fuser finds the copy's holder (pid {copy_holder}): {copy_holder in fuser_pids}")
    print(f"lsof finds the copy's holder:  {copy_holder in lsof_pids}")
    print(f"ours finds it:                 {bool(copy_match)} {[(m.fd, m.target) for m in copy_match]}")
    print(f"fuser finds the mmap-only holder (pid {mapped_holder}): {mapped_holder in fuser_pids}")
    print(f"ours finds it:                 {bool(mapped_match)} {[(m.via, m.target) for m in mapped_match]}")
    print(
        f"fuser finds the holder whose main thread exited (pid {leaderless_holder}): {leaderless_holder in fuser_pids}"
    )
    print(f"ours finds it:                 {leaderless_holder in ours_pids}")
    print(f"ours found every holder: {expected <= ours_pids}; missed by fuser: {sorted(expected - fuser_pids)}")
    summary = {
        "processes": ours.processes,
        "fds": ours.fds,
        "statx": STATX_AVAILABLE,
        **{JSON_KEYS[name]: round(value, 4) for name, value in seconds.items()},
        **{JSON_KEYS[name].replace("_seconds", "_cpu_seconds"): round(value, 4) for name, value in cpu.items()},
        "fuser_over_ours": round(seconds["fuser DEVICES"] / base, 2),
        "fuser_over_ours_cpu": round(cpu["fuser DEVICES"] / cpu_base, 2),
        "lsof_over_ours": round(seconds["lsof -t DEVICES"] / base, 2),
        "fuser_missed_copy": copy_holder not in fuser_pids,
        "fuser_missed_mapped": mapped_holder not in fuser_pids,
        "fuser_missed_leaderless": leaderless_holder not in fuser_pids,
        "baselines_hung": measured["hung"],
        "ours_found_all": expected <= ours_pids,
    }
    print(json.dumps(summary))
    return expected <= ours_pids and base < seconds["fuser DEVICES"]


def prepare(work: Path) -> None:
    for sub in ("dev", "container-dev", "files"):
        (work / sub).mkdir()
    for name, source in DEVICES.items():
        os.mknod(work / "dev" / name, 0o666 | stat.S_IFCHR, os.stat(source).st_rdev)
    for name in ("davinci0", "davinci_manager"):  # davinci_manager's /dev/zero number: a device that maps
        os.mknod(work / "container-dev" / name, 0o666 | stat.S_IFCHR, os.stat(DEVICES[name]).st_rdev)
    for i in range(16):
        (work / "files" / f"f{i}").write_bytes(b"x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2000)
    parser.add_argument("--fds", type=int, default=50)
    parser.add_argument("--holders", type=int, default=24, help="device holders besides the copy (1st: mapped)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tool-timeout", type=float, default=300.0, help="seconds before fuser/lsof count as hung")
    parser.add_argument("--spawner", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.spawner:
        spawner_main(Path(args.spawner), args.processes, args.fds, args.holders)
        return 0
    if os.geteuid() != 0:
        print("needs root (mknod)", file=sys.stderr)
        return 2
    if not shutil.which("fuser") or not shutil.which("lsof") or not shutil.which("gcc"):
        print("needs fuser (psmisc), lsof and gcc on PATH", file=sys.stderr)
        return 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.fds + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.fds + 64), hard))
    work = Path(tempfile.mkdtemp(prefix="holder-scan-"))
    spawner: subprocess.Popen[str] | None = None
    leaderless: subprocess.Popen[bytes] | None = None
    try:
        prepare(work)
        started = time.perf_counter()
        spawner = subprocess.Popen(
            [
                *(sys.executable, __file__, "--spawner", str(work), "--processes", str(args.processes)),
                *("--fds", str(args.fds), "--holders", str(args.holders)),
            ],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert spawner.stdout is not None
        line = spawner.stdout.readline()
        if not line:
            print("the holders could not be started", file=sys.stderr)
            return 1
        info = json.loads(line)
        leaderless = start_leaderless(work)
        info["children"].append(leaderless.pid)
        info["roles"]["leaderless"] = [leaderless.pid]
        return 0 if report(work, info, measure(args, work, info), time.perf_counter() - started) else 1
    finally:
        if leaderless is not None:
            leaderless.kill()
            leaderless.wait(timeout=10)
        if spawner is not None:
            spawner.terminate()  # the spawner kills and reaps its children
            try:
                spawner.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(spawner.pid, signal.SIGKILL)
                spawner.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
