"""RFC 3339 timestamps in UTC, as the agent writes them: whole seconds where Kubernetes reads them
(metav1.Time has no fraction), milliseconds in /status and the JSON log."""

from __future__ import annotations

import time


def rfc3339(ts: float, *, milliseconds: bool = False) -> str:
    """`2024-05-01T12:00:00Z`, or `2024-05-01T12:00:00.250Z` with milliseconds (truncated, never rounded up
    into the next second)."""
    whole = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts))
    return f"{whole}.{int(ts % 1 * 1000):03d}Z" if milliseconds else whole + "Z"
