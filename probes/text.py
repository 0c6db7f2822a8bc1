"""Text made safe and bounded for where it is shown: escaped, cut to a length, folded onto one line.

Findings, HTTP answers, Kubernetes messages, logs and config errors carry text that may come from a tenant (a
process name, a path, a line of tool output or of the kernel log, a client's query). Whatever reaches a
terminal, a log line or `kubectl describe node` passes `escape` first, where the message is made (a Finding
escapes its own subject, message and hint, and its observed values where they leave it): a character a
terminal acts on or hides is shown as an escape instead, so an operator sees that something hostile was there
and nothing acts on their terminal.

What is escaped: every character Python's `str.isprintable()` refuses, the rule `repr()` follows. That is C0
and C1 controls (ESC, newlines, DEL), format characters (bidi embeddings, overrides and isolates U+202A-U+202E
and U+2066-U+2069, the marks U+200E, U+200F and U+061C, the zero-width U+200B-U+200D, U+2060 and U+FEFF, the
soft hyphen, tag characters), the line and paragraph separators U+2028 and U+2029, lone surrogates (bytes
that did not decode), private-use and unassigned code points, and spaces other than ASCII's.

How: `\\xNN` below U+0100 (the kernel log's own form: a newline is `\\x0a`), `\\uNNNN` in the Basic
Multilingual Plane, `\\UNNNNNNNN` above. Escapes are plain ASCII, so escaping twice changes nothing; a
backslash is not escaped (a name that holds the text `\\x1b` reads like one that held ESC, and neither can act
on a terminal). Bounded: the first ESCAPES_MAX such characters of a text are escaped, each one after them is
shown as U+FFFD, so escaping adds at most ESCAPE_GROWTH_MAX characters to any text.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

ELLIPSIS = "…"
ASCII_ELLIPSIS = "..."  # where the reader may be a terminal or a CI log of unknown encoding (the HTTP answers)

ESCAPES_MAX = 32
REPLACEMENT = "\ufffd"
ESCAPE_GROWTH_MAX = 9 * ESCAPES_MAX  # the longest escape, \UNNNNNNNN, stands for one character

# Candidates only (anything but printable ASCII): each is then judged by str.isprintable().
_NOT_PLAIN = re.compile(r"[^\x20-\x7e]")
# An escape as `escape` writes it, and a head cut inside one (clip never splits an escape).
_ESCAPE = re.compile(r"\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})")
_PARTIAL_ESCAPE_AT_END = re.compile(r"\\(?:x[0-9a-f]?|u[0-9a-f]{0,3}|U[0-9a-f]{0,7})?\Z")
_LONGEST_ESCAPE = 10


def _escape_of(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape(text: str) -> str:
    """`text` with every character that is not printable shown as a visible escape (module docstring)."""
    if text.isprintable():
        return text
    escaped = 0

    def replace(match: re.Match[str]) -> str:
        nonlocal escaped
        char = match.group()
        if char.isprintable():
            return char
        escaped += 1
        return _escape_of(char) if escaped <= ESCAPES_MAX else REPLACEMENT

    return _NOT_PLAIN.sub(replace, text)


def escape_value(value: Any) -> Any:
    """`value` (a JSON-like structure: mappings, lists, tuples, strings, numbers) with every string in it, keys
    included, escaped; the very same object when nothing needed escaping."""
    kind = type(value)
    if kind is str:
        return value if value.isprintable() else escape(value)
    if kind is int or kind is float or kind is bool or value is None:
        return value
    if isinstance(value, Mapping):
        return _escape_mapping(value)
    if isinstance(value, (list, tuple)):
        elements = [escape_value(item) for item in value]
        if all(new is item for new, item in zip(elements, value, strict=True)):
            return value
        return elements if isinstance(value, list) else tuple(elements)
    return escape(value) if isinstance(value, str) else value


def _escape_mapping(value: Mapping[Any, Any]) -> Mapping[Any, Any]:
    copy: dict[Any, Any] | None = None
    for index, (key, item) in enumerate(value.items()):
        new_key, new = escape_value(key), escape_value(item)
        if copy is None and (new_key is not key or new is not item):
            copy = dict(itertools.islice(value.items(), index))  # what came before needed nothing
        if copy is not None:
            copy[new_key] = new
    return value if copy is None else copy


def clip(text: str, limit: int, ellipsis: str = ELLIPSIS) -> str:
    """`text` when it fits in `limit` characters, else its head and `ellipsis`, at most `limit` characters in
    all; the head never ends inside an escape `escape` wrote (it ends before it instead)."""
    if len(text) <= limit:
        return text
    end = max(0, limit - len(ellipsis))
    head = text[:end]
    partial = _PARTIAL_ESCAPE_AT_END.search(head, max(0, end - _LONGEST_ESCAPE))
    if partial is not None:
        whole = _ESCAPE.match(text, partial.start())
        if whole is not None and whole.end() > end:
            head = text[: partial.start()]
    return head + ellipsis


def one_line(text: str, limit: int | None = None, ellipsis: str = ELLIPSIS) -> str:
    """`text` escaped (so no newline or separator is left in it to split a line), stripped, then clipped to
    `limit` when one is given."""
    flat = escape(text).strip()
    return flat if limit is None else clip(flat, limit, ellipsis)


# userinfo in a URL (`scheme://user:password@host`), up to the last `@` before a space or quote: a password
# holding `@` or `/` (unencoded, as people write them) is still covered; redacting too much is the safe side.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s'\"]*@")


def redact_userinfo(text: str) -> str:
    """`text` with the userinfo of every URL in it replaced by `***` (credentials in a proxy URL are never shown:
    not in a finding, a log line, /status, an Event or a config error)."""
    return _USERINFO.sub(r"\1***@", text)
