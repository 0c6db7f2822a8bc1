"""HTTP on one port: /ready, /healthz, /metrics, /status. Read-only; answers from cached snapshots.

The server (agent/httpserver.py) runs its own asyncio loop in its own thread, so no probe, lock or
Kubernetes call can delay it. Long-polls (`/ready?wait=S`) wait on a future resolved when the state
publishes a new snapshot. Every answer is computed from the snapshot at most once per snapshot where it
can be (/ready without parameters, /metrics, /status), and a query's cost is bounded by its parser.

/ready answers JSON by default and plain text (`format=text`, or `Accept: text/plain`) for job logs: the
first line says `ready` or `not ready`, then one bounded line per reason with its fix.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Hashable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from agent.httpserver import MAX_QUERY_FIELDS, HttpServerCore, Limits, Request, Response, clip
from agent.metrics import snapshot_key
from agent.state import HealthState, Snapshot, Verdict, reason_dict
from probes.base import CATEGORIES, OBSERVED_DEVICE_IDS, Finding, Sample, Status

log = logging.getLogger(__name__)

READY_PARAMS = frozenset(
    {"checks", "devices", "format", "min_hbm_free_mib", "min_host_mem_mib", "min_hugepages", "wait"}
)
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXT_TYPE = "text/plain; charset=utf-8"
MAX_SELECTORS = 32  # distinct checks= entries
MAX_DEVICES = 128  # distinct devices= entries: 16 accelerators with 7 MIG devices each fit
MAX_DEVICE_INDEX = 65535
MAX_LONG_POLLS = 256
STATUS_MAX_AGE_SECONDS = 1.0
TEXT_LINE_MAX = 200  # characters per text line, so a CI log shows each reason whole
TEXT_REASONS_MAX = 20
_FIX = " -- fix: "

# ASCII digits only (an Arabic-Indic digit passes str.isdigit and int()), bounded in length before any conversion.
_DECIMAL = re.compile(r"[0-9]{1,15}(?:\.[0-9]{1,9})?")
_INDEX = re.compile(r"[0-9]{1,5}")
# GPU UUIDs (GPU-<uuid>) and MIG device ids (MIG-<uuid>, or the older MIG-GPU-<uuid>/<gi>/<ci>).
_NVIDIA_ID = re.compile(r"(?:[Gg][Pp][Uu]|[Mm][Ii][Gg])-[0-9A-Za-z/-]{1,96}")
_Q_VALUE = re.compile(r"(?:0(?:\.[0-9]{0,3})?|1(?:\.0{0,3})?)")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


class BadQuery(ValueError):
    pass


@dataclass(frozen=True)
class ReadyQuery:
    checks: tuple[str, ...] | None = None
    device_indices: frozenset[int] | None = None  # None: every device (no devices=, or devices=all)
    device_ids: tuple[str, ...] = ()  # GPU-/MIG- ids, resolved to indices against each snapshot
    min_hbm_free_mib: float | None = None
    min_host_mem_mib: float | None = None
    min_hugepages: float | None = None
    wait: float = 0.0
    text: bool = False


def _echo(value: str) -> str:
    """A client's value quoted in an error message, bounded."""
    return repr(clip(value, 64))


def _number(name: str, text: str, upper: float | None = None) -> float:
    if not _DECIMAL.fullmatch(text):
        raise BadQuery(f"{name}={_echo(text)}: not a number (digits, optionally with a decimal point)")
    value = float(text)
    if upper is not None and value > upper:
        raise BadQuery(f"{name}={_echo(text)}: at most {upper:g}")
    return value


def distinct_parts(text: str, limit: int) -> tuple[str, ...] | None:
    """The comma-separated parts, stripped, without repeats, in order; None when more than `limit` distinct
    ones or more than 4 * `limit` in all (counted at C speed before any is split off: a name repeated
    thousands of times in one request head must not cost the loop that answers everyone)."""
    if text.count(",") >= 4 * limit:
        return None
    distinct = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    return distinct if len(distinct) <= limit else None


def parse_checks(text: str, known_checks: Collection[str]) -> tuple[str, ...]:
    selectors = distinct_parts(text, MAX_SELECTORS)
    if selectors is None:
        raise BadQuery(f"checks: at most {MAX_SELECTORS} different names, {4 * MAX_SELECTORS} in all")
    for selector in selectors:
        if not selector:
            raise BadQuery("checks: empty name in the list")
        if not selector_known(selector, known_checks):
            raise BadQuery(f"checks: unknown check or category {_echo(selector)}")
    return selectors


def parse_devices(text: str) -> tuple[frozenset[int] | None, tuple[str, ...]]:
    """`0,1,2`, GPU UUIDs and MIG ids, as the device plugins set *_VISIBLE_DEVICES; `all` selects every one."""
    parts = distinct_parts(text, MAX_DEVICES)
    if parts == ("all",):
        return None, ()
    if parts is None:
        raise BadQuery(f"devices: at most {MAX_DEVICES} different devices, {4 * MAX_DEVICES} in all")
    indices: set[int] = set()
    ids: list[str] = []
    for part in parts:
        if _INDEX.fullmatch(part) and int(part) <= MAX_DEVICE_INDEX:
            indices.add(int(part))
        elif _NVIDIA_ID.fullmatch(part):
            ids.append(part)
        else:
            raise BadQuery(
                f"devices: {_echo(part)} is not a device (indices 0-{MAX_DEVICE_INDEX}, GPU-<uuid> or MIG-<uuid>, "
                "comma-separated)"
            )
    return frozenset(indices), tuple(ids)


def prefers_text(accept: str) -> bool:
    """Accept negotiation between JSON (the default) and text: text only when it ranks strictly higher;
    an explicit type outranks a wildcard of the same q."""
    if accept in ("", "*/*"):
        return False
    best_text: tuple[float, int] = (0.0, 0)
    best_json: tuple[float, int] = (0.0, 0)
    for item in accept.split(",", 32)[:32]:
        media, *params = item.split(";")
        media = media.strip().lower()
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                q = float(value.strip()) if _Q_VALUE.fullmatch(value.strip()) else 0.0
        if media in ("text/plain", "text/*"):
            best_text = max(best_text, (q, 2 if media == "text/plain" else 1))
        elif media in ("application/json", "application/*", "*/*"):
            best_json = max(best_json, (q, 2 if media == "application/json" else 1))
    return best_text[0] > 0 and best_text > best_json


def wants_text(raw: dict[str, list[str]], accept: str) -> bool:
    formats = raw.get("format")
    if formats:
        return formats[0] == "text"
    return prefers_text(accept)


def parse_ready_query(
    raw: dict[str, list[str]], known_checks: Collection[str], max_wait: float, accept: str = ""
) -> ReadyQuery:
    """Validate /ready's query (name → values, as parse_qs gives). Raises BadQuery with the reason."""
    unknown = sorted(set(raw) - READY_PARAMS)
    if unknown:
        raise BadQuery(f"unknown parameter {_echo(unknown[0])} (allowed: {', '.join(sorted(READY_PARAMS))})")
    for key, values in raw.items():
        if len(values) > 1:
            raise BadQuery(f"parameter {key!r} given more than once")
    query = {key: values[0] for key, values in raw.items()}
    if query.get("format", "json") not in ("json", "text"):
        raise BadQuery(f"format={_echo(query['format'])}: json or text")
    indices, ids = parse_devices(query["devices"]) if "devices" in query else (None, ())
    numbers = {
        name: _number(name, query[name])
        for name in ("min_hbm_free_mib", "min_host_mem_mib", "min_hugepages")
        if name in query
    }
    return ReadyQuery(
        checks=parse_checks(query["checks"], known_checks) if "checks" in query else None,
        device_indices=indices,
        device_ids=ids,
        min_hbm_free_mib=numbers.get("min_hbm_free_mib"),
        min_host_mem_mib=numbers.get("min_host_mem_mib"),
        min_hugepages=numbers.get("min_hugepages"),
        wait=_number("wait", query["wait"], upper=max_wait) if "wait" in query else 0.0,
        text=wants_text(raw, accept),
    )


def selector_known(selector: str, known_checks: Collection[str]) -> bool:
    if selector in CATEGORIES:
        return True
    return any(check == selector or check.startswith(selector + ".") for check in known_checks)


# --- judging a query against a snapshot -------------------------------------------------------------


def device_index(snapshot: Snapshot) -> dict[str, int]:
    """Device ids (lower case) → the device index of the findings that carry them."""
    index: dict[str, int] = {}
    for state in snapshot.checks:
        finding = state.finding
        ids = finding.observed.get(OBSERVED_DEVICE_IDS)
        if finding.device is None or not isinstance(ids, (list, tuple)):
            continue
        for ident in ids:
            if isinstance(ident, str):
                index.setdefault(ident.lower(), finding.device)
    return index


def judge(snapshot: Snapshot, query: ReadyQuery) -> Verdict:
    """The verdict for a query. A device id no result names is a 400 (BadQuery), unless a GPU result is
    unknown (warming up, probe timeout): then it may be that device, and the answer is not ready."""
    devices = query.device_indices
    unresolved: list[str] = []
    if query.device_ids:
        known = device_index(snapshot)
        resolved = {known[ident.lower()] for ident in query.device_ids if ident.lower() in known}
        unresolved = [ident for ident in query.device_ids if ident.lower() not in known]
        devices = (devices or frozenset()) | resolved
    verdict = snapshot.evaluate(
        query.checks,
        devices,
        query.min_hbm_free_mib,
        min_host_mem_mib=query.min_host_mem_mib,
        min_hugepages=query.min_hugepages,
    )
    if not unresolved:
        return verdict
    unknown_gpu = tuple(
        state.finding
        for state in snapshot.checks
        if state.finding.status == Status.UNKNOWN and state.finding.category == "gpu"
    )
    if not unknown_gpu:
        raise BadQuery(
            f"devices: {_echo(unresolved[0])} is not a device of this node: no result names it "
            "(/status lists each device's ids under observed.device_ids)"
        )
    extra = tuple(finding for finding in unknown_gpu if finding not in verdict.reasons)
    return Verdict(False, verdict.reasons + extra, verdict.age_seconds)


# --- answers ----------------------------------------------------------------------------------------


def ready_body(node: str, verdict: Verdict) -> dict[str, Any]:
    return {
        "ready": verdict.ready,
        "node": node,
        "reasons": [reason_dict(f) for f in verdict.reasons],
        "age_seconds": verdict.age_seconds,
    }


def one_line(text: str, limit: int | None = None) -> str:
    flat = _CONTROL.sub(" ", text).strip()
    return flat if limit is None else clip(flat, limit)


def reason_line(finding: Finding) -> str:
    """`fail storage.space /data DiskFull: 98% used -- fix: clean caches`, at most TEXT_LINE_MAX characters;
    the message and the fix share the room, each ellipsized only as far as needed."""
    prefix = (
        f"{finding.status.value} {one_line(finding.check, 48)} {one_line(finding.subject, 48) or '-'} "
        f"{one_line(finding.reason, 48)}: "
    )
    message, hint = one_line(finding.message), one_line(finding.hint)
    room = TEXT_LINE_MAX - len(prefix) - (len(_FIX) if hint else 0)
    hint_room = min(len(hint), max(room // 2, room - len(message)))
    line = prefix + clip(message, room - hint_room)
    return line + _FIX + clip(hint, hint_room) if hint else line


def ready_text(node: str, verdict: Verdict) -> bytes:
    name = one_line(node, 80)
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
        body = f"{HTTPStatus(status).phrase.lower()}: {one_line(message, 400)}\n".encode()
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
            snapshot = self._state.snapshot.current()
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
            snapshot = self._state.snapshot.current()
            if snapshot.version == judged_version and snapshot is self._state.snapshot and remaining > 1.0:
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
        snapshot = self._state.snapshot
        key, now = snapshot_key(snapshot), time.monotonic()
        cached = self._status_cache
        if cached is not None and cached[0] == key and now - cached[1] < STATUS_MAX_AGE_SECONDS:
            return Response(200, cached[2])
        document = snapshot.current().to_document()
        try:
            document.update(self._status_extra())
        except Exception as exc:  # noqa: BLE001 - the core document still answers
            document["status_extra_error"] = str(exc)
        document["http"] = self.stats()
        body = json.dumps(document).encode()
        self._status_cache = (key, now, body)
        return Response(200, body)
