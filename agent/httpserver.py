"""A small HTTP/1.1 server on asyncio, for read-only GET endpoints answered from memory.

Why not a framework: /ready is the pre-flight of every job on the node and must answer in well under 5 ms
at 50 keep-alive connections on 2 cores, also while probes misbehave. A general framework spends most of
that budget in routing, middleware and request objects; this server answers a cached response straight
from `data_received`, and only a handler that must wait (a long-poll) costs a task.

Scope, deliberately: GET and HEAD; no request bodies (a GET carries none; anything with a body is refused);
keep-alive and pipelining; limits on header size, pipelined requests, connections and idle time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qs, unquote

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
MAX_PIPELINED = 64
IDLE_TIMEOUT_SECONDS = 75.0
MAX_CONNECTIONS = 4096


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query_string: str
    headers: dict[str, str]

    @property
    def query(self) -> dict[str, list[str]]:
        """Query parameters; a parameter given twice keeps both values (callers reject that)."""
        return parse_qs(self.query_string, keep_blank_values=True, strict_parsing=False)


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], "Response | Awaitable[Response]"]


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_head(head: bytes) -> tuple[Request, bool, bool]:
    """One request head (without the blank line) → (request, keep_alive, has_body)."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise BadRequest(400, "undecodable request") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(400, "malformed header line")
        headers[name.lower()] = value.strip()
    connection = headers.get("connection", "").lower()
    keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    has_body = headers.get("content-length", "0").strip() not in ("", "0") or "transfer-encoding" in headers
    if not target.startswith("/"):
        raise BadRequest(400, "request target must be a path")
    path, _, query = target.partition("?")
    return Request(method, unquote(path), query, headers), keep_alive, has_body


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")


_STATUS_LINES = {int(status): _status_line(int(status)) for status in HTTPStatus}


def encode_response(response: Response, keep_alive: bool, head_only: bool) -> bytes:
    parts = [
        _STATUS_LINES.get(response.status) or _status_line(response.status),
        b"Content-Type: ",
        response.content_type.encode("latin-1"),
        b"\r\nContent-Length: ",
        str(len(response.body)).encode(),
        b"\r\n",
    ]
    for name, value in response.headers.items():
        parts.append(f"{name}: {value}\r\n".encode("latin-1"))
    if not keep_alive:
        parts.append(b"Connection: close\r\n")
    parts.append(b"\r\n")
    if not head_only:
        parts.append(response.body)
    return b"".join(parts)


def error_response(status: int, message: str) -> Response:
    body = ('{"error": "' + message.replace("\\", "\\\\").replace('"', '\\"') + '"}').encode()
    return Response(status, body)


class _Connection(asyncio.Protocol):
    def __init__(self, server: HttpServerCore) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = b""
        self._queue: deque[tuple[Request, bool]] = deque()
        self._busy = False  # a handler is awaiting (long-poll): later requests wait their turn
        self._paused = False  # the client does not read its answers: stop answering until it does
        self._closing = False
        self._idle: asyncio.TimerHandle | None = None
        self._last_activity = time.monotonic()

    # --- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if len(self._server.connections) >= MAX_CONNECTIONS:
            transport.close()
            return
        self._server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._closing = True
        if self._idle is not None:
            self._idle.cancel()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._drain()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self._buffer += data
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    self._fail(431, "request head too large")
                return
            head, self._buffer = self._buffer[:end], self._buffer[end + 4 :]
            if end > MAX_HEAD_BYTES:
                self._fail(431, "request head too large")
                return
            try:
                request, keep_alive, has_body = parse_head(head)
            except BadRequest as exc:
                self._fail(exc.status, str(exc))
                return
            if has_body:
                self._fail(400, "request bodies are not accepted")
                return
            if len(self._queue) >= MAX_PIPELINED:
                self._fail(429, "too many pipelined requests")
                return
            self._queue.append((request, keep_alive))
            self._drain()
            if self._closing:
                return

    # --- answering -------------------------------------------------------------------------------

    def _drain(self) -> None:
        while self._queue and not self._busy and not self._paused and not self._closing:
            request, keep_alive = self._queue.popleft()
            self._last_activity = time.monotonic()
            result = self._server.dispatch(request)
            if not isinstance(result, Response):
                self._busy = True
                task = asyncio.ensure_future(result)
                task.add_done_callback(lambda t, r=request, k=keep_alive: self._finish_async(t, r, k))
                return
            self._send(result, request, keep_alive)

    def _finish_async(self, task: asyncio.Future[Response], request: Request, keep_alive: bool) -> None:
        self._busy = False
        if task.cancelled():
            response = error_response(503, "shutting down")
        elif task.exception() is not None:
            log.error("handler for %s failed: %r", request.path, task.exception())
            response = error_response(500, "internal error")
        else:
            response = task.result()
        self._send(response, request, keep_alive)
        self._drain()

    def _send(self, response: Response, request: Request, keep_alive: bool) -> None:
        if self._transport is None or self._closing:
            return
        self._transport.write(encode_response(response, keep_alive, request.method == "HEAD"))
        if not keep_alive:
            self._close()

    def _fail(self, status: int, message: str) -> None:
        if self._transport is not None and not self._closing:
            self._transport.write(encode_response(error_response(status, message), False, False))
        self._close()

    def _close(self) -> None:
        self._closing = True
        self._queue.clear()
        if self._transport is not None:
            self._transport.close()

    def _arm_idle(self, delay: float = IDLE_TIMEOUT_SECONDS) -> None:
        # One timer per connection, re-armed only when it fires: resetting a timer on every request
        # would cost a heap operation per request on the hot path.
        self._idle = asyncio.get_running_loop().call_later(delay, self._on_idle)

    def _on_idle(self) -> None:
        idle_for = time.monotonic() - self._last_activity
        if self._busy or idle_for < IDLE_TIMEOUT_SECONDS:
            self._arm_idle(max(1.0, IDLE_TIMEOUT_SECONDS - idle_for))
        else:
            self._close()


class HttpServerCore:
    """Routes by exact path; a handler returns a Response, or an awaitable of one when it must wait."""

    def __init__(self, routes: dict[str, Handler]) -> None:
        self.routes = routes
        self.connections: set[_Connection] = set()
        self._server: asyncio.base_events.Server | None = None

    def dispatch(self, request: Request) -> Response | Awaitable[Response]:
        handler = self.routes.get(request.path)
        if handler is None:
            return error_response(404, f"no such endpoint {request.path} (try /ready, /healthz, /metrics, /status)")
        if request.method not in ("GET", "HEAD"):
            return Response(405, b'{"error": "read-only: GET or HEAD"}', headers={"Allow": "GET, HEAD"})
        try:
            return handler(request)
        except Exception as exc:
            log.exception("handler for %s failed", request.path)
            return error_response(500, f"internal error: {type(exc).__name__}")

    async def listen(self, address: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), address, port, backlog=1024, reuse_address=True
        )
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection._close()
        if self._server is not None:
            await self._server.wait_closed()
