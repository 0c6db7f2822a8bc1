"""Text bounded for where it is shown: cut to a length, folded onto one line.

Findings, HTTP answers, Kubernetes messages and config errors carry text that may come from a tenant (a
process name, a path, a client's query): each is cut to its room here, and what reaches a terminal or a log
line is folded onto one line first.
"""

from __future__ import annotations

import re

ELLIPSIS = "…"
ASCII_ELLIPSIS = "..."  # where the reader may be a terminal or a CI log of unknown encoding (the HTTP answers)

# C0 and C1 controls (a terminal acts on them), and the Unicode line and paragraph separators.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def clip(text: str, limit: int, ellipsis: str = ELLIPSIS) -> str:
    """`text` when it fits in `limit` characters, else its head and `ellipsis`, `limit` characters in all."""
    return text if len(text) <= limit else text[: max(0, limit - len(ellipsis))] + ellipsis


def one_line(text: str, limit: int | None = None, ellipsis: str = ELLIPSIS) -> str:
    """`text` with every run of control characters (newlines included) made one space, stripped, then
    clipped to `limit` when one is given."""
    flat = _CONTROL.sub(" ", text).strip()
    return flat if limit is None else clip(flat, limit, ellipsis)
