"""HTTP: the routes /ready, /healthz, /started, /metrics, /status and /preflight.sh, on one port or two. Read-only.

The server (agent/http/server.py) runs its own asyncio loop in its own thread, so no probe, lock or
Kubernetes call can delay it. Every answer is judged from `HealthState.current()`; /ready's query is parsed
and judged by agent/ready.py (`pod=` by agent/http/pod.py), its answers are agent/http/answers.py's. Long-polls
(`/ready?wait=S`) wait on a future resolved when the state publishes a new snapshot. Every answer is computed
from the snapshot at most once per snapshot where it can be (/ready without parameters, /metrics, /status).

Ports: `port` serves /ready, /preflight.sh, /healthz and /started, and /metrics and /status too unless
`status_on_main_port` is off; `metrics_port` (None: no second port) serves /metrics, /status, /healthz and
/started, so that a NetworkPolicy, which selects ports and not paths, can leave /ready open to every pod and
/status to monitoring only. Both ports are listeners of one HttpServerCore: one connection budget, one loop. A
metrics port that cannot be bound is logged and left out (`metrics_port_error`): the pre-flight port never goes
down for it.

`health_port` (None: none) serves only /healthz and /started, for the kubelet's probes, on an HttpServerCore of its
own on the same loop: its own small pool (`health_limits`), with slots only the node's own addresses can take
(`agent.http.addresses`), so whatever the pods hold on the other ports, or on this one, the probes get in.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Hashable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from agent.http.addresses import NodeAddresses
from agent.http.answers import METRICS_TYPE as METRICS_TYPE
from agent.http.answers import TEXT_LINE_MAX as TEXT_LINE_MAX
from agent.http.answers import TEXT_REASONS_MAX as TEXT_REASONS_MAX
from agent.http.answers import Scope, error_answer, json_answer, ready_body, ready_response
from agent.http.answers import ready_text as ready_text
from agent.http.limits import health_limits
from agent.http.pod import LocalPods, PodDevices, PodLedger, PodSource, unavailable
from agent.http.server import MAX_QUERY_FIELDS, Handler, HttpServerCore, Limits, Request, Response
from agent.ready import BadQuery, ReadyQuery, judge, parse_ready_query, prefers_text, wants_text
from agent.snapshot import Snapshot, Verdict
from probes.base import Sample

log = logging.getLogger(__name__)

MAX_LONG_POLLS = 256
# deploy/examples/preflight.sh, shipped in the package (the same bytes: tests/deploy/test_preflight_served.py).
PREFLIGHT_SCRIPT = (Path(__file__).parent / "preflight.sh").read_bytes()
SCRIPT_TYPE = "text/x-shellscript; charset=utf-8"
STATUS_MAX_AGE_SECONDS = 1.0


class StateView(Protocol):
    """What the server reads the health state through: agent.state.HealthState in the agent's process, the
    replica of it in the server's (agent/http/serving.py)."""

    def current(self) -> Snapshot: ...

    def subscribe(self, listener: Callable[[Snapshot], None]) -> None: ...


class HttpServer:
    def __init__(
        self,
        state: StateView,
        render_metrics: Callable[[], bytes],
        healthz: Callable[[], tuple[bool, dict[str, Any]]],
        known_checks: Callable[[], Collection[str]],
        status_extra: Callable[[], dict[str, Any]] = dict,
        address: str = "0.0.0.0",
        port: int = 9100,
        max_wait: float = 300.0,
        limits: Limits | None = None,
        max_long_polls: int = MAX_LONG_POLLS,
        *,
        metrics_port: int | None = None,
        status_on_main_port: bool = True,
        pod_ledger: PodLedger | None = None,
        pod_source: PodSource | None = None,
        remote_metrics: Callable[[], Awaitable[bytes | None]] | None = None,
        remote_status: Callable[[], Awaitable[bytes | None]] | None = None,
        health_port: int | None = None,
        node_addresses: NodeAddresses | None = None,
    ) -> None:
        self._state = state
        self._render_metrics = render_metrics
        self._healthz = healthz
        self._known_checks = known_checks
        self._status_extra = status_extra
        # /metrics and /status rendered elsewhere (the agent's process, agent/http/serving.py), None when none is
        # young enough; this server adds its own figures.
        self._remote_metrics = remote_metrics
        self._remote_status = remote_status
        # /ready?pod=: the ledger read here (LocalPods), or asked of the agent's process (agent/http/serving.py).
        self._pods = pod_source or (LocalPods(pod_ledger, state.current) if pod_ledger is not None else None)
        self.address = address
        self.port = port
        self.metrics_port = metrics_port
        self.metrics_port_error = ""
        self.max_wait = max_wait
        self.max_long_polls = max_long_polls
        self.long_polls = 0
        common: dict[str, Handler] = {"/healthz": self._healthz_handler, "/started": self._started}
        status: dict[str, Handler] = {"/metrics": self._metrics, "/status": self._status}
        main = {"/ready": self._ready, "/preflight.sh": self._preflight, **common}
        self.core = HttpServerCore({**main, **(status if status_on_main_port else {})}, limits)
        self.metrics_routes: dict[str, Handler] = {**status, **common}
        self.health_port = health_port
        self.health_port_error = ""
        self.node_addresses = node_addresses or NodeAddresses()
        self.health = HttpServerCore(common, health_limits(), self.node_addresses.is_node)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Future[None] | None = None
        self._plain_cache: tuple[int, bytes, float] | None = None
        self._status_cache: tuple[Hashable, float, bytes] | None = None
        self._thread: threading.Thread | None = None
        self._started_event = threading.Event()
        self._start_error: BaseException | None = None
        state.subscribe(self._on_snapshot)

    @property
    def main_routes(self) -> tuple[str, ...]:
        return tuple(self.core.routes)

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> int:
        """Bind and serve in a background thread; returns the bound main port (useful with port 0)."""
        self._thread = threading.Thread(target=self._serve, name="http", daemon=True)
        self._thread.start()
        self._started_event.wait(10)
        if self._start_error is not None:
            raise self._start_error
        return self.port

    def stop(self, timeout: float = 3.0) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        for core in (self.core, self.health):
            future = asyncio.run_coroutine_threadsafe(core.close(), loop)
            try:
                future.result(timeout)
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:  # closed meanwhile
            return
        if self._thread is not None:
            self._thread.join(timeout)

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self._changed = loop.create_future()
            self.port = loop.run_until_complete(self.core.listen(self.address, self.port))
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._start_error = exc
            self._started_event.set()
            loop.close()
            return
        if self.metrics_port is not None:
            try:
                routes = self.metrics_routes
                self.metrics_port = loop.run_until_complete(self.core.listen(self.address, self.metrics_port, routes))
            except OSError as exc:
                self.metrics_port_error = f"{self.address}:{self.metrics_port}: {exc.strerror or exc}"
                log.error("cannot serve the metrics port (/metrics, /status): %s", self.metrics_port_error)
                self.metrics_port = None
        if self.health_port is not None:
            self.node_addresses.refresh()
            try:
                self.health_port = loop.run_until_complete(self.health.listen(self.address, self.health_port))
            except OSError as exc:
                self.health_port_error = f"{self.address}:{self.health_port}: {exc.strerror or exc}"
                log.error("cannot serve the health port (/healthz, /started): %s", self.health_port_error)
                self.health_port = None
        self._started_event.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def _on_snapshot(self, _snapshot: Snapshot) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._wake_waiters)
            except RuntimeError:  # loop closed meanwhile
                pass

    def _wake_waiters(self) -> None:
        changed = self._changed
        if changed is not None and not changed.done():
            changed.set_result(None)
        self._changed = asyncio.get_running_loop().create_future()

    # --- figures ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Connection figures, for /status and /metrics; read on the server's loop (handlers run there)."""
        core, health = self.core, self.health
        return {
            "connections": len(core.connections) + len(health.connections),
            "health_connections": len(health.connections),
            "node_connections": health.node_held,
            "peers": len(core.per_peer.keys() | health.per_peer.keys()),
            "refused_total": core.refused + health.refused,
            "long_polls": self.long_polls,
            "tasks": len(asyncio.all_tasks(self._loop)) if self._loop is not None else 0,
            "unsent_bytes": sum(c.unsent_bytes() for c in core.connections | health.connections),
        }

    def listening(self) -> dict[str, Any]:
        """The ports and what each serves, for /status (`http.ports`)."""
        ports = [{"port": self.port, "routes": list(self.main_routes)}]
        if self.metrics_port is not None:
            ports.append({"port": self.metrics_port, "routes": list(self.metrics_routes)})
        if self.health_port is not None:
            ports.append({"port": self.health_port, "routes": list(self.health.routes)})
        out: dict[str, Any] = {"ports": ports}
        if self.metrics_port_error:
            out["metrics_port_error"] = self.metrics_port_error
        if self.health_port_error:
            out["health_port_error"] = self.health_port_error
        return out

    def stats_from_thread(self, timeout: float = 10.0) -> dict[str, int]:
        loop = self._loop
        if loop is None or loop.is_closed():
            return {}

        async def read() -> dict[str, int]:
            return self.stats()

        return asyncio.run_coroutine_threadsafe(read(), loop).result(timeout)

    def samples(self) -> list[Sample]:
        figures = self.stats()
        return [
            Sample("nodehealth_http_connections", "Open HTTP connections.", figures["connections"]),
            Sample(
                "nodehealth_http_connections_refused_total",
                "HTTP connections refused by the connection limits (in all, per peer, reserve).",
                figures["refused_total"],
                kind="counter",
            ),
            Sample("nodehealth_http_long_polls", "/ready?wait= requests waiting.", figures["long_polls"]),
        ]

    # --- /ready ----------------------------------------------------------------------------------

    def _ready(self, request: Request) -> Response | Awaitable[Response]:
        accept = request.headers.get("accept", "")
        if not request.query_string and accept in ("", "*/*"):
            fast = self._plain_ready()
            if fast is not None:
                return fast
        try:
            raw = request.query
        except ValueError:
            return error_answer(400, f"at most {MAX_QUERY_FIELDS} query parameters", prefers_text(accept))
        text = wants_text(raw, accept)
        try:
            query = parse_ready_query(raw, self._known_checks(), self.max_wait, accept)
        except BadQuery as exc:
            return error_answer(400, str(exc), text)
        if query.pod is not None:
            # Judged after a fresh read of the kubelet's ledger, which runs in a thread: a task of its own.
            return asyncio.get_running_loop().create_task(self._ready_after_ledger(query))
        snapshot = self._state.current()
        try:
            verdict = judge(snapshot, query)
        except BadQuery as exc:
            return error_answer(400, str(exc), text)
        if verdict.ready or query.wait <= 0:
            return ready_response(snapshot.node, verdict, text)
        if self.long_polls >= self.max_long_polls:
            return self._too_many_long_polls(text)
        # Counted from here and uncounted when the task ends however it ends (a task cancelled before its
        # first step never runs its coroutine's finally).
        self.long_polls += 1
        task = asyncio.get_running_loop().create_task(self._long_poll(query, snapshot.version))
        task.add_done_callback(self._long_poll_done)
        return task

    def _too_many_long_polls(self, text: bool) -> Response:
        message = f"{self.long_polls} long-polls are waiting already: retry, or ask without wait="
        return error_answer(429, message, text, {"Retry-After": "1"})

    def _long_poll_done(self, _task: asyncio.Future[Response]) -> None:
        self.long_polls -= 1

    async def _ready_after_ledger(self, query: ReadyQuery) -> Response:
        try:
            snapshot, verdict, scope = await self._judge(query)
        except BadQuery as exc:
            return error_answer(400, str(exc), query.text)
        if verdict.ready or query.wait <= 0:
            return ready_response(snapshot.node, verdict, query.text, scope)
        if self.long_polls >= self.max_long_polls:
            return self._too_many_long_polls(query.text)
        self.long_polls += 1
        try:
            return await self._long_poll(query, snapshot.version)
        finally:
            self.long_polls -= 1

    async def _long_poll(self, query: ReadyQuery, judged_version: int) -> Response:
        """Judged not ready at `judged_version` by _ready: waits first, then judges again."""
        deadline = time.monotonic() + query.wait
        while True:
            remaining = deadline - time.monotonic()
            if remaining > 0 and self._changed is not None:
                try:
                    # Also wake each second: a result may go stale (or fresh) without a new snapshot.
                    await asyncio.wait_for(asyncio.shield(self._changed), min(remaining, 1.0))
                except asyncio.TimeoutError:
                    pass
            snapshot = self._state.current()
            unchanged = snapshot.version == judged_version and not snapshot.aged and query.pod is None
            if unchanged and remaining > 1.0:
                continue  # nothing new to judge (the ledger changes without a new snapshot: pod= judges again)
            try:
                snapshot, verdict, scope = await self._judge(query)
            except BadQuery as exc:
                return error_answer(400, str(exc), query.text)
            judged_version = snapshot.version
            if verdict.ready or time.monotonic() >= deadline or self._changed is None:
                return ready_response(snapshot.node, verdict, query.text, scope)

    async def _judge(self, query: ReadyQuery) -> tuple[Snapshot, Verdict, Scope | None]:
        """The snapshot judged, the verdict, and for pod= what it judged: the pod's devices from the ledger; failing
        that, devices= when given; failing that, not ready with the reason, beside the node-wide reasons."""
        if query.pod is None:
            snapshot = self._state.current()
            return snapshot, judge(snapshot, query), None
        found = await self._pod_devices(*query.pod)
        snapshot = self._state.current()
        if found.known:
            scoped = replace(query, device_indices=None, device_ids=(), device_keys=found.devices)
            return snapshot, judge(snapshot, scoped), Scope(found.to_dict(), found.describe())
        if query.devices_given:
            scope = Scope(found.to_dict(fallback=True), found.describe(fallback=True))
            return snapshot, judge(snapshot, query), scope
        node_wide = judge(snapshot, replace(query, device_indices=None, device_ids=(), device_keys=frozenset()))
        assert found.reason is not None
        reasons = (found.reason, *node_wide.reasons)
        return snapshot, Verdict(False, reasons, node_wide.age_seconds), Scope(found.to_dict(), found.describe())

    async def _pod_devices(self, namespace: str, name: str) -> PodDevices:
        if self._pods is None:
            return unavailable(namespace, name, "this server was started without the kubelet's ledger")
        return await self._pods.devices(namespace, name)

    def _plain_ready(self) -> Response | None:
        """/ready without parameters, the pre-flight every job sends: the body is serialized once per
        snapshot and only the age is filled in per request."""
        snapshot = self._state.current()
        if snapshot.aged:
            return None  # something went stale since the snapshot was published: evaluate afresh
        cached = self._plain_cache
        if cached is None or cached[0] != snapshot.version:
            body = json.dumps(ready_body(snapshot.node, snapshot.verdict))
            prefix, _, _ = body.rpartition('"age_seconds": ')
            cached = (snapshot.version, prefix.encode() + b'"age_seconds": ', snapshot.oldest_observed)
            self._plain_cache = cached
        age = max(0.0, time.time() - cached[2])
        return Response(200 if snapshot.ready else 503, cached[1] + f"{age:.3f}}}".encode())

    # --- the others ------------------------------------------------------------------------------

    def _healthz_handler(self, request: Request) -> Response:
        if request.query_string:
            return json_answer({"error": "/healthz takes no parameters"}, 400)
        healthy, detail = self._healthz()
        return json_answer({"ok": healthy, **detail}, 200 if healthy else 503)

    def _preflight(self, request: Request) -> Response:
        """The jobs' pre-flight script, as this release ships it: an init container fetches it from its node's agent
        and runs it, so no namespace keeps a copy (docs/preflight.md)."""
        if request.query_string:
            return json_answer({"error": "/preflight.sh takes no parameters"}, 400)
        return Response(200, PREFLIGHT_SCRIPT, content_type=SCRIPT_TYPE)

    def _started(self, request: Request) -> Response:
        """The DaemonSet's readiness: every configured probe has finished (or timed out in) a run since the agent
        started, so a rollout moves on only once a new agent has judged its node once."""
        if request.query_string:
            return json_answer({"error": "/started takes no parameters"}, 400)
        snapshot = self._state.current()
        pending = [probe.name for probe in snapshot.probes if probe.last_run is None]
        body = {"started": not pending, "node": snapshot.node, "probes": len(snapshot.probes), "pending": pending}
        return json_answer(body, 503 if pending else 200)

    def _metrics(self, request: Request) -> Response | Awaitable[Response]:
        if request.query_string:
            return json_answer({"error": "/metrics takes no parameters"}, 400)
        if self._remote_metrics is not None:
            return asyncio.get_running_loop().create_task(self._metrics_from(self._remote_metrics))
        return Response(200, self._render_metrics(), content_type=METRICS_TYPE)

    async def _metrics_from(self, render: Callable[[], Awaitable[bytes | None]]) -> Response:
        body = await render()
        if body is None:
            return json_answer({"error": "the agent's process has not rendered /metrics lately"}, 503)
        return Response(200, body, content_type=METRICS_TYPE)

    def _status(self, request: Request) -> Response | Awaitable[Response]:
        """Serialized once per snapshot, and at most once a second for the agent's own part."""
        if request.query_string:
            return json_answer({"error": "/status takes no parameters"}, 400)
        if self._remote_status is not None:
            return asyncio.get_running_loop().create_task(self._status_from(self._remote_status))
        snapshot = self._state.current()
        key, now = snapshot.cache_key, time.monotonic()
        cached = self._status_cache
        if cached is not None and cached[0] == key and now - cached[1] < STATUS_MAX_AGE_SECONDS:
            return Response(200, cached[2])
        document = snapshot.to_document(history=True)
        try:
            document.update(self._status_extra())
        except Exception as exc:  # noqa: BLE001 - the core document still answers
            document["status_extra_error"] = str(exc)
        document["http"] = {**self.stats(), **self.listening()}
        body = json.dumps(document).encode()
        self._status_cache = (key, now, body)
        return Response(200, body)

    async def _status_from(self, render: Callable[[], Awaitable[bytes | None]]) -> Response:
        """The document as rendered elsewhere (a JSON object), with this server's figures added as `http`."""
        body = await render()
        if body is None or not body.endswith(b"}"):
            return json_answer({"error": "the agent's process has not rendered /status lately"}, 503)
        figures = json.dumps({**self.stats(), **self.listening()}).encode()
        return Response(200, body[:-1] + b', "http": ' + figures + b"}")
