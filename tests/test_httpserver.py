"""The agent's HTTP/1.1 server on the wire: raw sockets, keep-alive, pipelining, and bad input."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from agent.httpserver import MAX_HEAD_BYTES, HttpServerCore, Request, Response


async def slow(request: Request) -> Response:
    await asyncio.sleep(0.2)
    return Response(200, b'{"slow": true}')


def echo(request: Request) -> Response:
    return Response(200, f'{{"path": "{request.path}", "q": "{request.query_string}"}}'.encode())


@pytest.fixture
def port() -> Iterator[int]:
    core = HttpServerCore({"/echo": echo, "/slow": slow, "/boom": lambda r: 1 / 0})  # type: ignore[dict-item]
    loop = asyncio.new_event_loop()
    started = threading.Event()
    bound: list[int] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)
        bound.append(loop.run_until_complete(core.listen("127.0.0.1", 0)))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    started.wait(5)
    yield bound[0]
    asyncio.run_coroutine_threadsafe(core.close(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def exchange(port: int, data: bytes, expect_close: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        if not expect_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def test_keep_alive_and_pipelined_requests_answer_in_order(port: int) -> None:
    data = (
        b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /echo?a=1 HTTP/1.1\r\nHost: x\r\n\r\n"
        b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /echo?last HTTP/1.1\r\nConnection: close\r\n\r\n"
    )
    out = exchange(port, data, expect_close=True)
    assert out.count(b"HTTP/1.1 200 OK") == 4
    assert out.index(b'{"slow": true}') < out.index(b'"q": "a=1"') < out.index(b'"q": "last"')
    assert out.rstrip().endswith(b'"q": "last"}')
    assert b"Connection: close" in out


def test_http10_closes_unless_keep_alive(port: int) -> None:
    out = exchange(port, b"GET /echo HTTP/1.0\r\n\r\n", expect_close=True)
    assert out.startswith(b"HTTP/1.1 200 OK") and b"Connection: close" in out


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"NONSENSE\r\n\r\n", b"400"),
        (b"GET /echo HTTP/2.0\r\n\r\n", b"400"),
        (b"GET echo HTTP/1.1\r\n\r\n", b"400"),
        (b"GET /echo HTTP/1.1\r\nbad header\r\n\r\n", b"400"),
        (b"GET /echo HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", b"400"),
        (b"GET /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", b"400"),
        (b"GET /echo HTTP/1.1\r\nX: " + b"a" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n", b"431"),
        (b"GET /echo HTTP/1.1\r\nX: " + b"a" * (MAX_HEAD_BYTES + 10), b"431"),
        (b"POST /echo HTTP/1.1\r\nConnection: close\r\n\r\n", b"405"),
        (b"DELETE /echo HTTP/1.1\r\nConnection: close\r\n\r\n", b"405"),
        (b"GET /nope HTTP/1.1\r\nConnection: close\r\n\r\n", b"404"),
        (b"GET /boom HTTP/1.1\r\nConnection: close\r\n\r\n", b"500"),
    ],
)
def test_bad_input_gets_a_clear_status_and_the_server_lives_on(port: int, data: bytes, status: bytes) -> None:
    out = exchange(port, data, expect_close=True)
    assert out.startswith(b"HTTP/1.1 " + status), out[:80]
    assert b'"error"' in out or status == b"405"
    assert exchange(port, b"GET /echo HTTP/1.1\r\nConnection: close\r\n\r\n", expect_close=True).startswith(
        b"HTTP/1.1 200"
    )


def test_a_client_that_vanishes_mid_long_poll_does_not_hurt(port: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"GET /slow HTTP/1.1\r\n\r\n")
    sock.close()
    assert b"200 OK" in exchange(port, b"GET /slow HTTP/1.1\r\nConnection: close\r\n\r\n", expect_close=True)
