#!/usr/bin/env python3
"""Device-holder scan benchmark: our one-pass /proc/*/fd scan against `fuser` and `lsof`, same devices, same run.

Spawns PROCESSES processes holding FDS open files each (regular files, pipes, sockets, /dev/null); some
hold device nodes mknod'ed in a temp dev dir (davinci0, davinci1, davinci_manager), and one holds a
mknod'ed copy of davinci0 in another directory: same major:minor, different inode, like the node runc
creates in a container's /dev. `fuser` and `lsof` match by inode, so they miss that holder; the scan,
which matches S_ISCHR + st_rdev, finds it.

    sudo python benchmarks/holder_scan.py [--processes 2000] [--fds 50] [--repeat 5]

Needs root (mknod), psmisc (`fuser`) and lsof. Every spawned process is killed and reaped at the end.
Budget (DESIGN.md): faster than fuser over the same device list.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
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
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probes.runtime.host import Host
from probes.runtime.procfs import device_rdevs, scan_fds_in_child, scan_open_files

# Device nodes copied by major:minor from the host's memory devices: they open on any Linux.
DEVICES = {"davinci0": "/dev/full", "davinci1": "/dev/random", "davinci_manager": "/dev/zero"}
DEVICE_PATTERNS = ["davinci[0-9]*", "davinci_manager"]
T = TypeVar("T")


def spawner_main(work: Path, processes: int, fds: int, holders: int) -> None:
    """Runs in its own session: forks the holders, reports their pids, kills and reaps them on SIGTERM."""
    children: list[int] = []
    roles: dict[str, list[int]] = {name: [] for name in [*DEVICES, "copy"]}
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
        elif index <= holders:
            role = device_names[index % len(device_names)]
            device = work / "dev" / role
        else:
            role, device = "", None
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            held = [os.open(device, os.O_RDONLY)] if device else []
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
        chunk = os.read(ready_read, 65536)
        if not chunk:
            break  # every child died: report what there is
        ready += len(chunk)
    sys.stdout.write(json.dumps({"children": children, "roles": roles}) + "\n")
    sys.stdout.flush()
    while True:
        signal.pause()


def median_seconds(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    """Median wall time of `repeat` calls, and the last call's result."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def pids_of(text: str) -> set[int]:
    return {int(tok) for tok in text.split() if tok.isdigit()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2000)
    parser.add_argument("--fds", type=int, default=50)
    parser.add_argument("--holders", type=int, default=24, help="processes holding a device (besides the copy)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--spawner", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.spawner:
        spawner_main(Path(args.spawner), args.processes, args.fds, args.holders)
        return 0
    if os.geteuid() != 0:
        print("needs root (mknod)", file=sys.stderr)
        return 2
    fuser, lsof = shutil.which("fuser"), shutil.which("lsof")
    if not fuser or not lsof:
        print("needs fuser (psmisc) and lsof on PATH", file=sys.stderr)
        return 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.fds + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.fds + 64), hard))

    work = Path(tempfile.mkdtemp(prefix="holder-scan-"))
    spawner: subprocess.Popen[str] | None = None
    try:
        for sub in ("dev", "container-dev", "files"):
            (work / sub).mkdir()
        for name, source in DEVICES.items():
            os.mknod(work / "dev" / name, 0o666 | stat.S_IFCHR, os.stat(source).st_rdev)
        os.mknod(work / "container-dev" / "davinci0", 0o666 | stat.S_IFCHR, os.stat(DEVICES["davinci0"]).st_rdev)
        for i in range(16):
            (work / "files" / f"f{i}").write_bytes(b"x")

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
        info = json.loads(spawner.stdout.readline())
        roles: dict[str, list[int]] = info["roles"]
        spawn_seconds = time.perf_counter() - started

        host = Host()
        rdevs = device_rdevs(work / "dev", DEVICE_PATTERNS)
        device_args = [str(work / "dev" / name) for name in DEVICES]

        ours_seconds, ours = median_seconds(lambda: scan_open_files(host, rdevs=rdevs, timeout=120), args.repeat)
        inproc_seconds, _ = median_seconds(
            lambda: scan_fds_in_child(str(host.proc), frozenset(rdevs), frozenset(), frozenset()), args.repeat
        )
        fuser_seconds, fuser_out = median_seconds(
            lambda: subprocess.run([fuser, *device_args], capture_output=True, text=True, timeout=600), args.repeat
        )
        lsof_seconds, lsof_out = median_seconds(
            lambda: subprocess.run([lsof, "-n", "-P", "-w", "-t", *device_args], capture_output=True, text=True),
            max(1, args.repeat // 2),
        )

        spawned = set(info["children"])
        ours_pids = {m.pid for m in ours.matches} & spawned
        fuser_pids = pids_of(fuser_out.stdout) & spawned
        lsof_pids = pids_of(lsof_out.stdout) & spawned
        expected = {pid for pids in roles.values() for pid in pids}
        copy_holder = roles["copy"][0]
        copy_match = [m for m in ours.matches if m.pid == copy_holder]

        print(f"processes on the host:  {ours.processes}, fds: {ours.fds}  (spawned in {spawn_seconds:.1f} s)")
        print(f"device list:            {', '.join(device_args)}")
        print(f"holders spawned:        {len(expected)} (one holds the mknod'ed copy {work}/container-dev/davinci0)")
        print(f"{'method':<34} {'median s':>9} {'ratio':>7} {'holders found':>14}")
        rows = [
            ("ours: scan_open_files (fork+scan)", ours_seconds, ours_pids),
            ("ours: scan in-process", inproc_seconds, None),
            ("fuser DEVICES", fuser_seconds, fuser_pids),
            ("lsof -t DEVICES", lsof_seconds, lsof_pids),
        ]
        for name, seconds, found in rows:
            ratio = seconds / ours_seconds
            print(f"{name:<34} {seconds:>9.3f} {ratio:>6.2f}x {'' if found is None else len(found):>14}")
        print(f"fuser finds the copy's holder (pid {copy_holder}): {copy_holder in fuser_pids}")
        print(f"lsof finds the copy's holder:  {copy_holder in lsof_pids}")
        print(f"ours finds it:                 {bool(copy_match)} {[(m.fd, m.target) for m in copy_match]}")
        print(f"ours found every holder: {expected <= ours_pids}; missed by fuser: {sorted(expected - fuser_pids)}")
        print(
            json.dumps(
                {
                    "processes": ours.processes,
                    "fds": ours.fds,
                    "ours_seconds": round(ours_seconds, 4),
                    "ours_inprocess_seconds": round(inproc_seconds, 4),
                    "fuser_seconds": round(fuser_seconds, 4),
                    "lsof_seconds": round(lsof_seconds, 4),
                    "fuser_over_ours": round(fuser_seconds / ours_seconds, 2),
                    "lsof_over_ours": round(lsof_seconds / ours_seconds, 2),
                    "fuser_missed_copy": copy_holder not in fuser_pids,
                    "ours_found_all": expected <= ours_pids,
                }
            )
        )
        return 0 if expected <= ours_pids and ours_seconds < fuser_seconds else 1
    finally:
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
