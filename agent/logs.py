"""Logging: plain text for people, one JSON object per line for log pipelines.

The health history (HealthLog): each change of a check's effective status and of the node's readiness is one
record of the `node-health.health` logger, with its fields (`event`, `check`, `subject`, `from`, `to`, `reason`,
`message`) in the JSON format's object, rate-limited per check (docs/observability.md).

A log record can carry tenant text (a path, tool output, an exception's message, an Event's message), so both
formats escape what they write (probes/text.py): one record is one line, and no control, bidi or zero-width
character reaches a terminal or a log viewer. A URL's userinfo (a proxy password) is written as `***`. A
traceback keeps its line breaks; each of its lines is escaped (and in the text format marked as a continuation).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.snapshot import GONE, READINESS_CHANGE, Transition
from agent.timestamps import rfc3339
from probes.text import escape, escape_value, redact_userinfo

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CONTINUATION = "  | "  # begins each line of a traceback in the text format


def escape_lines(text: str, prefix: str = "") -> str:
    """Multi-line text (a traceback): each line escaped and prefixed, the line breaks between them kept."""
    return "\n".join(prefix + escape(redact_userinfo(line)) for line in text.split("\n"))


class TextFormatter(logging.Formatter):
    """One line per record; a traceback follows on lines that begin with CONTINUATION, so that no text in it
    (an exception's message may hold a tenant's newline) can pass for a record of its own."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        lines = [escape(redact_userinfo(self.formatMessage(record)))]
        # Formatted here, not taken from record.exc_text: another handler may have cached it unescaped.
        if record.exc_info:
            lines.append(escape_lines(self.formatException(record.exc_info), CONTINUATION))
        elif record.exc_text:
            lines.append(escape_lines(record.exc_text, CONTINUATION))
        if record.stack_info:
            lines.append(escape_lines(self.formatStack(record.stack_info), CONTINUATION))
        return "\n".join(lines)


# The attribute of a log record that holds a health record's fields (HealthLog), for the JSON format.
HEALTH_FIELDS = "health"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": rfc3339(record.created, milliseconds=True),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": escape(redact_userinfo(record.getMessage())),
        }
        fields = getattr(record, HEALTH_FIELDS, None)
        if isinstance(fields, dict):
            entry.update({key: value for key, value in escape_value(fields).items() if key not in entry})
        if record.exc_info:
            entry["exc"] = escape_lines(self.formatException(record.exc_info))
        return json.dumps(entry)


def configure_logging(fmt: str = "text", level: str = "info") -> None:
    root = logging.getLogger()
    handler = next((h for h in root.handlers if getattr(h, "_node_health", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler._node_health = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.setLevel(level.upper())


# --- the health history ----------------------------------------------------------------------------------------

HEALTH_LOGGER = "node-health.health"
LINES_PER_WINDOW = 5  # at most this many lines per check (and for readiness) in a window...
WINDOW_SECONDS = 60.0  # ...of this long; then one line says how many were suppressed
_CALM = ("ok", "skip", GONE, "ready")


@dataclass
class _Window:
    start: float
    lines: int = 0
    suppressed: int = 0
    latest: Transition | None = None


class HealthLog:
    """The state's transition sink in the daemon (agent/state.py TransitionSink): one log line per transition,
    at most `lines` per check and subject (and for readiness) in a `window`; past that they are counted, and one
    line `suppressed K transitions` says so, with where the check ended, when the window is over. A flapping
    check cannot flood the log, and the last line about a check always says its state."""

    def __init__(
        self,
        logger: logging.Logger | None = None,
        lines: int = LINES_PER_WINDOW,
        window: float = WINDOW_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger or logging.getLogger(HEALTH_LOGGER)
        self._lines = lines
        self._window = window
        self._mono = monotonic
        self._windows: dict[tuple[str, str, str], _Window] = {}

    def transition(self, change: Transition) -> None:
        key = (change.kind, change.check, change.subject)
        now = self._mono()
        window = self._windows.get(key)
        if window is not None and now - window.start >= self._window:
            self._summarise(window)
            window = None
        if window is None:
            window = self._windows[key] = _Window(now)
        if window.lines >= self._lines:
            window.suppressed += 1
            window.latest = change
            return
        window.lines += 1
        self._emit(change)

    def tick(self) -> None:
        """Summarise the windows that are over; forget those with nothing to say (memory stays bounded by the
        checks that changed within a window)."""
        now = self._mono()
        for key, window in list(self._windows.items()):
            if now - window.start >= self._window:
                self._summarise(window)
                del self._windows[key]

    def _summarise(self, window: _Window) -> None:
        change = window.latest
        if not window.suppressed or change is None:
            return
        what = "readiness" if change.kind == READINESS_CHANGE else f"check {_named(change)}"
        why = _why(change)
        self._log.log(
            logging.INFO if change.after in _CALM else logging.WARNING,
            "health: %s: suppressed %d transitions in %.0fs; now %s%s",
            what,
            window.suppressed,
            self._window,
            change.after,
            f" ({why})" if why else "",
            extra={
                HEALTH_FIELDS: {"event": "transitions_suppressed", "suppressed": window.suppressed, **_fields(change)}
            },
        )
        window.suppressed, window.latest = 0, None

    def _emit(self, change: Transition) -> None:
        level = logging.INFO if change.after in _CALM else logging.WARNING
        if change.kind == READINESS_CHANGE:
            message = f"health: node {change.before} -> {change.after}"
            message += f" ({change.message})" if change.message else ""
        else:
            message = f"health: check {_named(change)}: {change.before} -> {change.after} ({_why(change)})"
        self._log.log(
            level, "%s", message, extra={HEALTH_FIELDS: {"event": f"{change.kind}_transition", **_fields(change)}}
        )


def _named(change: Transition) -> str:
    return f"{change.check} {change.subject}" if change.subject else change.check


def _why(change: Transition) -> str:
    return f"{change.reason}: {change.message}" if change.reason else change.message


def _fields(change: Transition) -> dict[str, Any]:
    fields = change.to_dict()
    del fields["at"]  # the record's own ts
    return fields
