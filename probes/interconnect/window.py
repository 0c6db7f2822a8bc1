"""Counter increases within a window, kept in a small state file so an agent restart keeps them.

Per counter (a key such as `mlx5_0/1 symbol_error`): the last value read and the increases seen, each with the
wall-clock second it was seen (wall clock, not monotonic: the file must mean the same after a restart). The
first reading of a counter only sets its baseline. A value lower than the last one is a reset (the driver was
reloaded, the node rebooted): the new value is the new baseline and no increase, so a reset is never a burst.

The file is JSON, written to a temporary name (created anew, never through a symlink) and renamed (a crash
leaves the old file or the new one, never half of one); a file that is missing, unreadable or malformed is an
empty baseline (logged once), never a crash. A file that cannot be written (its directory is not mounted, a
read-only root) leaves the windows in memory: logged once, and `error` says why, for the findings to carry.
Its size is bounded: increases older than the window are dropped, at most MAX_EVENTS per counter and
MAX_KEYS counters are kept.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAX_EVENTS = 512
MAX_KEYS = 4096


class CounterWindows:
    def __init__(self, state_file: str, window: float, clock: Callable[[], float]) -> None:
        self.state_file = state_file
        self.window = window
        self._clock = clock
        self._last: dict[str, int] = {}
        self._events: dict[str, list[tuple[float, int]]] = {}
        self.error = ""  # why the file could not be read or written, "" when it could
        self._load()

    def _failed(self, error: str) -> None:
        if error != self.error:
            log.warning("interconnect: %s", error)
        self.error = error

    def _load(self) -> None:
        if not self.state_file:
            return
        try:
            fd = os.open(self.state_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, encoding="utf-8") as handle:
                data = json.loads(handle.read(4 << 20))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            self._failed(f"ignoring the counter baseline {self.state_file}: {exc}")
            return
        counters = data.get("counters") if isinstance(data, dict) else None
        if not isinstance(counters, dict):
            self._failed(f"ignoring the counter baseline {self.state_file}: no counters")
            return
        for key, entry in list(counters.items())[:MAX_KEYS]:
            parsed = _entry(entry)
            if isinstance(key, str) and parsed is not None:
                self._last[key], self._events[key] = parsed

    def update(self, key: str, value: int) -> None:
        """Take a new reading of one counter."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and value > last:
            self._events.setdefault(key, []).append((now, value - last))
        self._last[key] = value
        self._prune(key, now)

    def increase(self, key: str) -> int:
        """The counter's increase within the window ending now (0 for a counter seen once)."""
        start = self._clock() - self.window
        return sum(delta for when, delta in self._events.get(key, ()) if when >= start)

    def known(self, key: str) -> bool:
        return key in self._last

    def _prune(self, key: str, now: float) -> None:
        start = now - self.window
        events = [event for event in self._events.get(key, ()) if event[0] >= start][-MAX_EVENTS:]
        if events:
            self._events[key] = events
        else:
            self._events.pop(key, None)

    def keys_of(self, prefix: str) -> list[str]:
        """The counters kept under `prefix` (a device's), so a run that could not read them can retain them."""
        return [key for key in self._last if key.startswith(prefix)]

    def retain(self, keys: Iterable[str]) -> None:
        """Forget counters no longer read (a port removed), so the file does not grow without end."""
        keep = set(keys)
        for key in [k for k in self._last if k not in keep]:
            self._last.pop(key, None)
            self._events.pop(key, None)

    def save(self) -> None:
        if not self.state_file:
            return
        counters = {
            key: {"last": last, "events": [[when, delta] for when, delta in self._events.get(key, ())]}
            for key, last in list(self._last.items())[:MAX_KEYS]
        }
        path = Path(self.state_file)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        data = json.dumps({"version": 1, "counters": counters}).encode()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary.unlink(missing_ok=True)
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(temporary, path)
        except OSError as exc:
            self._failed(f"cannot keep the counter baseline in {self.state_file} (kept in memory): {exc}")
            return
        self.error = ""


def _entry(entry: Any) -> tuple[int, list[tuple[float, int]]] | None:
    if not isinstance(entry, Mapping):
        return None
    last = entry.get("last")
    events = entry.get("events")
    if not isinstance(last, int) or isinstance(last, bool) or last < 0 or not isinstance(events, list):
        return None
    out: list[tuple[float, int]] = []
    for item in events[-MAX_EVENTS:]:
        if (
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], (int, float))
            and isinstance(item[1], int)
            and item[1] > 0
        ):
            out.append((float(item[0]), item[1]))
    return last, out
