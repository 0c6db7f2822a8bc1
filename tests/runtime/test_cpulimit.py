"""The work cgroup (probes/runtime/cpulimit.py): under a CPU limit the probes' children run in a child cgroup with
the limit less the server's headroom, so their use never throttles the agent's own cgroup, where its HTTP loop
runs. The system test runs a process like the agent inside a real cgroup with a 100m quota, has it start a
CPU-bound host tool (which forks), a forked filesystem call and a /proc fd scan, and reads the kernel's CFS
counters; the same work with the mechanism off throttles the agent's cgroup, so the check can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.system import REPO, require, require_root

from probes.runtime import cpulimit
from probes.runtime.commands import run_command
from probes.runtime.cpulimit import Confinement, CpuCgroup, own_cgroup, work_millicores

sys.path.insert(0, str(REPO / "benchmarks"))
import scan_quota  # its CpuQuota makes and removes the cgroup

AGENT = textwrap.dedent(
    """
    import json, os, sys, threading, time
    CPU_LINE = 'lambda text: next((l for l in text.splitlines() if "cpu" in l.split(":")[1].split(",")), '
    CPU_LINE += 'next(l for l in text.splitlines() if l.startswith("0::")))'
    from probes.runtime import cpulimit
    from probes.runtime.children import ChildCalls
    from probes.runtime.commands import run_command
    from probes.runtime.host import Host
    from probes.runtime.procfs import scan_open_files

    cpu_line = eval(CPU_LINE)  # the cpu controller's line of /proc/self/cgroup (v1), else the unified one (v2)

    confinement = cpulimit.confine(sys.argv[1])
    groups = {"container": confinement.container, "work": confinement.work}
    seen_in_work, stop = set(), threading.Event()

    def watch():
        while not stop.wait(0.01):
            if confinement.work is not None:
                seen_in_work.update(confinement.work.procs())

    watcher = threading.Thread(target=watch)
    watcher.start()
    before = {name: g.stat() for name, g in groups.items() if g is not None}
    burn = "import os, sys, time\\nforked = os.fork()\\nend = time.process_time() + 0.15\\n"
    burn += "while time.process_time() < end: pass\\nforked and os.waitpid(forked, 0)\\n"
    burn += "print(CPU_LINE(open('/proc/self/cgroup').read()), flush=True)"
    burn = burn.replace("CPU_LINE", "(" + CPU_LINE + ")")
    tool = run_command([sys.executable, "-c", burn], timeout=120)
    child = ChildCalls().call("cgroup", lambda: cpu_line(open("/proc/self/cgroup").read()), timeout=60)
    after = {name: g.stat() for name, g in groups.items() if g is not None}
    # The scan's parent side (reading and unpickling the scanners' frames) is the agent's own work: only
    # where its scanners ran is asserted.
    scan = scan_open_files(Host(), rdevs={os.makedev(240, 0)}, timeout=120, key="test")
    stop.set()
    watcher.join()
    print(json.dumps({
        "status": confinement.status(),
        "tool": tool.stdout, "tool_exit": tool.returncode, "child": child.value,
        "scan_complete": scan.complete, "seen_in_work": sorted(seen_in_work),
        "throttled": {n: after[n].throttled_periods - before[n].throttled_periods for n in after},
        "periods": {n: after[n].periods - before[n].periods for n in after},
    }))
    """
)


# Small enough that two CPU-bound children exceed it however busy the machine is (two of them get more than 100m
# of 2 cores unless some 40 other threads want the CPU), so both tests hold with both cores busy.
LIMIT = 100
STOPPED = 5  # throttled periods: the children held to a quota
# What the agent's cgroup may see anyway, as a share of its periods: CFS hands quota to each CPU in 5 ms slices,
# so at a 10 ms quota on two CPUs one CPU's unused slice can leave the other short (2-5 of ~75 periods on a quiet
# machine, where the children run flat out on both). Without the work cgroup it is every period (the next test).
STRAY_SHARE = 10


def run_agent_like(quota: scan_quota.CpuQuota, mode: str) -> dict[str, object]:
    procs = quota.procs
    done = subprocess.run(
        [sys.executable, "-c", AGENT, mode],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        preexec_fn=lambda: procs.write_text(str(os.getpid())),  # in the cgroup from its first instruction
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.system
def test_under_a_quota_the_childrens_cpu_stays_in_the_work_cgroup_and_never_throttles_the_agents() -> None:
    require_root()
    why_not = scan_quota.cgroup_support()
    require(not why_not, f"a cgroup with a CPU quota ({why_not})")
    with scan_quota.CpuQuota(LIMIT) as quota:
        confined = run_agent_like(quota, "quota")
    work = f"{quota.path.name}/{cpulimit.WORK}"
    assert confined["status"]["mode"] == "quota" and confined["status"]["work_millicores"] == 25, confined
    lines = str(confined["tool"]).splitlines()
    assert len(lines) == 2 and all(work in line for line in lines), confined  # the tool and what it forked
    assert work in str(confined["child"]), confined
    assert confined["scan_complete"] and len(confined["seen_in_work"]) >= 3, confined  # scanners were there too
    # 0.3 CPU-seconds of children against a 50m quota: the work cgroup waits for its refills, hundreds of times...
    assert confined["throttled"]["work"] >= STOPPED, confined
    # ...and the agent's cgroup, where the HTTP loop runs, is not stopped by the children's use: at most a stray
    # period in ten (STRAY_SHARE), where the same children without the work cgroup stop it in every one.
    assert confined["throttled"]["container"] <= confined["periods"]["container"] // STRAY_SHARE, confined


@pytest.mark.system
def test_without_the_work_cgroup_the_same_children_throttle_the_agent() -> None:
    """The control: the mechanism off, the same children spend the container's quota and stop the agent."""
    require_root()
    why_not = scan_quota.cgroup_support()
    require(not why_not, f"a cgroup with a CPU quota ({why_not})")
    with scan_quota.CpuQuota(LIMIT) as quota:
        shared = run_agent_like(quota, "off")
    assert shared["status"]["mode"] == "off" and "work" not in shared["status"], shared
    assert shared["throttled"]["container"] >= STOPPED, shared
    assert shared["throttled"]["container"] > shared["periods"]["container"] // 2, shared  # most periods, not strays


def test_the_work_share_leaves_the_server_its_headroom() -> None:
    # The server's 75m or 15%, and a tenth of the rest for the overlap of the work cgroup's shorter periods.
    assert work_millicores(500) == 386
    assert work_millicores(250) == 159
    assert work_millicores(100) == 25  # the floor: a quarter, so the children still move
    assert work_millicores(40) == 10
    assert work_millicores(2000) == 1545


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_own_cgroup_v1_and_v2_and_its_counters(tmp_path: Path) -> None:
    """Read from the files the kernel would show (a v1 cpu hierarchy, and a v2 tree), as a container sees them."""
    pid = str(os.getpid())
    v1 = tmp_path / "v1"
    write(v1 / "cpu" / "cpu.cfs_quota_us", "50000\n")
    group = v1 / "cpu" / "kubepods" / "pod1" / "c1"
    for name, text in (("cpu.cfs_quota_us", "25000"), ("cpu.cfs_period_us", "100000"), ("cgroup.procs", pid)):
        write(group / name, text + "\n")
    write(group / "cpu.stat", "nr_periods 40\nnr_throttled 7\nthrottled_time 1500000000\n")
    write(tmp_path / "self-v1", "4:memory:/x\n3:cpu,cpuacct:/kubepods/pod1/c1\n0::/\n")
    found = own_cgroup(v1, tmp_path / "self-v1")
    assert found == CpuCgroup(group, v1=True)
    assert found.millicores() == 250
    assert (found.stat().periods, found.stat().throttled_periods, found.stat().throttled_seconds) == (40, 7, 1.5)

    v2 = tmp_path / "v2"  # a cgroup namespace: /proc/self/cgroup says "/", the container's cgroup is the root
    write(v2 / "cpu.max", "max 100000\n")
    write(v2 / "cgroup.procs", pid + "\n")
    write(v2 / "cpu.stat", "usage_usec 10\nnr_periods 0\nnr_throttled 0\nthrottled_usec 0\n")
    write(tmp_path / "self-v2", "0::/\n")
    found = own_cgroup(v2, tmp_path / "self-v2")
    assert found == CpuCgroup(v2, v1=False) and found.millicores() is None


def test_an_agent_that_joined_its_work_cgroup_still_finds_the_containers_limit(tmp_path: Path) -> None:
    """The daemon's process moves into `work` once started (cpulimit.join_work); the limit is on its parent, and the
    HTTP server's process stays there (v1) or in the `server` leaf (v2)."""
    pid = str(os.getpid())
    root = tmp_path / "v1"
    write(root / "cpu" / "cpu.cfs_quota_us", "-1\n")
    container = root / "cpu" / "kubepods" / "pod1" / "c1"
    write(container / "cpu.cfs_quota_us", "50000\n")
    write(container / "cpu.cfs_period_us", "100000\n")
    write(container / "work" / "cgroup.procs", pid + "\n")
    write(tmp_path / "self", "3:cpu,cpuacct:/kubepods/pod1/c1/work\n")
    found = own_cgroup(root, tmp_path / "self")
    assert found == CpuCgroup(container, v1=True) and found.millicores() == 500
    confinement = Confinement(found, found.child("work"), "quota")
    assert confinement.serving_procs() == str(container / "cgroup.procs")
    v2 = Confinement(CpuCgroup(tmp_path / "v2", v1=False), CpuCgroup(tmp_path / "v2" / "work", v1=False), "quota")
    assert v2.serving_procs() == str(tmp_path / "v2" / "server" / "cgroup.procs")
    assert Confinement(found, None, "off", "no limit").serving_procs() is None


def test_join_work_moves_the_process_once_and_its_children_then_need_no_move(tmp_path: Path) -> None:
    procs = tmp_path / "work" / "cgroup.procs"
    write(procs, "")
    try:
        cpulimit._work_procs = os.fsencode(procs)
        assert cpulimit.join_work() and procs.read_text() == str(os.getpid())
        assert cpulimit.tool_spawn(("/bin/true",)) == (("/bin/true",), None)  # inherited from here on
        assert not cpulimit.join_work()
    finally:
        cpulimit.release()


def test_a_cgroup_that_does_not_list_this_process_is_not_taken(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "50000 100000\n")
    write(tmp_path / "cgroup.procs", "1\n")
    write(tmp_path / "self", "0::/\n")
    assert own_cgroup(tmp_path, tmp_path / "self") is None


def test_status_names_the_mode_the_limit_and_why_there_is_no_work_cgroup(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "50000 100000\n")
    write(tmp_path / "cpu.stat", "nr_periods 10\nnr_throttled 2\nthrottled_usec 30000\n")
    status = Confinement(CpuCgroup(tmp_path, v1=False), None, "off", "not root").status()
    assert status == {
        "mode": "off",
        "limit_millicores": 500,
        "why": "not root",
        "container": {"periods": 10, "throttled_periods": 2, "throttled_seconds": 0.03},
    }


def test_no_work_cgroup_tools_start_as_they_are() -> None:
    """Without a work cgroup a host tool is spawned as before: its own argv, no shell in front."""
    cpulimit.release()
    assert cpulimit.tool_spawn(("/usr/bin/npu-smi", "info")) == (("/usr/bin/npu-smi", "info"), None)
    cpulimit.enter_work()  # a no-op


def test_with_a_work_cgroup_the_tool_itself_writes_its_pid_there_before_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shell in front writes its pid, which exec keeps: the pid in cgroup.procs is the tool's own (a regular
    file stands in for the cgroup's, which takes the same write)."""
    procs = tmp_path / "odd name's" / "cgroup.procs"
    procs.parent.mkdir()
    procs.write_text("")
    monkeypatch.setattr(cpulimit, "_work_procs", os.fsencode(procs))
    result = run_command(["sh", "-c", "echo $$; echo err >&2"], 10)
    assert result.ok and result.stderr == "err\n", result  # the tool's stderr is only its own
    assert procs.read_text().strip() == result.stdout.strip(), result
    spawned, preexec = cpulimit.tool_spawn(("/bin/true",))
    assert (spawned[0], spawned[-1], preexec) == (cpulimit.SHELL, "/bin/true", None)  # vfork: no Python in the child
    monkeypatch.setattr(cpulimit, "SHELL", str(tmp_path / "no-shell"))  # an image without one: the dearer way
    assert cpulimit.tool_spawn(("/bin/true",)) == (("/bin/true",), cpulimit.enter_work)
    procs.write_text("")
    result = run_command(["sh", "-c", "echo $$"], 10)
    assert result.ok and procs.read_text().strip() == result.stdout.strip(), result


def test_with_a_work_cgroup_a_missing_or_unrunnable_tool_reads_as_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpulimit, "_work_procs", os.fsencode(tmp_path / "cgroup.procs"))
    missing = run_command(["npu-smi-not-installed", "info"], 5, env={"PATH": str(tmp_path)})
    assert missing.not_found and missing.returncode is None and "No such file" in missing.stderr, missing
    plain = tmp_path / "tool"
    plain.write_text("#!/bin/sh\necho hi\n")
    denied = run_command([str(plain)], 5)
    assert denied.permission_denied and "Permission denied" in denied.stderr, denied
    plain.chmod(0o755)
    found = run_command(["tool"], 5, env={"PATH": f"/nonexistent:{tmp_path}"})
    assert found.ok and found.stdout == "hi\n" and found.argv == ("tool",), found
    monkeypatch.setattr(cpulimit, "_work_procs", os.fsencode(tmp_path / "removed" / "cgroup.procs"))
    gone = run_command(["sh", "-c", "true"], 5)  # the cgroup gone: the tool still runs, silently where it is
    assert gone.ok and gone.stderr == "", gone
