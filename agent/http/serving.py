"""The HTTP server's own process: /ready, /healthz and the rest answered from a replica of the agent's state.

Why a process of its own: a CPU limit is one CFS quota for the container, and the agent's Python (probe threads
parsing tool output, rendering metrics, the Kubernetes client) shares one GIL with whatever thread answers
/ready. In one process, a job's pre-flight waited for the probe threads' GIL turns (5 ms each) and, under the
limit, for the quota's refill whenever the probes had spent it. So the agent (agent/http/process.py) starts this
process first, moves itself and every child it forks into the `work` cgroup, whose quota leaves this process its
headroom (probes/runtime/cpulimit.py), and sends it each snapshot it publishes. This process parses, judges and
answers with nothing else to run.

What it gets from the agent (agent/http/channel.py; `Setup` first):
- every snapshot the state publishes (`snapshot`), judged here by the same freshness rule (agent.state.judged_now,
  on the host's monotonic clock): an agent that stops sending goes stale here exactly as it would in its own
  process, and stale is not ready;
- a report every second (`Report`): /healthz's verdict, /status's agent part, the checks /ready may name;
  silent for REPORT_SILENT_SECONDS, /healthz fails (the agent is wedged, and liveness should restart it);
- /metrics and /status as the agent renders them (`Rendering`): a copy at most a second old and of the snapshot
  held serves as is, else the agent is asked and waited for at most three seconds (rendering costs the agent's CPU,
  not this process's), with this process's own figures added (connections, its CPU and memory; `server_process`);
  past the wait the last copy serves, and none older than a minute: a wedged agent shows as a failed scrape;
- for /ready?pod=, the pod's devices (`RemotePods`): the agent reads the kubelet's ledger; past LEDGER_WAIT_SECONDS
  and a margin the answer is LedgerUnavailable, never a wait.

It exits when the agent's end of the channel closes (and the kernel signals it when the agent dies).
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

from agent.http.addresses import NodeAddresses
from agent.http.channel import Channel, ChannelClosed
from agent.http.pod import LEDGER_WAIT_SECONDS, PodDevices, unavailable
from agent.http.routes import HttpServer
from agent.logs import configure_logging
from agent.snapshot import Snapshot
from agent.state import judged_now

log = logging.getLogger(__name__)

REPORT_SILENT_SECONDS = 10.0  # the agent reports every second; this long without one, /healthz fails
RENDERING_MAX_AGE_SECONDS = 1.0  # a copy of /metrics or /status this young, of the snapshot held, is served as is
# An older one is asked for again and waited for this long (the agent's process renders it among its probe threads,
# under its share of the CPU limit); then the last copy serves.
RENDERING_WAIT_SECONDS = 3.0
RENDERING_ASK_AGAIN_SECONDS = 5.0  # an ask unanswered this long is made again
RENDERING_GIVE_UP_SECONDS = 60.0  # a copy this old is not served (503)
POD_ANSWER_MARGIN_SECONDS = 1.0  # beyond the agent's own LEDGER_WAIT_SECONDS: its CPU may be throttled
MAX_POD_QUERIES = 64  # pod= queries waiting for the agent at once; more are answered LedgerUnavailable
PR_SET_PDEATHSIG = 1
# The server's scheduling priority (root only; elsewhere it stays at the agent's): woken ahead of the agent's
# process and its children, which share its CPUs, so a pre-flight does not queue behind a holder scan's scanners.
SERVER_NICE = -5


@dataclass(frozen=True)
class Report:
    """What the agent says every second besides its snapshots."""

    healthy: bool
    health: dict[str, Any]
    checks: frozenset[str]  # the checks /ready's checks= may name


@dataclass(frozen=True)
class Setup:
    """The first message: where to listen and what to start from."""

    address: str
    port: int
    metrics_port: int | None
    status_on_main_port: bool
    health_port: int | None
    max_wait: float
    proc: str
    log_format: str
    log_level: str
    agent_pid: int
    snapshot: Snapshot
    report: Report
    metrics: bytes
    status: bytes
    cgroup_procs: str | None = None  # the cgroup this process serves from (the agent's children's is not it)


def settle_soon(loop: asyncio.AbstractEventLoop | None, future: asyncio.Future[Any] | None, value: Any) -> None:
    """From the channel's reader thread: `future` gets `value` on its loop, unless it is done (timed out) by then."""
    if loop is None or future is None:
        return

    def settle() -> None:
        if not future.done():
            future.set_result(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop closed meanwhile
        pass


class Replica:
    """The agent's state as this process knows it: a StateView for HttpServer, and the report and metrics beside."""

    def __init__(self, setup: Setup, ask_metrics: Callable[[], None], ask_status: Callable[[], None]) -> None:
        self._snapshot = setup.snapshot
        self._listeners: list[Callable[[Snapshot], None]] = []
        self._report = setup.report
        self._reported = time.monotonic()
        version = lambda: self._snapshot.version  # noqa: E731 - read when asked
        self.metrics = Rendering("metrics", ask_metrics, version, (setup.metrics, setup.snapshot.version))
        self.status = Rendering("status", ask_status, version, (setup.status, setup.snapshot.version))
        self.agent_pid = setup.agent_pid

    # StateView
    def current(self) -> Snapshot:
        return judged_now(self._snapshot, time.monotonic())

    def subscribe(self, listener: Callable[[Snapshot], None]) -> None:
        self._listeners.append(listener)

    def publish(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        for listener in list(self._listeners):
            try:
                listener(snapshot)
            except Exception:  # a listener must never break the replica
                log.exception("snapshot listener failed")

    def reported(self, report: Report) -> None:
        self._report, self._reported = report, time.monotonic()

    def report_age(self) -> float:
        return time.monotonic() - self._reported

    def healthz(self) -> tuple[bool, dict[str, Any]]:
        age = self.report_age()
        if age > REPORT_SILENT_SECONDS:
            return False, {"problems": [f"the agent's process (pid {self.agent_pid}) has not reported for {age:.0f}s"]}
        return self._report.healthy, self._report.health

    def known_checks(self) -> frozenset[str]:
        return self._report.checks

    async def status_document(self) -> bytes | None:
        """/status as the agent renders it, with this process's part added as `server_process`."""
        body = await self.status.get()
        if body is None:
            return None
        age = round(self.report_age(), 3)
        part = {"pid": os.getpid(), "agent_pid": self.agent_pid, "agent_report_age_seconds": age}
        return body[:-1] + b', "server_process": ' + json.dumps(part).encode() + b"}"


class Rendering:
    """One of the agent's renderings (/metrics, /status): a copy younger than RENDERING_MAX_AGE_SECONDS and not older
    than the snapshot held is served as is; otherwise the agent is asked for a new one (once for every request
    waiting), waited for at most RENDERING_WAIT_SECONDS, and the last copy serves after that; none older than
    RENDERING_GIVE_UP_SECONDS (a wedged agent shows as a failed scrape, not as flat lines)."""

    def __init__(
        self,
        kind: str,
        ask: Callable[[], None],
        version: Callable[[], int],
        first: tuple[bytes, int] | None = None,
    ) -> None:
        self.kind = kind
        self._ask = ask
        self._version = version
        self._copy: tuple[bytes, float, int] = (b"", -math.inf, 0)
        if first is not None:
            self._copy = (first[0], time.monotonic(), first[1])
        self._wanted: asyncio.Future[None] | None = None
        self._asked = -math.inf
        self._loop: asyncio.AbstractEventLoop | None = None

    async def get(self) -> bytes | None:
        body, rendered, version = self._copy
        if time.monotonic() - rendered < RENDERING_MAX_AGE_SECONDS and version >= self._version():
            return body
        loop, now = asyncio.get_running_loop(), time.monotonic()
        # One ask for every request waiting; asked again once it is overdue (the agent's rendering failed).
        if self._wanted is None or self._wanted.done() or now - self._asked > RENDERING_ASK_AGAIN_SECONDS:
            self._loop, self._wanted, self._asked = loop, loop.create_future(), now
            try:
                self._ask()
            except (ChannelClosed, OSError):
                self._wanted.set_result(None)  # the agent is gone: the last copy, while it is young enough
        try:
            await asyncio.wait_for(asyncio.shield(self._wanted), RENDERING_WAIT_SECONDS)
        except asyncio.TimeoutError:
            pass
        body, rendered, _ = self._copy
        if not body or time.monotonic() - rendered > RENDERING_GIVE_UP_SECONDS:
            return None
        return body

    def arrived(self, body: bytes, version: int) -> None:
        """From the channel's reader."""
        self._copy = (body, time.monotonic(), version)
        settle_soon(self._loop, self._wanted, None)


class RemotePods:
    """PodSource for this process: each pod= query asked of the agent, which reads the ledger and resolves it."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[PodDevices]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def devices(self, namespace: str, name: str) -> PodDevices:
        if len(self._waiting) >= MAX_POD_QUERIES:
            return unavailable(namespace, name, f"{len(self._waiting)} pod= queries are waiting for the agent already")
        self._loop = loop = asyncio.get_running_loop()
        key = next(self._ids)
        future: asyncio.Future[PodDevices] = loop.create_future()
        self._waiting[key] = future
        try:
            self._channel.send_json({"kind": "pod", "id": key, "namespace": namespace, "name": name})
            return await asyncio.wait_for(future, LEDGER_WAIT_SECONDS + POD_ANSWER_MARGIN_SECONDS)
        except (asyncio.TimeoutError, ChannelClosed):
            waited = LEDGER_WAIT_SECONDS + POD_ANSWER_MARGIN_SECONDS
            return unavailable(namespace, name, f"the agent's process did not resolve the pod within {waited:g}s")
        finally:
            self._waiting.pop(key, None)

    def answered(self, key: int, found: PodDevices) -> None:
        """From the channel's reader: resolves the waiting query (gone if it timed out meanwhile)."""
        settle_soon(self._loop, self._waiting.get(key), found)


class _OwnFigures:
    """This process's collector: the server's connection figures and its own CPU and memory."""

    def __init__(self, http: HttpServer) -> None:
        self._http = http

    def collect(self) -> Iterator[Metric]:
        for sample in self._http.samples():  # three unlabelled figures: agent.metrics is the agent's, above this wing
            if sample.kind == "counter":
                counter = CounterMetricFamily(sample.name.removesuffix("_total"), sample.help)
                counter.add_metric([], float(sample.value))
                yield counter
            else:
                gauge = GaugeMetricFamily(sample.name, sample.help)
                gauge.add_metric([], float(sample.value))
                yield gauge


def own_metrics(http: HttpServer) -> Callable[[], bytes]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_OwnFigures(http))
    registry.register(ProcessCollector(namespace="nodehealth_server", registry=None))
    return lambda: generate_latest(registry)


async def _with_own(agents: Awaitable[bytes | None], own: Callable[[], bytes]) -> bytes | None:
    body = await agents
    return None if body is None else body + own()


def _die_with_parent() -> None:
    """The kernel sends SIGTERM when the agent dies, even where it could not close the channel (SIGKILL)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _enter(cgroup_procs: str | None) -> None:
    if cgroup_procs is None:
        return
    try:
        with open(cgroup_procs, "w") as procs:
            procs.write(str(os.getpid()))
    except OSError as exc:
        log.warning("the HTTP server's process stays in its cgroup: %s: %s", cgroup_procs, exc)


def serve(channel: Channel) -> int:
    kind, setup = channel.receive_object()
    if kind != "setup" or not isinstance(setup, Setup):
        log.error("the agent's first message is %r, not the setup", kind)
        return 2
    _enter(setup.cgroup_procs)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, SERVER_NICE)
    except OSError:
        pass
    configure_logging(setup.log_format, setup.log_level)
    if os.getppid() != setup.agent_pid:
        return 1  # the agent died before the kernel could be told to signal its death
    replica = Replica(
        setup, lambda: channel.send_json({"kind": "metrics"}), lambda: channel.send_json({"kind": "status"})
    )
    pods = RemotePods(channel)
    http = HttpServer(
        replica,
        lambda: b"",  # unused: remote_metrics
        replica.healthz,
        replica.known_checks,
        address=setup.address,
        port=setup.port,
        max_wait=setup.max_wait,
        metrics_port=setup.metrics_port,
        status_on_main_port=setup.status_on_main_port,
        pod_source=pods,
        remote_metrics=lambda: _with_own(replica.metrics.get(), own),
        remote_status=replica.status_document,
        health_port=setup.health_port,
        node_addresses=NodeAddresses(setup.proc),
    )
    own = own_metrics(http)
    try:
        http.start()
    except OSError as exc:
        channel.send_json({"kind": "listening", "error": f"{setup.address}:{setup.port}: {exc.strerror or exc}"})
        return 1
    channel.send_json({"kind": "listening", "pid": os.getpid(), **http.listening()})
    try:
        _follow(channel, replica, pods)
    except ChannelClosed:
        pass
    http.stop()
    return 0


def _follow(channel: Channel, replica: Replica, pods: RemotePods) -> None:
    while True:
        kind, value = channel.receive_object()
        if kind == "snapshot":
            replica.publish(value)
        elif kind == "report":
            replica.reported(value)
        elif kind == "metrics":
            replica.metrics.arrived(*value)
        elif kind == "status":
            replica.status.arrived(*value)
        elif kind == "pod":
            pods.answered(*value)
        elif kind == "stop":
            return
        else:
            log.warning("unknown message from the agent: %r", kind)


def main(argv: list[str]) -> int:
    _die_with_parent()
    # Ctrl-C and SIGHUP are the agent's (a terminal sends them to the whole group): this process ends with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    channel = Channel(socket.socket(fileno=int(argv[0])))
    try:
        return serve(channel)
    except ChannelClosed:
        return 0


if __name__ == "__main__":
    # As agent.http.serving, not __main__: the agent's pickles name the classes by their module.
    from agent.http import serving

    sys.exit(serving.main(sys.argv[1:]))
