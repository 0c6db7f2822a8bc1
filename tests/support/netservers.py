"""Real servers for the network and time tests, all on 127.0.0.1 with ports chosen by the kernel.

DNS (dnslib), SNTP (with skew and the broken answers real servers give), TCP, HTTP and HTTPS with a
self-signed certificate made by `openssl`, and an HTTP CONNECT proxy. Each runs in daemon threads and
is stopped by `close()`; the `servers` context manager closes everything it started.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import http.server
import os
import select
import socket
import socketserver
import ssl
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from support.system import assert_system_test

LOOPBACK = "127.0.0.1"
CLONE_NEWNET = 0x40000000
T = TypeVar("T")
NTP_EPOCH_OFFSET = 2208988800  # seconds from 1900-01-01 to 1970-01-01


class ZoneResolver(BaseResolver):
    """A names → IPv4 answers (and `aaaa_records` names → IPv6 answers); listed names answer NXDOMAIN or
    SERVFAIL; `delay` slows every answer."""

    def __init__(
        self,
        a_records: dict[str, str],
        nxdomain: tuple[str, ...] = (),
        servfail: tuple[str, ...] = (),
        delay: float = 0.0,
        aaaa_records: dict[str, str] | None = None,
    ) -> None:
        self.a_records = {name.rstrip(".").lower(): ip for name, ip in a_records.items()}
        self.aaaa_records = {name.rstrip(".").lower(): ip for name, ip in (aaaa_records or {}).items()}
        self.nxdomain = {name.rstrip(".").lower() for name in nxdomain}
        self.servfail = {name.rstrip(".").lower() for name in servfail}
        self.delay = delay
        self.queries: list[str] = []  # every name asked, in order (lower case, no final dot)

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        if self.delay:
            time.sleep(self.delay)
        reply = request.reply()
        qname = str(request.q.qname).rstrip(".").lower()
        self.queries.append(qname)
        if qname in self.servfail:
            reply.header.rcode = RCODE.SERVFAIL
        elif qname in self.a_records or qname in self.aaaa_records:
            if request.q.qtype == QTYPE.A and qname in self.a_records:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(self.a_records[qname]), ttl=60))
            if request.q.qtype == QTYPE.AAAA and qname in self.aaaa_records:
                reply.add_answer(RR(request.q.qname, QTYPE.AAAA, rdata=AAAA(self.aaaa_records[qname]), ttl=60))
        else:
            reply.header.rcode = RCODE.NXDOMAIN
        return reply


class DnsTestServer:
    def __init__(self, resolver: ZoneResolver, address: str = LOOPBACK, port: int = 0) -> None:
        assert_system_test("DnsTestServer (a server or namespace of the test's own)")
        quiet = DNSLogger(log="-request,-reply,-truncated,-error,-recv,-send,-data", logf=lambda _msg: None)
        self._server = DNSServer(resolver, address=address, port=port, logger=quiet)
        self.host: str = address
        self.port: int = self._server.server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._server.server.shutdown()
        self._server.server.server_close()


class SilentUdpPort:
    """A bound UDP socket nobody reads: queries to it are never answered (and get no ICMP error). On port 53 of
    a loopback address of its own it is a nameserver a resolv.conf can name that stays silent."""

    def __init__(self, host: str = LOOPBACK, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, port))
        self.host = host
        self.port: int = self.sock.getsockname()[1]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self.sock.close()


def to_ntp(unix_time: float) -> bytes:
    seconds = unix_time + NTP_EPOCH_OFFSET
    whole = int(seconds)
    return struct.pack("!II", whole, int((seconds - whole) * 2**32) & 0xFFFFFFFF)


class SntpTestServer:
    """An SNTP server whose clock is `skew` seconds off, optionally answering like a broken server."""

    def __init__(
        self,
        skew: float = 0.0,
        stratum: int = 2,
        leap: int = 0,
        wrong_origin: bool = False,
        reference_id: bytes = b"\x7f\x00\x00\x01",
        mode: int = 4,
        host: str = LOOPBACK,
        port: int = 0,
    ) -> None:
        assert_system_test("SntpTestServer (a server or namespace of the test's own)")
        self.skew = skew
        self.stratum = stratum
        self.leap = leap
        self.wrong_origin = wrong_origin
        self.reference_id = reference_id
        self.mode = mode
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, port))
        self.host: str = host
        self.port: int = self.sock.getsockname()[1]
        self.queries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.1)
            if not ready:
                continue
            try:
                data, peer = self.sock.recvfrom(512)
            except OSError:
                return
            if len(data) < 48:
                continue
            self.queries += 1
            received = time.time() + self.skew
            origin = data[40:48]
            if self.wrong_origin:
                origin = bytes(b ^ 0xFF for b in origin)
            version = (data[0] >> 3) & 0x7
            header = struct.pack(
                "!BBbb", (self.leap << 6) | (version << 3) | self.mode, self.stratum, 6, -20
            )  # poll 2^6 s, precision 2^-20 s
            root = struct.pack("!II", 0x00000100, 0x00000200)
            reply = (
                header
                + root
                + self.reference_id
                + to_ntp(received - 16)
                + origin
                + to_ntp(received)
                + to_ntp(time.time() + self.skew)
            )
            with contextlib.suppress(OSError):
                self.sock.sendto(reply, peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


class TcpAcceptServer:
    """Accepts TCP connections and closes them (a plain port that is open)."""

    def __init__(self) -> None:
        assert_system_test("TcpAcceptServer (a server or namespace of the test's own)")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((LOOPBACK, 0))
        self.sock.listen(16)
        self.port: int = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.1)
            if ready:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


class SilentTcpServer:
    """Accepts TCP connections and holds them open without ever sending a byte: a TLS handshake or an HTTP
    request to it hangs until the client gives up (a server or middlebox that swallows the traffic)."""

    def __init__(self) -> None:
        assert_system_test("SilentTcpServer (a server or namespace of the test's own)")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((LOOPBACK, 0))
        self.sock.listen(128)
        self.port: int = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.1)
            if ready:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for conn in self.accepted:
            conn.close()
        self.sock.close()


def refused_port() -> int:
    """A loopback port with nothing listening (bound then released, so it is not ephemeral-in-use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def make_self_signed(directory: Path, hostname: str) -> tuple[Path, Path]:
    """A self-signed certificate for `hostname` (and 127.0.0.1), made with the openssl CLI."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN={hostname}",
            "-addext",
            f"subjectAltName=DNS:{hostname},IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


class _StatusHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        delay = self.server.delays.get(self.path, 0.0)  # type: ignore[attr-defined]
        if delay:
            time.sleep(delay)
        status = self.server.statuses.get(self.path, 404)  # type: ignore[attr-defined]
        body = f"status {status}\n".encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _QuietHttpServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that hang up mid-handshake (TLS verification failures) are part of the tests


class HttpTestServer:
    """HTTP (or HTTPS with `tls=(cert, key)`) answering each path in `statuses` with that status, after
    `delays[path]` seconds for the paths listed there (a slow mirror)."""

    def __init__(
        self, statuses: dict[str, int], tls: tuple[Path, Path] | None = None, delays: dict[str, float] | None = None
    ) -> None:
        assert_system_test("HttpTestServer (a server or namespace of the test's own)")
        self._server = _QuietHttpServer((LOOPBACK, 0), _StatusHandler)
        self._server.statuses = statuses  # type: ignore[attr-defined]
        self._server.delays = delays or {}  # type: ignore[attr-defined]
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _ConnectHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        conn: socket.socket = self.request
        conn.settimeout(5)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                return
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        method, target, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
        authorization = _request_header(head, b"proxy-authorization")
        self.server.seen.append((method, target, authorization))  # type: ignore[attr-defined]
        if not self._authorized(conn, authorization):
            return
        if method == "GET" and target.startswith("http://"):
            self._forward(conn, head, rest, target)
            return
        host, _, port = target.rpartition(":")
        if host in self.server.stall_hosts:  # type: ignore[attr-defined]
            # Like a proxy whose own connection to the destination hangs: the CONNECT is read, never answered.
            self.server.stop.wait(30)  # type: ignore[attr-defined]
            return
        upstream_port = self.server.routes.get(host)  # type: ignore[attr-defined]
        if method != "CONNECT" or upstream_port is None:
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            return
        try:
            upstream = socket.create_connection((LOOPBACK, upstream_port or int(port)), timeout=5)
        except OSError:
            conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            return
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        with upstream:
            _pipe(conn, upstream)

    def _authorized(self, conn: socket.socket, authorization: str) -> bool:
        """With auth_realm: only `Basic base64(credentials)` passes (no header, or other ones, answer 407)."""
        realm = self.server.auth_realm  # type: ignore[attr-defined]
        if not realm:
            return True
        credentials = self.server.credentials  # type: ignore[attr-defined]
        expected = "Basic " + base64.b64encode(credentials.encode()).decode() if credentials else None
        if authorization and (expected is None or authorization == expected):
            return True
        conn.sendall(
            b"HTTP/1.1 407 Proxy Authentication Required\r\n"
            + f'Proxy-Authenticate: Basic realm="{realm}"\r\nContent-Length: 0\r\n\r\n'.encode()
        )
        return False

    def _forward(self, conn: socket.socket, head: bytes, rest: bytes, target: str) -> None:
        """Forward proxying of plain HTTP (`GET http://host:port/path`): to 127.0.0.1:<routes[host]>, the
        request line in origin form, the Proxy-Authorization header dropped as a proxy does."""
        authority, _, path = target[len("http://") :].partition("/")
        host = authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority
        upstream_port = self.server.routes.get(host)  # type: ignore[attr-defined]
        if upstream_port is None:
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            return
        lines = head.split(b"\r\n")
        lines[0] = f"GET /{path} HTTP/1.1".encode()
        kept = [line for line in lines if not line.lower().startswith(b"proxy-authorization:")]
        with socket.create_connection((LOOPBACK, upstream_port), timeout=5) as upstream:
            upstream.sendall(b"\r\n".join(kept) + b"\r\n\r\n" + rest)
            _pipe(conn, upstream)


def _request_header(head: bytes, name: bytes) -> str:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().decode("latin-1")
    return ""


def _pipe(a: socket.socket, b: socket.socket) -> None:
    peers = {a: b, b: a}
    while True:
        ready, _, _ = select.select(list(peers), [], [], 5)
        if not ready:
            return
        for sock in ready:
            try:
                chunk = sock.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            peers[sock].sendall(chunk)


class _ThreadingTcp(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class ConnectProxy:
    """An HTTP proxy: CONNECT tunnels to 127.0.0.1:<routes[host]>, and forwards plain `GET http://host/...` there
    too; other hosts get 403. With `auth_realm` every request without Proxy-Authorization is answered 407 (Basic
    realm), and with `credentials` ("user:password") every request whose Proxy-Authorization is not Basic of
    exactly those; `seen` records (method, target, Proxy-Authorization) of every request. A CONNECT to one of
    `stall_hosts` is read and never answered (its own upstream connection hangs)."""

    def __init__(
        self,
        routes: dict[str, int],
        auth_realm: str = "",
        stall_hosts: tuple[str, ...] = (),
        credentials: str = "",
    ) -> None:
        assert_system_test("ConnectProxy (a server or namespace of the test's own)")
        self._server = _ThreadingTcp((LOOPBACK, 0), _ConnectHandler)
        self._server.routes = routes  # type: ignore[attr-defined]
        self._server.auth_realm = auth_realm  # type: ignore[attr-defined]
        self._server.credentials = credentials  # type: ignore[attr-defined]
        self._server.seen = []  # type: ignore[attr-defined]
        self._server.stall_hosts = set(stall_hosts)  # type: ignore[attr-defined]
        self._server.stop = threading.Event()  # type: ignore[attr-defined]
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()

    @property
    def seen(self) -> list[tuple[str, str, str]]:
        return self._server.seen  # type: ignore[attr-defined,no-any-return]

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def close(self) -> None:
        self._server.stop.set()  # type: ignore[attr-defined]
        self._server.shutdown()
        self._server.server_close()


class Netns:
    """A network namespace created for a test (`ip netns add`), deleted by close()."""

    def __init__(self, prefix: str = "nhtest") -> None:
        assert_system_test("Netns (a server or namespace of the test's own)")
        self.name = f"{prefix}{os.getpid()}_{time.monotonic_ns() % 1_000_000}"
        self.ip("netns", "add", self.name, netns=False)
        self.path = f"/run/netns/{self.name}"
        self.ip("link", "set", "lo", "up")

    def ip(self, *args: str, netns: bool = True, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = ["ip", *(["-n", self.name] if netns else []), *args]
        return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)

    def exec(self, argv: list[str], timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.name, *argv], capture_output=True, text=True, timeout=timeout, **kw
        )

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)


def made_in_netns(netns_path: str, factory: Callable[[], T]) -> T:
    """factory() run by a thread that entered the network namespace at `netns_path` (setns(2) moves only the
    calling thread): the sockets it binds belong to that namespace for good, while their server threads run
    anywhere. So a test's servers can listen on addresses such as 127.0.0.53:53 in a namespace of its own,
    whatever this machine's own namespace has there."""
    made: list[T] = []
    failed: list[BaseException] = []

    def enter_and_make() -> None:
        try:
            fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {netns_path}")
            finally:
                os.close(fd)
            made.append(factory())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=enter_and_make)
    thread.start()
    thread.join(30)
    if failed:
        raise failed[0]
    return made[0]


@contextlib.contextmanager
def servers() -> Iterator[list[Any]]:
    """Collects servers a test starts and closes them all at the end, whatever happens."""
    started: list[Any] = []
    try:
        yield started
    finally:
        for server in reversed(started):
            with contextlib.suppress(Exception):
                server.close()
