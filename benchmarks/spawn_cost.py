#!/usr/bin/env python3
"""What starting one host tool costs the agent's own cgroup, by how the tool reaches the work cgroup.

Under a CPU limit the probes' children run in a `work` cgroup (probes/runtime/cpulimit.py); what a spawn costs
before the child is there is spent in the server's cgroup, the quota `/ready` is answered from. A process with an
agent-sized heap (--heap-mb of Python objects) starts /bin/true --spawns times each way:

- `plain` (the baseline: no work cgroup): Popen with no preexec_fn, which vforks.
- `preexec` (the first design): Popen's preexec_fn moves the child between fork and exec. Python in the child makes
  Popen fork the whole process (page tables copied) instead of vfork, and the child runs Python before it moves.
- `shell` (now, `cpulimit.tool_spawn`): Popen vforks /bin/sh, which writes its pid into cgroup.procs (a builtin)
  and execs the tool.

Per spawn it reports the parent's CPU, the children's CPU, and the server's share: the parent's CPU plus what the
children spent beyond the tool's own (`plain`'s children), which is what ran before the move. The cgroup.procs
here is a file in a temporary directory, which takes the same write; no cgroup is needed.

    python benchmarks/spawn_cost.py [--spawns 300] [--heap-mb 120]

Results: benchmarks/results/spawn_cost.json. Exit status 1 when `shell` costs the server more than half of what
`preexec` does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from probes.runtime import cpulimit  # noqa: E402

TOOL = "/bin/true"


def measure(spawns: int, argv: list[str], preexec: Any = None) -> tuple[float, float]:
    """Milliseconds per spawn: the parent's CPU and its children's."""
    before = os.times()
    for _ in range(spawns):
        subprocess.run(argv, preexec_fn=preexec, check=True)
    after = os.times()
    parent = (after.user - before.user) + (after.system - before.system)
    children = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return parent / spawns * 1000, children / spawns * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spawns", type=int, default=300)
    parser.add_argument("--heap-mb", type=int, default=120)
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "spawn_cost.json"))
    args = parser.parse_args()
    heap = [bytearray(1000) for _ in range(args.heap_mb * 1000)]  # the agent's objects: pages fork must copy
    with tempfile.TemporaryDirectory() as tmp:
        procs = Path(tmp) / "cgroup.procs"
        procs.write_text("")

        def enter() -> None:
            fd = os.open(procs, os.O_WRONLY)
            os.write(fd, b"%d" % os.getpid())
            os.close(fd)

        cpulimit._work_procs = os.fsencode(procs)  # as confine() sets it, without a cgroup
        shell = list(cpulimit.tool_spawn((TOOL,))[0])
        cpulimit.release()
        ways = {"plain": ([TOOL], None), "preexec": ([TOOL], enter), "shell": (shell, None)}
        measure(20, [TOOL])  # warm the page cache and the allocator
        rows: dict[str, dict[str, float]] = {}
        for name, (argv, preexec) in ways.items():
            parent, children = measure(args.spawns, argv, preexec)
            rows[name] = {"parent_ms": round(parent, 3), "children_ms": round(children, 3)}
    tool_alone = rows["plain"]["children_ms"]
    for row in rows.values():
        row["server_ms"] = round(row["parent_ms"] + max(0.0, row["children_ms"] - tool_alone), 3)
    del heap
    result = {"spawns": args.spawns, "heap_mb": args.heap_mb, "tool": TOOL, "ways": rows}
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"# spawn_cost: {args.spawns} spawns of {TOOL} from a process with {args.heap_mb} MB of objects")
    print("| way | parent ms | children ms | server's cgroup ms (parent + before the move) |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['parent_ms']} | {row['children_ms']} | {row['server_ms']} |")
    ratio = rows["shell"]["server_ms"] / max(rows["preexec"]["server_ms"], 1e-9)
    print(f"shell / preexec, server's cgroup: {ratio:.2f}")
    return 0 if ratio <= 0.5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
