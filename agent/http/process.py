"""The agent's side of the HTTP server's process (agent/http/serving.py says why there is one): starts it, sends it
each snapshot and a report a second, renders /metrics and resolves /ready?pod= when it asks, and starts it again
when it dies (backing off), on the ports it had.

The agent's ends run in two threads of its own: `server-feed` sends (the state's listener only hands the snapshot
over: a listener must not block), `server-requests` reads the server's requests and supervises the process; a pod=
query is resolved in a thread of its own (at most MAX_POD_THREADS at once), since a ledger read may take a second.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from agent.http.channel import MAX_REQUEST_BYTES, Channel, ChannelClosed
from agent.http.pod import PodLedger, resolve_fresh, unavailable
from agent.http.serving import Report, Setup
from agent.snapshot import Snapshot
from agent.state import HealthState

log = logging.getLogger(__name__)

REPORT_EVERY_SECONDS = 1.0
# A fresh interpreter importing the server's modules, on a busy node, under the container's CPU limit.
START_TIMEOUT_SECONDS = 30.0
RESTART_BACKOFF_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_SECONDS = 60.0  # a server that ran this long restarts without backoff
MAX_POD_THREADS = 32
MAX_NAME_CHARS = 512  # a pod's namespace or name in a request (Kubernetes allows 253)


class ServerProcess:
    """The HTTP server as a child process; what the daemon starts, logs and stops, like HttpServer."""

    def __init__(
        self,
        state: HealthState,
        render_metrics: Callable[[], bytes],
        healthz: Callable[[], tuple[bool, dict[str, Any]]],
        known_checks: Callable[[], Collection[str]],
        status_extra: Callable[[], dict[str, Any]],
        *,
        address: str,
        port: int,
        max_wait: float,
        metrics_port: int | None,
        status_on_main_port: bool,
        health_port: int | None,
        proc: str,
        pod_ledger: PodLedger | None,
        logging_setup: tuple[str, str],
        cgroup_procs: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._state = state
        self._render_metrics = render_metrics
        self._healthz = healthz
        self._known_checks = known_checks
        self._status_extra = status_extra
        self._pod_ledger = pod_ledger
        self._logging = logging_setup
        self._cgroup_procs = cgroup_procs  # where the server's process goes (not the work cgroup the agent joins)
        self.address, self.port, self.max_wait, self.proc = address, port, max_wait, proc
        self.metrics_port, self.health_port = metrics_port, health_port
        self._wanted: list[int | None] = [port, metrics_port, health_port]  # what each (re)start binds
        self.status_on_main_port = status_on_main_port
        self.pid = 0
        self.restarts = 0
        self._listening: dict[str, Any] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self._channel: Channel | None = None
        self._pending: Snapshot | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._pod_threads = threading.BoundedSemaphore(MAX_POD_THREADS)
        state.subscribe(self._on_snapshot)

    # --- what the daemon sees ----------------------------------------------------------------------

    def start(self) -> int:
        """Start the server's process and wait until it listens; OSError when the main port cannot be bound."""
        self._spawn()
        threading.Thread(target=self._feed, name="server-feed", daemon=True).start()
        threading.Thread(target=self._supervise, name="server-requests", daemon=True).start()
        return self.port

    def listening(self) -> dict[str, Any]:
        """The ports and what each serves, as the server's process reported them (HttpServer.listening)."""
        return dict(self._listening)

    def stop(self, timeout: float = 3.0) -> None:
        self._stopping.set()
        self._wake.set()
        channel, process = self._channel, self._process
        if channel is not None:
            try:
                channel.send_object("stop", None)
            except ChannelClosed:
                pass
        if process is not None:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if channel is not None:
            channel.close()

    # --- the process ---------------------------------------------------------------------------------

    def _setup(self) -> Setup:
        return Setup(
            address=self.address,
            port=self._wanted[0] or 0,
            metrics_port=self._wanted[1],
            status_on_main_port=self.status_on_main_port,
            health_port=self._wanted[2],
            max_wait=self.max_wait,
            proc=self.proc,
            log_format=self._logging[0],
            log_level=self._logging[1],
            agent_pid=os.getpid(),
            snapshot=self._state.current(),
            report=self._report(),
            metrics=self._render_metrics(),
            status=self._render_status()[0],
            cgroup_procs=self._cgroup_procs(),
        )

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        argv = [sys.executable, "-m", "agent.http.serving", str(theirs.fileno())]
        try:
            process = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        channel = Channel(ours, max_frame=MAX_REQUEST_BYTES)
        try:
            channel.send_object("setup", self._setup())
            ours.settimeout(START_TIMEOUT_SECONDS)
            report = channel.receive_json()
            ours.settimeout(None)
        except (ChannelClosed, OSError) as exc:
            process.kill()
            process.wait()
            channel.close()
            raise OSError(f"the HTTP server's process did not start: {exc}") from exc
        if report.get("kind") != "listening" or "error" in report:
            process.kill()
            process.wait()
            channel.close()
            raise OSError(str(report.get("error", f"the HTTP server's process said {report!r}")))
        self._listening = {key: value for key, value in report.items() if key not in ("kind", "pid")}
        self._adopt_ports()
        self.pid = int(report.get("pid", process.pid))
        with self._lock:
            self._process, self._channel = process, channel

    def _adopt_ports(self) -> None:
        """The ports the server bound, in HttpServer.listening()'s order (main, metrics, health; one it could not
        bind is left out): a port asked as 0 becomes the one bound, so a restarted server binds the same ones."""
        bound = [int(port["port"]) for port in self._listening.get("ports", ())]
        self.port = self._wanted[0] = bound.pop(0)
        for position, error in ((1, "metrics_port_error"), (2, "health_port_error")):
            wanted = self._wanted[position]
            if wanted is None or error in self._listening or not bound:
                setattr(self, ("metrics_port", "health_port")[position - 1], None)
                continue
            port = bound.pop(0)
            self._wanted[position] = port
            setattr(self, ("metrics_port", "health_port")[position - 1], port)

    def _supervise(self) -> None:
        backoff = 0
        while not self._stopping.is_set():
            started = time.monotonic()
            channel, process = self._channel, self._process
            assert channel is not None and process is not None
            try:
                self._follow(channel)
            except ChannelClosed as exc:
                if self._stopping.is_set():
                    return
                process.kill()
                code = process.wait()
                log.error("the HTTP server's process (pid %d) ended (%s, exit status %s)", self.pid, exc, code)
            backoff = 0 if time.monotonic() - started > STABLE_SECONDS else backoff
            while not self._stopping.is_set():
                self._stopping.wait(RESTART_BACKOFF_SECONDS[min(backoff, len(RESTART_BACKOFF_SECONDS) - 1)])
                backoff += 1
                if self._stopping.is_set():
                    return
                self.restarts += 1  # before: the new process starts from a /status that counts itself
                try:
                    self._spawn()
                except OSError as exc:
                    self.restarts -= 1
                    log.error("restarting the HTTP server's process failed: %s", exc)
                    continue
                log.warning("the HTTP server's process was restarted (pid %d)", self.pid)
                break

    def _follow(self, channel: Channel) -> None:
        while True:
            request = channel.receive_json()
            kind = request.get("kind")
            if kind == "metrics":
                self._send_metrics(channel)
            elif kind == "status":
                self._send_status(channel)
            elif kind == "pod":
                self._pod(channel, request)
            else:
                log.warning("unknown request from the HTTP server's process: %.80r", kind)

    # --- what the agent sends --------------------------------------------------------------------------

    def _on_snapshot(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._pending = snapshot
        self._wake.set()

    def _feed(self) -> None:
        reported = 0.0
        while not self._stopping.is_set():
            self._wake.wait(REPORT_EVERY_SECONDS)
            self._wake.clear()
            with self._lock:
                snapshot, self._pending = self._pending, None
                channel = self._channel
            if channel is None:
                continue
            try:
                if snapshot is not None:
                    channel.send_object("snapshot", snapshot)
                if time.monotonic() - reported >= REPORT_EVERY_SECONDS:
                    channel.send_object("report", self._report())
                    reported = time.monotonic()
            except ChannelClosed:
                continue  # the supervisor restarts it, with the snapshot of the moment

    def _report(self) -> Report:
        healthy, health = self._healthz()
        return Report(healthy, health, frozenset(self._known_checks()))

    def _render_status(self) -> tuple[bytes, int]:
        """/status's document (HttpServer's, less the server's own figures, which it adds) and its snapshot."""
        snapshot = self._state.current()
        document = snapshot.to_document(history=True)
        try:
            document.update(self._status_extra())
        except Exception as exc:  # noqa: BLE001 - the core document still answers
            document["status_extra_error"] = str(exc)
        document["http_server_restarts"] = self.restarts
        return json.dumps(document).encode(), snapshot.version

    def _send_status(self, channel: Channel) -> None:
        try:
            channel.send_object("status", self._render_status())
        except ChannelClosed:
            pass

    def _send_metrics(self, channel: Channel) -> None:
        version = self._state.current().version
        try:
            body = self._render_metrics()
        except Exception:  # the server serves its copy and asks again
            log.exception("rendering /metrics failed")
            return
        try:
            channel.send_object("metrics", (body, version))
        except ChannelClosed:
            pass

    def _pod(self, channel: Channel, request: dict[str, Any]) -> None:
        key, namespace, name = request.get("id"), request.get("namespace"), request.get("name")
        if not (isinstance(key, int) and isinstance(namespace, str) and isinstance(name, str)):
            log.warning("a malformed pod= request from the HTTP server's process")
            return
        namespace, name = namespace[:MAX_NAME_CHARS], name[:MAX_NAME_CHARS]
        if self._pod_ledger is None or not self._pod_threads.acquire(blocking=False):
            why = "no ledger" if self._pod_ledger is None else f"{MAX_POD_THREADS} pod= queries are being resolved"
            self._answer_pod(channel, key, unavailable(namespace, name, why))
            return
        ledger = self._pod_ledger

        def resolve() -> None:
            try:
                found = resolve_fresh(ledger, self._state.current, namespace, name)
            except Exception as exc:  # fail closed, never silent
                log.exception("resolving pod %s/%s failed", namespace, name)
                found = unavailable(namespace, name, f"resolving the pod failed: {type(exc).__name__}")
            finally:
                self._pod_threads.release()
            self._answer_pod(channel, key, found)

        threading.Thread(target=resolve, name="server-pod", daemon=True).start()

    @staticmethod
    def _answer_pod(channel: Channel, key: int, found: Any) -> None:
        try:
            channel.send_object("pod", (key, found))
        except ChannelClosed:
            pass
