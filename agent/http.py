"""HTTP on one port: the routes /ready, /healthz, /metrics, /status and their answers. Read-only.

The server (agent/httpserver.py) runs its own asyncio loop in its own thread, so no probe, lock or
Kubernetes call can delay it. Every answer is judged from `HealthState.current()`; /ready's query is parsed
and judged by agent/ready.py. Long-polls (`/ready?wait=S`) wait on a future resolved when the state
publishes a new snapshot. Every answer is computed from the snapshot at most once per snapshot where it
can be (/ready without parameters, /metrics, /status).

/ready answers JSON by default and plain text (`format=text`, or `Accept: text/plain`) for job logs: the
first line says `ready` or `not ready`, then one bounded line per reason with its fix (ASCII `...` where a
line is cut: the reader may be a terminal).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Hashable
from http import HTTPStatus
from typing import Any

from agent.httpserver import MAX_QUERY_FIELDS, HttpServerCore, Limits, Request, Response
from agent.ready import BadQuery, ReadyQuery, judge, parse_ready_query, prefers_text, wants_text
from agent.snapshot import Snapshot, Verdict, reason_dict
from agent.state import HealthState
from probes.base import Finding, Sample
from probes.text import ASCII_ELLIPSIS, clip, one_line

log = logging.getLogger(__name__)

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXT_TYPE = "text/plain; charset=utf-8"
MAX_LONG_POLLS = 256
STATUS_MAX_AGE_SECONDS = 1.0
TEXT_LINE_MAX = 200  # characters per text line, so a CI log shows each reason whole
TEXT_REASONS_MAX = 20
_FIX = " -- fix: "


# --- answers ----------------------------------------------------------------------------------------


def _fold(text: str, limit: int | None = None) -> str:
    """Text for a text answer: one line, cut with an ASCII ellipsis."""
    return one_line(text, limit, ASCII_ELLIPSIS)


def _cut(text: str, limit: int) -> str:
    return clip(text, limit, ASCII_ELLIPSIS)


def ready_body(node: str, verdict: Verdict) -> dict[str, Any]:
    return {
        "ready": verdict.ready,
        "node": node,
        "reasons": [reason_dict(f) for f in verdict.reasons],
        "age_seconds": verdict.age_seconds,
    }


def reason_line(finding: Finding) -> str:
    """`fail storage.space /data DiskFull: 98% used -- fix: clean caches`, at most TEXT_LINE_MAX characters;
    the message and the fix share the room, each ellipsized only as far as needed."""
    prefix = (
        f"{finding.status.value} {_fold(finding.check, 48)} {_fold(finding.subject, 48) or '-'} "
        f"{_fold(finding.reason, 48)}: "
    )
    message, hint = _fold(finding.message), _fold(finding.hint)
    room = TEXT_LINE_MAX - len(prefix) - (len(_FIX) if hint else 0)
    hint_room = min(len(hint), max(room // 2, room - len(message)))
    line = prefix + _cut(message, room - hint_room)
    return line + _FIX + _cut(hint, hint_room) if hint else line


def ready_text(node: str, verdict: Verdict) -> bytes:
    name = _fold(node, 80)
    count = len(verdict.reasons)
    if verdict.ready:
        lines = [f"ready on {name}"]
    else:
        lines = [f"not ready on {name}: {count} reason{'' if count == 1 else 's'}"]
    lines.extend(reason_line(finding) for finding in verdict.reasons[:TEXT_REASONS_MAX])
    if count > TEXT_REASONS_MAX:
        lines.append(f"... and {count - TEXT_REASONS_MAX} more (the JSON answer and /status list them all)")
    return ("\n".join(lines) + "\n").encode()


def ready_response(node: str, verdict: Verdict, text: bool) -> Response:
    status = 200 if verdict.ready else 503
    if text:
        return Response(status, ready_text(node, verdict), content_type=TEXT_TYPE)
    return _json(ready_body(node, verdict), status)


def error_answer(status: int, message: str, text: bool, headers: dict[str, str] | None = None) -> Response:
    if text:
        body = f"{HTTPStatus(status).phrase.lower()}: {_fold(message, 400)}\n".encode()
        return Response(status, body, content_type=TEXT_TYPE, headers=headers or {})
    return Response(status, json.dumps({"error": message}).encode(), headers=headers or {})


def _json(body: dict[str, Any], status: int) -> Response:
    return Response(status, json.dumps(body).encode())


# --- the server ---------------------------------------------------------------------------------------


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
        limits: Limits | None = None,
        max_long_polls: int = MAX_LONG_POLLS,
    ) -> None:
        self._state = state
        self._render_metrics = render_metrics
        self._healthz = healthz
        self._known_checks = known_checks
        self._status_extra = status_extra
        self.address = address
        self.port = port
        self.max_wait = max_wait
        self.max_long_polls = max_long_polls
        self.long_polls = 0
        self.core = HttpServerCore(
            {
                "/ready": self._ready,
                "/healthz": self._healthz_handler,
                "/metrics": self._metrics,
                "/status": self._status,
            },
            limits,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Future[None] | None = None
        self._plain_cache: tuple[int, bytes, float] | None = None
        self._status_cache: tuple[Hashable, float, bytes] | None = None
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
        future = asyncio.run_coroutine_threadsafe(self.core.close(), loop)
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

    # --- figures ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Connection figures, for /status and /metrics; read on the server's loop (handlers run there)."""
        core = self.core
        return {
            "connections": len(core.connections),
            "peers": len(core.per_peer),
            "refused_total": core.refused,
            "long_polls": self.long_polls,
            "tasks": len(asyncio.all_tasks(self._loop)) if self._loop is not None else 0,
            "unsent_bytes": sum(connection.unsent_bytes() for connection in core.connections),
        }

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
            snapshot = self._state.current()
            verdict = judge(snapshot, query)
        except BadQuery as exc:
            return error_answer(400, str(exc), text)
        if verdict.ready or query.wait <= 0:
            return ready_response(snapshot.node, verdict, text)
        if self.long_polls >= self.max_long_polls:
            return error_answer(
                429,
                f"{self.long_polls} long-polls are waiting already: retry, or ask without wait=",
                text,
                {"Retry-After": "1"},
            )
        # Counted from here and uncounted when the task ends however it ends (a task cancelled before its
        # first step never runs its coroutine's finally).
        self.long_polls += 1
        task = asyncio.get_running_loop().create_task(self._long_poll(query, snapshot.version))
        task.add_done_callback(self._long_poll_done)
        return task

    def _long_poll_done(self, _task: asyncio.Future[Response]) -> None:
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
            if snapshot.version == judged_version and not snapshot.aged and remaining > 1.0:
                continue  # nothing new to judge
            judged_version = snapshot.version
            try:
                verdict = judge(snapshot, query)
            except BadQuery as exc:
                return error_answer(400, str(exc), query.text)
            if verdict.ready or time.monotonic() >= deadline or self._changed is None:
                return ready_response(snapshot.node, verdict, query.text)

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
            return _json({"error": "/healthz takes no parameters"}, 400)
        healthy, detail = self._healthz()
        return _json({"ok": healthy, **detail}, 200 if healthy else 503)

    def _metrics(self, request: Request) -> Response:
        if request.query_string:
            return _json({"error": "/metrics takes no parameters"}, 400)
        return Response(200, self._render_metrics(), content_type=METRICS_TYPE)

    def _status(self, request: Request) -> Response:
        """Serialized once per snapshot, and at most once a second for the agent's own part."""
        if request.query_string:
            return _json({"error": "/status takes no parameters"}, 400)
        snapshot = self._state.current()
        key, now = snapshot.cache_key, time.monotonic()
        cached = self._status_cache
        if cached is not None and cached[0] == key and now - cached[1] < STATUS_MAX_AGE_SECONDS:
            return Response(200, cached[2])
        document = snapshot.to_document()
        try:
            document.update(self._status_extra())
        except Exception as exc:  # noqa: BLE001 - the core document still answers
            document["status_extra_error"] = str(exc)
        document["http"] = self.stats()
        body = json.dumps(document).encode()
        self._status_cache = (key, now, body)
        return Response(200, body)
