"""Link flaps: each chip's link-up count (`hccn_tool -link_stat -g`) sampled over npu.link_flap_window_seconds.

The samples are kept in a small JSON file under npu.state_dir (the agent's own path, where the DaemonSet mounts
the host's /var/lib/node-health), written atomically (a temporary file renamed over it, never through a symlink),
so the window survives an agent restart. A count that
goes down is a counter reset (a driver reload): the window starts again from the new count, never a burst.
Wall-clock seconds, so a restart keeps the window's age; a clock stepped back drops the samples from the future.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

STATE_FILE = "npu-link-flaps.json"
MAX_CHIPS = 64
MAX_SAMPLES = 64


@dataclass(frozen=True)
class Flaps:
    increase: int  # link-up count's rise within the window
    since: float  # the baseline's time (wall clock)
    reset: bool  # the count went down this run (driver reload): the window restarted


class LinkWindow:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.error = ""  # why the state file could not be read or written ("" when fine)
        self._samples: dict[int, list[tuple[float, int]]] = {}
        self._loaded = False

    def _load(self) -> None:
        self._loaded = True
        if self.path is None:
            return
        try:
            with open(self.path, encoding="utf-8", opener=_nofollow) as handle:
                data = json.loads(handle.read(1 << 20))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            self.error = f"{self.path}: {exc}"
            return
        chips = data.get("chips") if isinstance(data, dict) else None
        if not isinstance(chips, dict):
            self.error = f"{self.path}: no `chips` object; the window starts again"
            return
        for key, samples in list(chips.items())[:MAX_CHIPS]:
            try:
                parsed = [(float(t), int(c)) for t, c in samples][-MAX_SAMPLES:]
                self._samples[int(key)] = parsed
            except (TypeError, ValueError):
                continue

    def observe(self, counts: Mapping[int, int], now: float, window: float) -> dict[int, Flaps]:
        if not self._loaded:
            self._load()
        out: dict[int, Flaps] = {}
        for physical, count in counts.items():
            samples = [s for s in self._samples.get(physical, []) if s[0] <= now]
            reset = bool(samples) and count < samples[-1][1]
            if reset:
                samples = []
            samples.append((now, count))
            inside = [s for s in samples if s[0] >= now - window]
            before = [s for s in samples if s[0] < now - window]
            kept = (before[-1:] + inside)[-MAX_SAMPLES:]
            self._samples[physical] = kept
            baseline = kept[0]
            out[physical] = Flaps(max(0, count - baseline[1]), baseline[0], reset)
        self._save()
        return out

    def _save(self) -> None:
        if self.path is None:
            return
        data = {"chips": {str(k): v for k, v in sorted(self._samples.items())[:MAX_CHIPS]}}
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tmp.is_symlink():
                tmp.unlink()
            with open(tmp, "w", encoding="utf-8", opener=_exclusive) as handle:
                handle.write(json.dumps(data))
            os.replace(tmp, self.path)
            self.error = ""
        except OSError as exc:
            self.error = f"{self.path}: {exc}; the window is kept in memory only"


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def _exclusive(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW, 0o600)
