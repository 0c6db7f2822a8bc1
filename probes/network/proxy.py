"""An egress target's HTTP proxy: its URL (with optional userinfo), its credentials, and the CONNECT.

Credentials come from the URL's userinfo (`http://user:password@proxy:3128`) or from `proxy_credentials_file`
(one line USER:PASSWORD, as a Secret is mounted), read at each check so a rotated Secret is used the next run.
They are sent as `Proxy-Authorization: Basic` and never shown: a proxy is always told as `http://***@host:port`
(`Proxy.shown`), its repr hides them, and no error message built here quotes the URL as written.
"""

from __future__ import annotations

import base64
import socket
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from probes.network.egress_errors import (
    EGRESS_PROXY_AUTH_REQUIRED,
    EGRESS_PROXY_CREDENTIALS_UNREADABLE,
    EGRESS_PROXY_STALLED,
    EGRESS_REFUSED,
    EGRESS_TIMEOUT,
    Deadline,
    EgressError,
)
from probes.runtime.addresses import split_host_port

PROXY_SCHEME = "http://"
DEFAULT_PROXY_PORT = 3128
MAX_CREDENTIALS_BYTES = 4096
MAX_HEAD_BYTES = 16384


@dataclass(frozen=True)
class Proxy:
    host: str
    port: int
    # user:password as sent (percent-decoded); "" when none. Not in repr: never printed.
    userinfo: str = field(default="", repr=False)
    credentials_from: str = ""  # "url" or "proxy_credentials_file": where the userinfo came from, for findings

    @property
    def shown(self) -> str:
        """The proxy as findings, logs and messages show it: `http://***@host:port` when it has credentials."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{PROXY_SCHEME}{'***@' if self.userinfo else ''}{host}:{self.port}"

    def authorization(self) -> str:
        """The Proxy-Authorization header's value ("" without credentials)."""
        if not self.userinfo:
            return ""
        return "Basic " + base64.b64encode(self.userinfo.encode("utf-8")).decode("ascii")

    def with_credentials(self, userinfo: str, source: str) -> Proxy:
        return Proxy(self.host, self.port, userinfo, source)


def parse_proxy(url: str) -> Proxy:
    """`http://[user:password@]host[:port][/]` → Proxy; ValueError naming what is wrong, never quoting the
    userinfo (a config error must not print the password)."""
    if not url.startswith(PROXY_SCHEME):
        raise ValueError("proxy must be http://host:port (HTTP CONNECT), optionally http://user:password@host:port")
    rest = url[len(PROXY_SCHEME) :].rstrip("/")
    userinfo, at, hostport = rest.rpartition("@")
    if at and (not userinfo or ":" not in userinfo):
        raise ValueError("proxy userinfo must be user:password (http://user:password@host:port)")
    if "/" in hostport or "?" in hostport or "#" in hostport:
        raise ValueError("proxy must be http://host:port with no path")
    try:
        host, port = split_host_port(hostport, DEFAULT_PROXY_PORT)
    except ValueError as exc:
        shown = f"{PROXY_SCHEME}{'***@' if at else ''}{hostport}"
        raise ValueError(f"proxy {shown}: {str(exc).replace(repr(hostport), 'host:port')}") from None
    decoded = urllib.parse.unquote(userinfo) if at else ""
    return Proxy(host, port, decoded, "url" if at else "")


def read_credentials(path: Path) -> str:
    """USER:PASSWORD from the first line of a credentials file (a mounted Secret); EgressError naming the file
    (never its content) when it cannot be read or holds no USER:PASSWORD."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CREDENTIALS_BYTES)
    except OSError as exc:
        message = f"cannot read proxy_credentials_file {path}: {exc.strerror or exc}"
        raise EgressError(EGRESS_PROXY_CREDENTIALS_UNREADABLE, message, phase="proxy") from None
    text = data.decode("utf-8", "replace")
    line = text.splitlines()[0].strip() if text.strip() else ""
    user, colon, _ = line.partition(":")
    if not colon or not user:
        message = f"proxy_credentials_file {path} does not hold USER:PASSWORD on its first line"
        raise EgressError(EGRESS_PROXY_CREDENTIALS_UNREADABLE, message, phase="proxy")
    return line


def read_http_head(sock: socket.socket, deadline: Deadline, phase: str, limit: int = MAX_HEAD_BYTES) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        sock.settimeout(deadline.left(phase, "the proxy's answer"))
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            break
    return data


def header(head: bytes, name: bytes) -> str:
    """The first value of one header of an HTTP answer's head ("" when absent)."""
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().decode("latin-1", "replace")
    return ""


def safe_header(text: str, limit: int = 120) -> str:
    """A proxy's header text as a message may show it: printable characters only, bounded."""
    return "".join(ch if ch.isprintable() else "?" for ch in text[:limit])


def auth_refused(proxy: Proxy, answer: str, request: str, proxy_authenticate: str) -> EgressError:
    """The error for a 407: what the proxy asks for, and whether credentials were sent (and refused)."""
    asks = f" (Proxy-Authenticate: {proxy_authenticate})" if proxy_authenticate else ""
    if proxy.userinfo:
        source = "proxy_credentials_file" if proxy.credentials_from == "proxy_credentials_file" else "the proxy URL"
        said = f"the credentials from {source} were refused"
    else:
        said = "proxy authentication required and no credentials are configured"
    return EgressError(
        EGRESS_PROXY_AUTH_REQUIRED,
        f"proxy {proxy.shown} answered {answer} to {request}: {said}{asks}",
        phase="proxy",
        proxy_status=407,
        proxy_authenticate=proxy_authenticate,
        proxy_credentials=proxy.credentials_from or "none",
    )


def proxy_connect(sock: socket.socket, proxy: Proxy, host: str, port: int, deadline: Deadline) -> None:
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}", "User-Agent: node-health"]
    if proxy.userinfo:
        lines.append(f"Proxy-Authorization: {proxy.authorization()}")
    request = "\r\n".join(lines) + "\r\n\r\n"
    sock.settimeout(deadline.left("proxy", "the proxy CONNECT"))  # none left: the deadline's, not the proxy's
    try:
        sock.sendall(request.encode("utf-8"))
        head = read_http_head(sock, deadline, "proxy")
    except (TimeoutError, EgressError) as exc:
        if isinstance(exc, EgressError) and exc.reason is not EGRESS_TIMEOUT:
            raise
        # Connected, asked, no answer: the proxy itself sits on the request (or drops it), not a firewall on the
        # way to it, which would have stopped the TCP connect.
        raise EgressError(
            EGRESS_PROXY_STALLED,
            f"proxy {proxy.shown} accepted the connection but did not answer CONNECT {authority} within "
            f"{deadline.describe()}",
            phase="proxy",
        ) from None
    status, answer = status_of(head)
    if status is None:
        message = f"proxy {proxy.shown} sent no HTTP answer to CONNECT {authority}"
        raise EgressError(EGRESS_REFUSED, message, phase="proxy")
    if status == 407:
        raise auth_refused(proxy, answer, f"CONNECT {authority}", safe_header(header(head, b"proxy-authenticate")))
    if status // 100 != 2:
        message = f"proxy {proxy.shown} answered {answer} to CONNECT {authority}"
        raise EgressError(EGRESS_REFUSED, message, phase="proxy", proxy_status=status)


def status_of(head: bytes) -> tuple[int | None, str]:
    """(status, "407 Proxy Authentication Required" as a message shows it) of an HTTP answer's head; None when
    it is no HTTP answer."""
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1", "replace").strip()
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isascii() or not parts[1].isdigit():
        return None, ""
    return int(parts[1]), safe_header(status_line[len(parts[0]) + 1 :])
