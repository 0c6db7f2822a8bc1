"""HTTP on one port: /ready, /healthz, /metrics, /status. Read-only; answers from cached snapshots.

The server (agent/httpserver.py) runs its own asyncio loop in its own thread, so no probe, lock or
Kubernetes call can delay it. Long-polls (`/ready?wait=S`) wait on a future resolved when the state
publishes a new snapshot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from agent.httpserver import HttpServerCore, Request, Response
from agent.state import HealthState, Snapshot, Verdict, reason_dict
from probes.base import CATEGORIES

log = logging.getLogger(__name__)

READY_PARAMS = frozenset({"checks", "devices", "min_hbm_free_mib", "wait"})
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class BadQuery(ValueError):
    pass


@dataclass(frozen=True)
class ReadyQuery:
    checks: tuple[str, ...] | None = None
    devices: frozenset[int] | None = None
    min_hbm_free_mib: float | None = None
    wait: float = 0.0


def _number(name: str, text: str, upper: float | None = None) -> float:
    try:
        value = float(text)
    except ValueError:
        raise BadQuery(f"{name}={text!r}: not a number") from None
    if not math.isfinite(value) or value < 0:
        raise BadQuery(f"{name}={text!r}: must be a finite number >= 0")
    if upper is not None and value > upper:
        raise BadQuery(f"{name}={text!r}: at most {upper:g}")
    return value


def parse_ready_query(raw: dict[str, list[str]], known_checks: Collection[str], max_wait: float) -> ReadyQuery:
    """Validate /ready's query (name → values, as parse_qs gives). Raises BadQuery with the reason."""
    unknown = sorted(set(raw) - READY_PARAMS)
    if unknown:
        raise BadQuery(f"unknown parameter {unknown[0]!r} (allowed: {', '.join(sorted(READY_PARAMS))})")
    for key, values in raw.items():
        if len(values) > 1:
            raise BadQuery(f"parameter {key!r} given more than once")
    query = {key: values[0] for key, values in raw.items()}
    checks = devices = minimum = None
    wait = 0.0
    if "checks" in query:
        checks = tuple(part.strip() for part in query["checks"].split(","))
        for selector in checks:
            if not selector:
                raise BadQuery("checks: empty name in the list")
            if not selector_known(selector, known_checks):
                raise BadQuery(f"checks: unknown check or category {selector!r}")
    if "devices" in query:
        parsed: set[int] = set()
        for part in query["devices"].split(","):
            part = part.strip()
            if not part.isdigit():
                raise BadQuery(f"devices: {part!r} is not a device index (comma-separated integers >= 0)")
            parsed.add(int(part))
        devices = frozenset(parsed)
    if "min_hbm_free_mib" in query:
        minimum = _number("min_hbm_free_mib", query["min_hbm_free_mib"])
    if "wait" in query:
        wait = _number("wait", query["wait"], upper=max_wait)
    return ReadyQuery(checks, devices, minimum, wait)


def selector_known(selector: str, known_checks: Collection[str]) -> bool:
    if selector in CATEGORIES:
        return True
    return any(check == selector or check.startswith(selector + ".") for check in known_checks)


class HttpServer:
    def __init__(
        self,
        state: HealthState,
        render_metrics: Callable[[], bytes],
        healthz: Callable[[], tuple[bool, dict[str, Any]]],
        known_checks: Callable[[], Collection[str]],
        status_extra: Callable[[], dict[str, Any]] = dict,
        address: str = "0.0.0.0",
        port: int = 9100,
        max_wait: float = 300.0,
    ) -> None:
        self._state = state
        self._render_metrics = render_metrics
        self._healthz = healthz
        self._known_checks = known_checks
        self._status_extra = status_extra
        self.address = address
        self.port = port
        self.max_wait = max_wait
        self._core = HttpServerCore(
            {
                "/ready": self._ready,
                "/healthz": self._healthz_handler,
                "/metrics": self._metrics,
                "/status": self._status,
            }
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Future[None] | None = None
        self._plain_cache: tuple[int, bytes, float] | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        state.subscribe(self._on_snapshot)

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> int:
        """Bind and serve in a background thread; returns the bound port (useful with port 0)."""
        self._thread = threading.Thread(target=self._serve, name="http", daemon=True)
        self._thread.start()
        self._started.wait(10)
        if self._start_error is not None:
            raise self._start_error
        return self.port

    def stop(self, timeout: float = 3.0) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        future = asyncio.run_coroutine_threadsafe(self._core.close(), loop)
        try:
            future.result(timeout)
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self._changed = loop.create_future()
            self.port = loop.run_until_complete(self._core.listen(self.address, self.port))
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._start_error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
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

    # --- handlers --------------------------------------------------------------------------------

    def _ready(self, request: Request) -> Response | Awaitable[Response]:
        if not request.query_string:
            fast = self._plain_ready()
            if fast is not None:
                return fast
        try:
            query = parse_ready_query(request.query, self._known_checks(), self.max_wait)
        except BadQuery as exc:
            return _json({"error": str(exc)}, 400)
        snapshot = self._state.snapshot.current()
        verdict = snapshot.evaluate(query.checks, query.devices, query.min_hbm_free_mib)
        if verdict.ready or query.wait <= 0:
            return _json(ready_body(snapshot.node, verdict), 200 if verdict.ready else 503)
        return self._long_poll(query)

    async def _long_poll(self, query: ReadyQuery) -> Response:
        deadline = time.monotonic() + query.wait
        while True:
            snapshot = self._state.snapshot.current()
            verdict = snapshot.evaluate(query.checks, query.devices, query.min_hbm_free_mib)
            remaining = deadline - time.monotonic()
            if verdict.ready or remaining <= 0 or self._changed is None:
                return _json(ready_body(snapshot.node, verdict), 200 if verdict.ready else 503)
            try:
                # Also wake each second: a result may go stale (or fresh) without a new snapshot.
                await asyncio.wait_for(asyncio.shield(self._changed), min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass

    def _plain_ready(self) -> Response | None:
        """/ready without parameters, the pre-flight every job sends: the body is serialized once per
        snapshot and only the age is filled in per request."""
        snapshot = self._state.snapshot
        if snapshot.current() is not snapshot:
            return None  # something went stale since the snapshot was published: evaluate afresh
        cached = self._plain_cache
        if cached is None or cached[0] != snapshot.version:
            body = json.dumps(ready_body(snapshot.node, snapshot.verdict))
            prefix, _, _ = body.rpartition('"age_seconds": ')
            cached = (snapshot.version, prefix.encode() + b'"age_seconds": ', snapshot.oldest_observed)
            self._plain_cache = cached
        age = max(0.0, time.time() - cached[2])
        return Response(200 if snapshot.ready else 503, cached[1] + f"{age:.3f}}}".encode())

    def _healthz_handler(self, request: Request) -> Response:
        if request.query_string:
            return _json({"error": "/healthz takes no parameters"}, 400)
        healthy, detail = self._healthz()
        return _json({"ok": healthy, **detail}, 200 if healthy else 503)

    def _metrics(self, request: Request) -> Response:
        if request.query_string:
            return _json({"error": "/metrics takes no parameters"}, 400)
        return Response(200, self._render_metrics(), content_type=METRICS_TYPE)

    def _status(self, request: Request) -> Response:
        if request.query_string:
            return _json({"error": "/status takes no parameters"}, 400)
        document = self._state.snapshot.current().to_document()
        try:
            document.update(self._status_extra())
        except Exception as exc:  # noqa: BLE001 - the core document still answers
            document["status_extra_error"] = str(exc)
        return _json(document, 200)


def ready_body(node: str, verdict: Verdict) -> dict[str, Any]:
    return {
        "ready": verdict.ready,
        "node": node,
        "reasons": [reason_dict(f) for f in verdict.reasons],
        "age_seconds": verdict.age_seconds,
    }


def _json(body: dict[str, Any], status: int) -> Response:
    return Response(status, json.dumps(body).encode())
