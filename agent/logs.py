"""Logging: plain text for people, one JSON object per line for log pipelines."""

from __future__ import annotations

import json
import logging
import sys

from agent.timestamps import rfc3339


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": rfc3339(record.created, milliseconds=True),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(fmt: str = "text", level: str = "info") -> None:
    root = logging.getLogger()
    handler = next((h for h in root.handlers if getattr(h, "_node_health", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler._node_health = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.setLevel(level.upper())
