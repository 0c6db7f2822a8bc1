"""A small HTTP/1.1 server on asyncio, for read-only GET endpoints answered from memory.

Why not a framework: /ready is the pre-flight of every job on the node and must answer in well under 5 ms
at 50 keep-alive connections on 2 cores, also while probes misbehave. A general framework spends most of
that budget in routing, middleware and request objects; this server answers a cached response straight
from the read callback, and only a handler that must wait (a long-poll) costs a task. Request heads are
read strictly and answers encoded in `agent.http.wire`; the limits are in `agent.http.limits`.

Scope, deliberately: GET and HEAD; no request bodies (a GET carries none; anything with a body is refused);
keep-alive and pipelining.

The port is reachable by every pod of the cluster, so every cost a client can cause is bounded (`Limits`):
connections in all and per peer address (with a reserve so the node itself and new peers still get in, and, on
the health port's core, slots that only the node's own addresses can take: the kubelet's probes),
the time to send a request head, the time a client may leave its answers unread, one pipelined request per
connection per loop turn (so one client cannot starve the others), and the memory a connection can pin:
reads land in one shared buffer, at most what the connection may still hold (`max_buffered`, so asyncio never
reads 256 KiB at once for it); an answer is handed to the transport a chunk at a time, so a client that never
reads pins one chunk, not a copy of the answer; and the kernel's buffers are set (SO_RCVBUF, SO_SNDBUF) on the
listening socket, which every accepted one inherits. `worst_case_bytes` adds it up (docs/http.md). Errors of the
loop itself (accept failing at the fd limit) are logged at a bounded rate.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from agent.http.limits import WRITE_CHUNK, Limits
from agent.http.wire import MAX_HEAD_BYTES as MAX_HEAD_BYTES
from agent.http.wire import MAX_QUERY_FIELDS as MAX_QUERY_FIELDS
from agent.http.wire import BadRequest, Request, bare_line_end, encode_head, encode_response, error_response, parse_head
from agent.http.wire import Response as Response
from probes.text import ASCII_ELLIPSIS, clip, escape

log = logging.getLogger(__name__)

Handler = Callable[[Request], "Response | Awaitable[Response]"]


def is_local_peer(peer: str, local: str) -> bool:
    """A client connecting from the very address it connected to: the pod or node talking to itself (over
    loopback, or over the node's address when the agent shares the host network), as kubelet does."""
    return bool(peer) and peer == local


class _Connection(asyncio.BufferedProtocol):
    def __init__(self, server: HttpServerCore, routes: dict[str, Handler]) -> None:
        self._server = server
        self._routes = routes  # the listener's: each port serves its own paths
        self._limits = server.limits
        self._transport: asyncio.Transport | None = None
        self.peer = ""
        self.admitted = False
        self.node = False  # from one of the node's own addresses, in the node reserve (Limits.node_reserve)
        self._buffer = b""
        self._pos = 0  # start of the unparsed input in _buffer
        self._scanned = 0  # _buffer[_pos:_scanned] is known to hold no complete head
        self._out: deque[memoryview] = deque()  # the rest of a large answer, handed over chunk by chunk
        self._close_when_sent = False
        self._task: asyncio.Future[Response] | None = None  # a handler that must wait (a long-poll)
        self._turn_pending = False
        self._write_paused = False
        self._read_paused = False
        self._eof = False
        self.closing = False
        now = time.monotonic()
        self._head_since = now  # a request head is due since then; 0 between requests
        self._last_active = now
        self._stalled_since = 0.0
        self._closed_at = 0.0

    # --- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self.peer = str(peer[0]) if isinstance(peer, tuple) else ""
        refusal = self._server.admit(self, str(local[0]) if isinstance(local, tuple) else "")
        if refusal is not None:
            # A short answer fits the fresh socket's buffer, so close() completes even if the peer never reads.
            transport.write(encode_response(error_response(503, refusal, {"Retry-After": "1"}), False, False))
            self.closing = True
            transport.close()
            return
        transport.set_write_buffer_limits(high=self._limits.write_high_water)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self._server.forget(self)
        if self._task is not None:
            self._task.cancel()  # the client went away: its long-poll ends now, not at its deadline

    def pause_writing(self) -> None:
        self._write_paused = True
        self._stalled_since = time.monotonic()
        self._pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._stalled_since = 0.0
        if self._out:
            self._flush()
            return
        self._resume_reading_if_room()
        self._schedule_turn()

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the transport reads to: the server's one scratch buffer, cut to what this connection may still
        hold (reading is paused before that is nothing)."""
        scratch = self._server.scratch
        if not self._buffer:
            return scratch  # nothing held (between requests): all of it
        return scratch[: max(1, self._limits.max_buffered - (len(self._buffer) - self._pos))]

    def buffer_updated(self, nbytes: int) -> None:
        data = bytes(self._server.scratch[:nbytes])
        if self.closing:
            return
        if self._pos:
            self._buffer = self._buffer[self._pos :] + data
            self._scanned -= self._pos
            self._pos = 0
        elif self._buffer:
            self._buffer += data
        else:
            self._buffer = data
        if len(self._buffer) - self._pos >= self._limits.max_buffered:
            self._pause_reading()
        if not self._turn_pending and self._task is None and not self._write_paused:
            self._serve_next()

    def eof_received(self) -> bool | None:
        self._eof = True
        if self._task is not None:
            # HTTP clients do not half-close; end of input while a long-poll waits means the client left.
            self._close()
            return None
        if self._out and not self.closing:
            return True  # the rest of an answer is still to go; _answered() closes after it
        if len(self._buffer) > self._pos and not self.closing:
            self._schedule_turn()
            return True  # answer what was pipelined before the end, then close
        return None

    # --- answering -------------------------------------------------------------------------------

    def _schedule_turn(self) -> None:
        if not self._turn_pending and not self.closing:
            self._turn_pending = True
            self._server.loop.call_soon(self._take_turn)

    def _take_turn(self) -> None:
        self._turn_pending = False
        self._serve_next()

    def _serve_next(self) -> None:
        """Answer at most one request; a further pipelined one waits for the next loop turn."""
        if self.closing or self._task is not None or self._write_paused or self._out:
            return
        buffer, pos = self._buffer, self._pos
        end = buffer.find(b"\r\n\r\n", max(pos, self._scanned - 3), pos + MAX_HEAD_BYTES)
        if end < 0:
            if bare_line_end(buffer, max(pos, self._scanned - 1)):
                self._fail(400, "bare LF or CR in the request head: lines end with CRLF")
                return
            self._await_head(len(buffer) - pos)
            return
        head = buffer[pos:end]
        self._pos = self._scanned = end + 4
        if self._pos >= len(buffer):
            self._buffer, self._pos, self._scanned = b"", 0, 0
        try:
            request, keep_alive, has_body = parse_head(head)
        except BadRequest as exc:
            self._fail(exc.status, str(exc))
            return
        if has_body:
            self._fail(400, "request bodies are not accepted")
            return
        self._head_since = 0.0
        result = self._server.dispatch(request, self._routes)
        if isinstance(result, Response):
            self._send(result, request, keep_alive)
            return
        task = asyncio.ensure_future(result)
        self._task = task
        task.add_done_callback(functools.partial(self._finish_async, request, keep_alive))

    def _await_head(self, pending: int) -> None:
        if pending >= MAX_HEAD_BYTES:
            self._fail(431, "request head too large")
            return
        self._scanned = len(self._buffer)
        if pending and not self._head_since:
            self._head_since = time.monotonic()
        if self._eof:
            self._close()  # an incomplete request and nothing more will come
        else:
            self._resume_reading_if_room()

    def _finish_async(self, request: Request, keep_alive: bool, task: asyncio.Future[Response]) -> None:
        self._task = None
        if self.closing:
            return
        if task.cancelled():
            response = error_response(503, "shutting down")
        elif task.exception() is not None:
            log.error("handler for %s failed: %r", request.path, task.exception())
            response = error_response(500, "internal error")
        else:
            response = task.result()
        self._send(response, request, keep_alive)

    def _answered(self) -> None:
        self._last_active = time.monotonic()
        if self.closing:
            return
        if len(self._buffer) > self._pos:
            self._schedule_turn()
        elif self._eof:
            self._close()
        else:
            self._resume_reading_if_room()

    def _send(self, response: Response, request: Request, keep_alive: bool) -> None:
        if self._transport is None or self.closing:
            return
        head = encode_head(response, keep_alive)
        body = b"" if request.method == "HEAD" else response.body
        if not keep_alive:
            self._close_when_sent = True
            self._closed_at = time.monotonic()  # the linger counts from the last answer, delivered or not
        if len(head) + len(body) <= WRITE_CHUNK:
            self._transport.write(head + body)
        else:
            self._transport.write(head)
            self._out.append(memoryview(body))
        self._flush()

    def _flush(self) -> None:
        """The next chunks of the answer, while the kernel takes them; then the next request."""
        transport = self._transport
        while self._out and not self._write_paused and not self.closing and transport is not None:
            view = self._out.popleft()
            if len(view) > WRITE_CHUNK:
                self._out.appendleft(view[WRITE_CHUNK:])
            transport.write(view[:WRITE_CHUNK])  # pause_writing() runs within when the kernel's buffer is full
        if self._out or self.closing:
            return
        if self._close_when_sent:
            self._close()
        else:
            self._answered()

    def _fail(self, status: int, message: str) -> None:
        if self._transport is not None and not self.closing:
            self._transport.write(encode_response(error_response(status, message), False, False))
        self._close()

    def _close(self) -> None:
        """The answers queued go out, then a FIN; what the client still sends is read and dropped until it
        closes too, or for `linger`: a close with unread input resets the connection, and the client would
        lose the answer it has not read yet (a 400 for a request it pipelined more after)."""
        if self.closing:
            return
        self.closing = True
        self._closed_at = self._closed_at if self._close_when_sent else time.monotonic()
        self._buffer, self._pos, self._scanned = b"", 0, 0
        self._out.clear()
        if self._task is not None:
            self._task.cancel()
        transport = self._transport
        if transport is None:
            return
        if self._eof or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        if self._read_paused:
            self._read_paused = False
            transport.resume_reading()

    def unsent_bytes(self) -> int:
        return self._transport.get_write_buffer_size() if self._transport is not None else 0

    def abort(self) -> None:
        """Drop the connection now, unsent answers included (a reset, so the kernel frees them too)."""
        transport = self._transport
        self._close()
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            transport.abort()

    def _pause_reading(self) -> None:
        if not self._read_paused and self._transport is not None and not self.closing:
            self._read_paused = True
            self._transport.pause_reading()

    def _resume_reading_if_room(self) -> None:
        if (
            self._read_paused
            and not self._write_paused
            and not self.closing
            and self._transport is not None
            and len(self._buffer) - self._pos <= self._limits.max_buffered // 2
        ):
            self._read_paused = False
            self._transport.resume_reading()

    # --- deadlines (checked by the server's sweep, so the request path arms no timer) -----------

    def check_deadlines(self, now: float) -> None:
        limits = self._limits
        if self.closing or self._close_when_sent:
            if now - self._closed_at > limits.linger:
                self.abort()
        elif self._write_paused and now - self._stalled_since > limits.send_timeout:
            log.debug("dropping %s: answers unread for %.0fs", self.peer, now - self._stalled_since)
            self.abort()
        elif self._task is not None:
            return  # a long-poll: bounded by its own wait
        elif self._head_since and now - self._head_since > limits.head_timeout:
            self._fail(408, f"request head not complete within {limits.head_timeout:g}s")
        elif not self._head_since and not self._turn_pending and now - self._last_active > limits.idle_timeout:
            self._close()


class _RateLimitedLog:
    """The loop's exception handler: one line per kind of error per interval, with a count of the rest."""

    def __init__(self, every: float) -> None:
        self._every = every
        self._last: dict[str, tuple[float, int]] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", "event loop error"))
        now = time.monotonic()
        last, suppressed = self._last.get(message, (-self._every, 0))
        if now - last < self._every:
            self._last[message] = (last, suppressed + 1)
            return
        if len(self._last) > 64:
            self._last.clear()
        self._last[message] = (now, 0)
        exc = context.get("exception")
        note = f" ({suppressed} more like it in the last {now - last:.0f}s)" if suppressed else ""
        if exc is None:
            log.error("%s%s", message, note)
        elif isinstance(exc, OSError):
            log.error("%s: %s%s", message, exc, note)
        else:
            log.error("%s%s", message, note, exc_info=exc)


class HttpServerCore:
    """Routes by exact path; a handler returns a Response, or an awaitable of one when it must wait.

    It may listen on several ports (`listen` once per port), each with its own routes: every connection, on
    whichever port, counts against the one set of limits and shares the one read buffer."""

    def __init__(
        self, routes: dict[str, Handler], limits: Limits | None = None, is_node: Callable[[str], bool] | None = None
    ) -> None:
        self.routes = routes  # what `listen` serves unless it is given others
        self.limits = limits or Limits()
        # Whether a peer address is one of the node's own (agent/http/addresses.py): its connections go to the node
        # reserve, where the limits keep one (`node_reserve`).
        self.is_node: Callable[[str], bool] = is_node or (lambda _peer: False)
        self.connections: set[_Connection] = set()
        self.per_peer: dict[str, int] = {}
        self.node_held = 0
        self.refused = 0
        # Every connection reads into this, then keeps only what it has not answered yet (see get_buffer).
        self.scratch = memoryview(bytearray(self.limits.max_buffered))
        self._servers: list[asyncio.base_events.Server] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "listen() first"
        return self._loop

    def admit(self, connection: _Connection, local: str) -> str | None:
        """Take a new connection into account, or say why it is refused."""
        limits, peer = self.limits, connection.peer
        total = len(self.connections) - self.node_held  # the node reserve is apart from every other slot
        held = self.per_peer.get(peer, 0)
        if is_local_peer(peer, local):
            refusal = None if total < limits.max_connections + limits.local_reserve else "too many connections"
        elif limits.node_reserve and self.is_node(peer):
            connection.node = self.node_held < limits.node_reserve
            refusal = None if connection.node else "too many connections from the node's own addresses"
        elif held >= limits.max_per_peer:
            refusal = f"too many connections from {peer} (at most {limits.max_per_peer})"
        elif total >= limits.max_connections:
            refusal = "too many connections"
        elif held and total >= limits.max_connections - limits.new_peer_reserve:
            refusal = "too many connections: the remaining ones are kept for new clients"
        else:
            refusal = None
        if refusal is not None:
            self.refused += 1
            return refusal
        connection.admitted = True
        self.connections.add(connection)
        self.per_peer[peer] = held + 1
        self.node_held += connection.node
        return None

    def forget(self, connection: _Connection) -> None:
        if not connection.admitted:
            return
        connection.admitted = False
        self.connections.discard(connection)
        self.node_held -= connection.node
        held = self.per_peer.get(connection.peer, 0) - 1
        if held > 0:
            self.per_peer[connection.peer] = held
        else:
            self.per_peer.pop(connection.peer, None)

    def dispatch(self, request: Request, routes: dict[str, Handler] | None = None) -> Response | Awaitable[Response]:
        routes = self.routes if routes is None else routes
        handler = routes.get(request.path)
        if handler is None:
            return error_response(
                404,
                f"no such endpoint {clip(escape(request.path), 64, ASCII_ELLIPSIS)} on this port "
                f"(try {', '.join(routes)})",
            )
        if request.method not in ("GET", "HEAD"):
            return error_response(405, "read-only: GET or HEAD", {"Allow": "GET, HEAD"})
        try:
            return handler(request)
        except Exception as exc:
            log.exception("handler for %s failed", request.path)
            return error_response(500, f"internal error: {type(exc).__name__}")

    async def listen(self, address: str, port: int, routes: dict[str, Handler] | None = None) -> int:
        """Serve `routes` (default: the core's) on address:port; returns the bound port (useful with port 0)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        if loop.get_exception_handler() is None:
            loop.set_exception_handler(_RateLimitedLog(self.limits.log_every))
        served = self.routes if routes is None else routes
        server = await loop.create_server(
            lambda: _Connection(self, served), address, port, backlog=self.limits.backlog, reuse_address=True
        )
        self._servers.append(server)
        for sock in server.sockets:
            # Accepted sockets inherit them (and the kernel no longer grows them): set once, here.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.limits.receive_buffer)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer)
        if self._sweeper is None:
            self._sweeper = loop.call_later(self.limits.sweep_every, self._sweep)
        return int(server.sockets[0].getsockname()[1])

    @property
    def listeners(self) -> int:
        return len(self._servers)

    def _sweep(self) -> None:
        now = time.monotonic()
        for connection in list(self.connections):
            connection.check_deadlines(now)
        self._sweeper = self.loop.call_later(self.limits.sweep_every, self._sweep)

    async def close(self) -> None:
        """Stop listening and drop every connection at once: shutting down never waits for a client."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        for server in self._servers:
            server.close()
        for connection in list(self.connections):
            connection.abort()
        await asyncio.sleep(0)  # let connection_lost run, which cancels waiting handlers
        for server in self._servers:
            try:
                await asyncio.wait_for(server.wait_closed(), 1.0)
            except asyncio.TimeoutError:
                pass
