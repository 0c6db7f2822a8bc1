"""HTTP/1.1 on the wire: request heads read strictly (RFC 9112), answers encoded.

Where a parser could read a request head two ways, it is refused.

The server answers GET and HEAD without bodies, but a proxy or another server in front of it may frame a
request differently: a bare LF or CR that one reads as a line end and another does not, a duplicate or
malformed Content-Length, any Transfer-Encoding, a space before a header's colon, a control byte in a value.
Each gets 400 and the connection is closed, as RFC 9112 asks of a server that cannot tell one request from the
next; a version other than HTTP/1.0 and HTTP/1.1 gets 505. Header names and the method are tokens; the
Connection header is a list of tokens (`Connection: notclose` is not `close`). The request target is a path
(origin-form) or an absolute URI (absolute-form, which a server must accept; its path is what counts).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qs, unquote, urlsplit

# The whole head, its blank line included (a real client's is well under 1 KiB).
MAX_HEAD_BYTES = 16 * 1024
MAX_QUERY_FIELDS = 16

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(r"HTTP/[0-9]\.[0-9]")
# Control bytes other than CR, LF (checked as CRLF pairs) and tab (allowed in field values, RFC 9110 5.5):
# refused anywhere in a head, which covers field values and the request target in one pass.
_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_ABSOLUTE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
# A line end that is not CRLF: a bare LF, or a CR not followed by LF.
_BARE_LINE_END = re.compile(rb"(?<!\r)\n|\r(?!\n)")
_METHODS = frozenset({"GET", "HEAD"})  # tokens: the regex is for the others
# Headers that frame a message: given twice, two parsers may disagree on where the next request starts.
_SINGLE = frozenset({"content-length", "transfer-encoding", "host"})


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query_string: str
    headers: dict[str, str]

    @property
    def query(self) -> dict[str, list[str]]:
        """Query parameters; a parameter given twice keeps both values (callers reject that). Raises
        ValueError beyond MAX_QUERY_FIELDS fields, so a request cannot make the loop parse thousands."""
        return parse_qs(self.query_string, keep_blank_values=True, max_num_fields=MAX_QUERY_FIELDS)


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def bare_line_end(data: bytes, start: int = 0, complete: bool = False) -> bool:
    """Whether `data[start:]` holds a line end other than CRLF. Unless `complete`, a CR at the very end may
    still get its LF."""
    found = _BARE_LINE_END.search(data, start)
    if found is None:
        return False
    return complete or found.group() != b"\r" or found.start() != len(data) - 1


def _request_line(line: str) -> tuple[str, str, str]:
    parts = line.split(" ")
    if len(parts) != 3 or "\t" in line or not parts[1] or (parts[0] not in _METHODS and not _TOKEN.fullmatch(parts[0])):
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    if not version.startswith("HTTP/"):
        raise BadRequest(400, "malformed request line")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise BadRequest(505, f"HTTP version not supported{'' if _VERSION.fullmatch(version) else ' (malformed)'}")
    return method, target, version


def _headers(lines: list[str]) -> tuple[dict[str, str], list[str]]:
    """Header fields → (name → value, the Connection header's tokens)."""
    headers: dict[str, str] = {}
    connection: list[str] = []
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            # Covers obs-fold (a line starting with a space) and a space before the colon (RFC 9112 5.1).
            raise BadRequest(400, "malformed header line")
        value = value.strip(" \t")
        key = name.lower()
        if key in headers and key in _SINGLE:
            raise BadRequest(400, f"duplicate {name} header")
        if key == "connection":
            connection += [token.strip(" \t").lower() for token in value.split(",")]
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return headers, connection


def _target(target: str) -> tuple[str, str]:
    """(path, query) of an origin-form or absolute-form target."""
    if target.startswith("/"):
        path, _, query = target.partition("?")
        return path, query
    if _ABSOLUTE.match(target):
        parts = urlsplit(target)
        if parts.scheme.lower() in ("http", "https") and parts.netloc:
            return parts.path or "/", parts.query
    raise BadRequest(400, "request target must be a path or an absolute http URI")


def parse_head(head: bytes) -> tuple[Request, bool, bool]:
    """One request head (without the blank line) → (request, keep_alive, has_body). Raises BadRequest."""
    pairs = head.count(b"\r\n")  # counting in C: a line end other than CRLF makes the counts differ
    if head.count(b"\n") != pairs or head.count(b"\r") != pairs:
        raise BadRequest(400, "bare LF or CR in the request head: lines end with CRLF")
    if _CONTROL.search(head):
        raise BadRequest(400, "control character in the request head")
    text = head.decode("latin-1")  # decodes every byte
    lines = text.split("\r\n")
    while lines and not lines[0]:
        lines.pop(0)  # empty lines before the request line are ignored (RFC 9112 2.2)
    if not lines:
        raise BadRequest(400, "malformed request line")
    method, target, version = _request_line(lines[0])
    headers, connection = _headers(lines[1:])
    keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    length = headers.get("content-length")
    if length is not None and not re.fullmatch(r"[0-9]{1,18}", length):
        raise BadRequest(400, "invalid Content-Length")
    if "transfer-encoding" in headers:
        raise BadRequest(400, "Transfer-Encoding is not accepted")
    has_body = length is not None and int(length) > 0
    path, query = _target(target)
    return Request(method, unquote(path), query, headers), keep_alive, has_body


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")


_STATUS_LINES = {int(status): _status_line(int(status)) for status in HTTPStatus}


def encode_head(response: Response, keep_alive: bool) -> bytes:
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
    return b"".join(parts)


def encode_response(response: Response, keep_alive: bool, head_only: bool) -> bytes:
    head = encode_head(response, keep_alive)
    return head if head_only else head + response.body


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """Always valid JSON: json.dumps escapes quotes, backslashes and control bytes a client put in a path."""
    return Response(status, json.dumps({"error": message}).encode(), headers=headers or {})
