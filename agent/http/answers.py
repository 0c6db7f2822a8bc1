"""What HTTP answers look like: /ready's JSON and text bodies, error answers. Pure functions over a verdict.

/ready answers JSON by default and plain text (`format=text`, or `Accept: text/plain`) for job logs: the first
line says `ready` or `not ready` (and, for `pod=`, which devices were judged), then one bounded line per reason
with its fix (ASCII `...` where a line is cut: the reader may be a terminal).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from agent.http.server import Response
from agent.snapshot import Verdict, reason_dict
from probes.base import Finding
from probes.text import ASCII_ELLIPSIS, clip, one_line

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXT_TYPE = "text/plain; charset=utf-8"
TEXT_LINE_MAX = 200  # characters per text line, so a CI log shows each reason whole
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


def ready_text(node: str, verdict: Verdict, scope: Scope | None = None) -> bytes:
    """The first line is `ready on <node>` or `not ready on <node>: <n> reasons`, with ` for <pod ...>` after the
    node for pod= (older pre-flight scripts read only those first words)."""
    name = _fold(node, 80) + (f" for {_fold(scope.line, 160)}" if scope is not None else "")
    count = len(verdict.reasons)
    if verdict.ready:
        lines = [f"ready on {name}"]
    else:
        lines = [f"not ready on {name}: {count} reason{'' if count == 1 else 's'}"]
    lines.extend(reason_line(finding) for finding in verdict.reasons[:TEXT_REASONS_MAX])
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
