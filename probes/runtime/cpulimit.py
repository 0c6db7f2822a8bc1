"""The container's CPU limit, and the `work` cgroup every child of the probes runs in.

A CPU limit is a CFS quota on the container's cgroup, shared by the agent and every process it forks. A holder
scan's scanners use about a core: left in the container's cgroup they spend its quota early in each period, and
the kernel then stops every thread of the container (the HTTP loop that answers /ready included) until the next
refill. So where the agent may (root, a writable cgroup of its own: the privileged DaemonSet), `confine()` makes
a child cgroup `work` whose quota is the limit less the server's headroom (`work_millicores`), and every child
the probes start (`probes.runtime.commands`' host tools, `probes.runtime.children`' forked filesystem calls,
`probes.runtime.fdscan`'s scanners) moves itself there before it does anything (`enter_work`, `tool_spawn`);
a new kind of child spawned through those three gets it with no change. The daemon goes further: its HTTP
server runs in a process of its own (agent/http/serving.py), and the agent then moves itself into the work cgroup
too (`join_work`), so its own Python (probe threads parsing tool output, rendering metrics) and every child it
forks from then on share the children's quota, and the server alone has the headroom.
The children then wait for their own refills while the container keeps the headroom for the server. On cgroup
v2 a cgroup with children may hold no processes, so the agent moves to a `server` leaf first; on v1 it stays
where it is until it joins the work cgroup (`Confinement.serving_procs`: where the server's process stays).

Where that cannot be done (no limit, not root, a read-only cgroupfs) nothing moves: `Confinement.mode` says
which, and the counters (`CpuCgroup.stat`) show what throttling there is either way. NODE_HEALTH_CPU_CONFINE
(`quota`, the default; `weight`: a work cgroup with a low weight and no quota of its own; `off`) picks the
mechanism, for the benchmark that compares them (benchmarks/pod_quota.py).
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
WORK = "work"
SERVER = "server"
MODES = ("quota", "weight", "off")
# What the HTTP server's process keeps of the limit (agent/http/serving.py): on the 2-core VM a hundred pre-flights a
# second, each on a new connection, cost it about 50m (a bare asyncio server 330 us a connection there: the kernel's
# and the event loop's own cost) and its idle second 5m (benchmarks/pod_quota.py). The rest goes to the agent's
# process and its children: a holder scan's time is its CPU (about 0.8 s at 110,000 fds) divided by their share,
# against an 8 s deadline.
SERVER_HEADROOM_MILLICORES = 75
SERVER_HEADROOM_SHARE = 0.15
WORK_FLOOR_SHARE = 0.25  # below a limit the headroom cannot leave room in, the children still get this much

# A tenth of the container's period: any container period then overlaps at most eleven of the work cgroup's, so
# work that ran late in one and early in the next takes at most 1.1x its share of it; `work_millicores` leaves
# room for that (with a fifth, 1.2x, the container was still throttled in one period in ten at 500m).
WORK_PERIOD_SHARE = 10
MIN_QUOTA_US, MAX_PERIOD_US = 1000, 1_000_000  # the kernel's bounds on cfs_quota_us / cpu.max

_work_procs: bytes | None = None  # the work cgroup's cgroup.procs, as the children open it
_active: Confinement | None = None  # what confine() set up, for the messages of scans it cut short


@dataclass(frozen=True)
class CpuStat:
    """A cgroup's CFS counters: periods with runnable tasks, periods it was throttled in, seconds throttled."""

    periods: int = 0
    throttled_periods: int = 0
    throttled_seconds: float = 0.0


@dataclass(frozen=True)
class CpuCgroup:
    """One cgroup directory of the cpu controller (v1 `cpu.cfs_*`, or v2 `cpu.max`)."""

    path: Path
    v1: bool

    def limit(self) -> tuple[int | None, int]:
        """(quota in us per period or None when unlimited, period in us)."""
        try:
            if self.v1:
                quota = int((self.path / "cpu.cfs_quota_us").read_text())
                period = int((self.path / "cpu.cfs_period_us").read_text())
                return (quota if quota > 0 else None), period
            max_text, period_text = (self.path / "cpu.max").read_text().split()
            return (None if max_text == "max" else int(max_text)), int(period_text)
        except (OSError, ValueError):
            return None, 100_000

    def millicores(self) -> int | None:
        quota, period = self.limit()
        return None if quota is None else round(quota * 1000 / period)

    def stat(self) -> CpuStat:
        try:
            text = (self.path / "cpu.stat").read_text()
        except OSError:
            return CpuStat()
        fields = {}
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                fields[key] = int(value)
        throttled = fields.get("throttled_time", 0) / 1e9 if self.v1 else fields.get("throttled_usec", 0) / 1e6
        return CpuStat(fields.get("nr_periods", 0), fields.get("nr_throttled", 0), throttled)

    def procs(self) -> set[int]:
        with contextlib.suppress(OSError):
            return {int(pid) for pid in (self.path / "cgroup.procs").read_text().split()}
        return set()

    def child(self, name: str) -> CpuCgroup:
        return CpuCgroup(self.path / name, self.v1)


def own_cgroup(root: Path = CGROUP_ROOT, self_cgroup: Path = Path("/proc/self/cgroup")) -> CpuCgroup | None:
    """The cpu cgroup this process is in, as a directory it can read, or None where there is none.

    /proc/self/cgroup names it from the cgroup root; a container that has its own cgroup mounted at the root
    (a cgroup namespace, or the runtime's bind mount) finds it there instead. Either way it must list this process.
    """
    v1 = (root / "cpu" / "cpu.cfs_quota_us").is_file()
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    relative = ""
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (v1 and "cpu" in controllers.split(",")) or (not v1 and controllers == ""):
            relative = path.lstrip("/")
            break
    base = root / "cpu" if v1 else root
    pid = os.getpid()
    for candidate in (base / relative, base) if relative else (base,):
        group = CpuCgroup(candidate, v1)
        if pid in group.procs():
            # A confined agent is in the `work` cgroup (its HTTP server's process, and on v2 what `kubectl exec`
            # starts beside it, in the `server` leaf): the container's limit is on their parent.
            if candidate.name in (SERVER, WORK) and (candidate.parent / WORK).is_dir():
                return CpuCgroup(candidate.parent, v1)
            return group
    return None


def work_millicores(limit: int) -> int:
    """The share of a `limit` millicore quota for the agent's process and its children: the limit less the server's
    headroom, less the overlap of the work cgroup's periods with the container's (WORK_PERIOD_SHARE)."""
    headroom = max(SERVER_HEADROOM_MILLICORES, round(limit * SERVER_HEADROOM_SHARE))
    overlap = WORK_PERIOD_SHARE / (WORK_PERIOD_SHARE + 1)
    return max(int((limit - headroom) * overlap), round(limit * WORK_FLOOR_SHARE), 1)


@dataclass
class Confinement:
    """Where the agent's children run and what the container's limit is: what /status and /metrics show."""

    container: CpuCgroup | None = None
    work: CpuCgroup | None = None
    mode: str = "off"
    why: str = ""  # why there is no work cgroup, when there is none

    def limit_millicores(self) -> int | None:
        return self.container.millicores() if self.container is not None else None

    def work_millicores(self) -> int | None:
        return self.work.millicores() if self.work is not None else None

    def serving_procs(self) -> str | None:
        """The cgroup.procs the HTTP server's process writes itself to: the container's own cgroup on v1, the
        `server` leaf on v2; None where there is no work cgroup to keep it out of."""
        if self.container is None or self.work is None:
            return None
        group = self.container if self.container.v1 else self.container.child(SERVER)
        return str(group.path / "cgroup.procs")

    def status(self) -> dict[str, object]:
        """The limits and counters, for /status and `node-health check`."""
        out: dict[str, object] = {"mode": self.mode, "limit_millicores": self.limit_millicores()}
        if self.why:
            out["why"] = self.why
        for name, group in (("container", self.container), (WORK, self.work)):
            if group is not None:
                stat = group.stat()
                out[name] = {
                    "periods": stat.periods,
                    "throttled_periods": stat.throttled_periods,
                    "throttled_seconds": round(stat.throttled_seconds, 3),
                }
        if self.work is not None:
            out["work_millicores"] = self.work_millicores()
        return out


def observe() -> Confinement:
    """The container's cgroup as it is, and the work cgroup where the agent made one (`check` beside it)."""
    container = own_cgroup()
    if container is None:
        return Confinement(None, None, "off", "no cpu cgroup found")
    work = container.child(WORK)
    if not work.path.is_dir():
        return Confinement(container, None, "off", "no work cgroup")
    return Confinement(container, work, "quota" if work.millicores() is not None else "weight")


def confine(mode: str | None = None) -> Confinement:
    """Make the work cgroup (see the module docstring) and have every later child join it; or say why not."""
    mode = mode or os.environ.get("NODE_HEALTH_CPU_CONFINE", "quota")
    if mode not in MODES:
        return Confinement(own_cgroup(), None, "off", f"NODE_HEALTH_CPU_CONFINE={mode!r} is none of {MODES}")
    container = own_cgroup()
    if container is None:
        return Confinement(None, None, "off", "no cpu cgroup found")
    limit = container.millicores()
    if mode == "off":
        return Confinement(container, None, "off", "NODE_HEALTH_CPU_CONFINE=off")
    if limit is None and mode == "quota":
        return Confinement(container, None, "off", "the container has no CPU limit")
    try:
        work = _make_work(container, mode, limit)
    except OSError as exc:
        return Confinement(container, None, "off", f"cannot make a work cgroup in {container.path}: {exc}")
    global _work_procs, _active
    _work_procs = os.fsencode(work.path / "cgroup.procs")
    _active = Confinement(container, work, mode)
    return _active


def _make_work(container: CpuCgroup, mode: str, limit: int | None) -> CpuCgroup:
    work = container.child(WORK)
    work.path.mkdir(exist_ok=True)
    if not container.v1:
        server = container.child(SERVER)
        server.path.mkdir(exist_ok=True)
        for pid in container.procs():  # no processes in a cgroup with children (v2): the agent to a leaf
            with contextlib.suppress(ProcessLookupError):
                (server.path / "cgroup.procs").write_text(str(pid))
        subtree = container.path / "cgroup.subtree_control"
        if "cpu" not in subtree.read_text().split():
            subtree.write_text("+cpu")
    _, period = container.limit()
    if mode == "weight":
        if container.v1:
            (work.path / "cpu.shares").write_text("2")
        else:
            (work.path / "cpu.weight").write_text("1")
        return work
    assert limit is not None
    share = work_millicores(limit)
    # The kernel takes no quota under 1 ms: a small share gets a longer period instead (at most 1 s).
    period = min(MAX_PERIOD_US, max(period // WORK_PERIOD_SHARE, -(-MIN_QUOTA_US * 1000 // share)))
    quota = max(MIN_QUOTA_US, share * period // 1000)
    if container.v1:
        (work.path / "cpu.cfs_period_us").write_text(str(period))
        (work.path / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (work.path / "cpu.max").write_text(f"{quota} {period}")
    return work


def enter_work() -> None:
    """In a child, first thing after fork: move into the work cgroup, if there is one. Only `os` calls (the
    child of a threaded process); a child that cannot move runs where it is, as before."""
    if _work_procs is None:
        return
    with contextlib.suppress(OSError):
        fd = os.open(_work_procs, os.O_WRONLY)
        try:
            os.write(fd, b"%d" % os.getpid())
        finally:
            os.close(fd)


# The shell a host tool is started through where there is a work cgroup: it writes its own pid into the work
# cgroup's cgroup.procs (a builtin, no fork) and then becomes the tool, so the tool is in the work cgroup from
# its first instruction. Not Popen's preexec_fn: running Python in the forked child makes Popen fork the whole
# agent instead of vfork, and the page-table copy plus the child's Python before it moves (about 3 ms a tool on a
# 120 MB agent) land in the server's cgroup, hundreds of times per npu run on a 16-chip node. The shell costs the
# server's cgroup about a fifth of that (benchmarks/spawn_cost.py). A failed write leaves the tool where the agent
# is, as before, without a word on the tool's stderr.
SHELL = "/bin/sh"
_ENTER_AND_EXEC = '{ echo $$ >%s; } 2>/dev/null; exec "$0" "$@"'


def join_work() -> bool:
    """Move this whole process (every thread) into the work cgroup: the agent does, once its HTTP server runs in a
    process of its own (agent/http/process.py), so that its own Python shares the children's quota and the server
    keeps the headroom. Every child it forks from then on starts there: `enter_work` and `tool_spawn` need not move
    them. False (nothing moved) where there is no work cgroup or it cannot be written."""
    global _work_procs
    if _work_procs is None:
        return False
    try:
        Path(os.fsdecode(_work_procs)).write_text(str(os.getpid()))
    except OSError:
        return False
    _work_procs = None  # inherited from here on
    return True


def tool_spawn(argv: tuple[str, ...]) -> tuple[tuple[str, ...], Callable[[], None] | None]:
    """How to start the host tool `argv` (its program a resolved path) in the work cgroup: the argv and the
    preexec_fn for Popen. Through SHELL where there is a work cgroup; without a shell, `enter_work` between fork and
    exec (the dearer way); unchanged where there is no work cgroup (spawned as if there were no limit)."""
    if _work_procs is None:
        return argv, None
    if not os.access(SHELL, os.X_OK):
        return argv, enter_work
    return (SHELL, "-c", _ENTER_AND_EXEC % shlex.quote(os.fsdecode(_work_procs)), *argv), None


def children_millicores() -> int | None:
    """The CPU the probes' children may use at once: the work cgroup's quota where there is one, else the
    container's limit; None where neither limits them (how many scanners a holder scan forks)."""
    confinement = _active if _active is not None else observe()
    work = confinement.work_millicores()
    return work if work is not None else confinement.limit_millicores()


def limit_note() -> str:
    """For the message of work that did not finish: the CPU limit it ran under, "" where there is none."""
    confinement = _active if _active is not None else observe()
    limit = confinement.limit_millicores()
    if limit is None:
        return ""
    work = confinement.work_millicores()
    share = f", {work}m of it for the probes' children" if work is not None else ""
    return f"under the container's CPU limit of {limit}m{share} (resources.limits.cpu; docs/deployment.md)"


def release() -> None:
    """Forget the work cgroup (tests; the agent's shutdown): later children stay where the agent is."""
    global _work_procs, _active
    _work_procs = _active = None
