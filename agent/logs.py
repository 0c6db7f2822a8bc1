"""Logging: plain text for people, one JSON object per line for log pipelines.

A log record can carry tenant text (a path, tool output, an exception's message, an Event's message), so both
formats escape what they write (probes/text.py): one record is one line, and no control, bidi or zero-width
character reaches a terminal or a log viewer. A URL's userinfo (a proxy password) is written as `***`. A
traceback keeps its line breaks; each of its lines is escaped (and in the text format marked as a continuation).
"""

from __future__ import annotations

import json
import logging
import sys

from agent.timestamps import rfc3339
from probes.text import escape, redact_userinfo

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


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": rfc3339(record.created, milliseconds=True),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": escape(redact_userinfo(record.getMessage())),
        }
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
