"""What HTTP answers look like: /ready's JSON and text bodies, error answers. Pure functions over a verdict.

/ready answers JSON by default and plain text (`format=text`, or `Accept: text/plain`) for job logs: the first
line says `ready` or `not ready` (and, for `pod=`, which devices were judged), then each reason with its fix,
wrapped at word boundaries into lines of at most TEXT_LINE_MAX characters, the continuation lines indented by two
spaces, at most TEXT_REASON_LINES lines a reason (ASCII `...` where it is cut: the reader may be a terminal).
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from agent.http.server import Response
from agent.snapshot import Verdict, reason_dict
from probes.base import Finding
from probes.text import ASCII_ELLIPSIS, clip, one_line

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXT_TYPE = "text/plain; charset=utf-8"
TEXT_LINE_MAX = 200  # characters per text line, so a CI log shows each line whole
TEXT_REASON_LINES = 4  # lines per reason: a first line and up to three continuation lines
CONTINUATION = "  "  # a continuation line starts with it; a reason's first line never does
# What a reason may say in all, its words wrapped: room to spare in TEXT_REASON_LINES lines, whatever the breaks.
TEXT_REASON_ROOM = TEXT_LINE_MAX * TEXT_REASON_LINES * 3 // 4
TEXT_REASONS_MAX = 20
_FIX = " -- fix: "


def _fold(text: str, limit: int | None = None) -> str:
    """Text for a text answer: one line, cut with an ASCII ellipsis."""
    return one_line(text, limit, ASCII_ELLIPSIS)


def _cut(text: str, limit: int) -> str:
    return clip(text, limit, ASCII_ELLIPSIS)


@dataclass(frozen=True)
class Scope:
    """What a /ready?pod= answer judged: `pod` in the JSON answer, `line` on the text answer's first line."""

    pod: dict[str, Any]
    line: str


def ready_body(node: str, verdict: Verdict, scope: Scope | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "ready": verdict.ready,
        "node": node,
        "reasons": [reason_dict(f) for f in verdict.reasons],
        "age_seconds": verdict.age_seconds,
    }
    if scope is not None:
        body["pod"] = scope.pod
    return body


def reason_lines(finding: Finding) -> list[str]:
    """`fail storage.space /data DiskFull: 98% used -- fix: clean caches`, wrapped at word boundaries into lines of
    at most TEXT_LINE_MAX characters (continuations indented by CONTINUATION), at most TEXT_REASON_LINES of them.
    The message and the fix share TEXT_REASON_ROOM characters, each cut with `...` only as far as needed, so the
    fix shows whatever the message's length; a word longer than a line is split."""
    head = (
        f"{finding.status.value} {_fold(finding.check, 48)} {_fold(finding.subject, 48) or '-'} "
        f"{_fold(finding.reason, 48)}: "
    )
    message, hint = _fold(finding.message), _fold(finding.hint)
    room = TEXT_REASON_ROOM - len(head) - (len(_FIX) if hint else 0)
    hint_room = min(len(hint), max(room // 2, room - len(message)))
    text = head + _cut(message, room - hint_room) + (_FIX + _cut(hint, hint_room) if hint else "")
    if len(text) <= TEXT_LINE_MAX:
        return [text]
    wrapped = textwrap.wrap(
        text,
        TEXT_LINE_MAX,
        subsequent_indent=CONTINUATION,
        break_on_hyphens=False,
        max_lines=TEXT_REASON_LINES,
        placeholder=" " + ASCII_ELLIPSIS,
    )
    return wrapped or [_cut(text, TEXT_LINE_MAX)]


def ready_text(node: str, verdict: Verdict, scope: Scope | None = None) -> bytes:
    """The first line is `ready on <node>` or `not ready on <node>: <n> reasons`, with ` for <pod ...>` after the
    node for pod= (older pre-flight scripts read only those first words)."""
    name = _fold(node, 80) + (f" for {_fold(scope.line, 160)}" if scope is not None else "")
    count = len(verdict.reasons)
    if verdict.ready:
        lines = [f"ready on {name}"]
    else:
        lines = [f"not ready on {name}: {count} reason{'' if count == 1 else 's'}"]
    lines.extend(line for finding in verdict.reasons[:TEXT_REASONS_MAX] for line in reason_lines(finding))
    if count > TEXT_REASONS_MAX:
        lines.append(f"... and {count - TEXT_REASONS_MAX} more (the JSON answer and /status list them all)")
    return ("\n".join(lines) + "\n").encode()


def ready_response(node: str, verdict: Verdict, text: bool, scope: Scope | None = None) -> Response:
    status = 200 if verdict.ready else 503
    if text:
        return Response(status, ready_text(node, verdict, scope), content_type=TEXT_TYPE)
    return json_answer(ready_body(node, verdict, scope), status)


def error_answer(status: int, message: str, text: bool, headers: dict[str, str] | None = None) -> Response:
    if text:
        body = f"{HTTPStatus(status).phrase.lower()}: {_fold(message, 400)}\n".encode()
        return Response(status, body, content_type=TEXT_TYPE, headers=headers or {})
    return Response(status, json.dumps({"error": message}).encode(), headers=headers or {})


def json_answer(body: dict[str, Any], status: int) -> Response:
    return Response(status, json.dumps(body).encode())
