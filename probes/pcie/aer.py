"""AER error counters: the kernel's aer_dev_* files and what changed in them between runs.

Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats: `aer_dev_fatal`, `aer_dev_nonfatal` and
`aer_dev_correctable` hold `<name> <count>` lines (names may hold spaces: `Receiver Error 2`) and a last
`TOTAL_ERR_* N` line. They exist only with CONFIG_PCIEAER and OS-native AER.

Counters are cumulative since boot. The first reading of a function only sets its baseline; a counter that
goes down (the device was re-enumerated) is a new baseline.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from probes.base import ProbeParseError
from probes.pcie.sysfs import PciFunction, read_text

SEVERITIES = ("fatal", "nonfatal", "correctable")
AER_FILES = {"fatal": "aer_dev_fatal", "nonfatal": "aer_dev_nonfatal", "correctable": "aer_dev_correctable"}


@dataclass(frozen=True)
class AerCounts:
    """One aer_dev_* file: per-error counts as the kernel names them, and the TOTAL_ line."""

    counts: Mapping[str, int]
    total: int


def parse_aer_counters(text: str) -> AerCounts:
    """`<name> <count>` lines (names may hold spaces: `Receiver Error 2`), then `TOTAL_ERR_* N`.

    Bits without a name appear as `dev_cor_errs_bit[5] 3` on some kernels. Without a TOTAL_ line the
    total is the sum of the lines.
    """
    counts: dict[str, int] = {}
    total: int | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        name, _, number = line.rpartition(" ")
        name = name.strip()
        if not name:
            raise ProbeParseError(f"AER counter line without a name: {line!r}")
        try:
            value = int(number)
        except ValueError:
            raise ProbeParseError(f"AER counter line without a count: {line!r}") from None
        if value < 0:
            raise ProbeParseError(f"negative AER counter: {line!r}")
        if name.startswith("TOTAL_"):
            total = value
        else:
            counts[name] = value
    if total is None:
        if not counts:
            raise ProbeParseError("empty AER counter file")
        total = sum(counts.values())
    return AerCounts(counts, total)


def read_aer(function: PciFunction) -> dict[str, AerCounts] | None:
    """severity → counts; None when the kernel exposes no AER counters for this function."""
    texts = {severity: read_text(function.path / name) for severity, name in AER_FILES.items()}
    if all(text is None for text in texts.values()):
        return None
    return {severity: parse_aer_counters(text) for severity, text in texts.items() if text is not None}


@dataclass(frozen=True)
class AerEvent:
    """A counter rose: when (monotonic seconds), by how much, and at what rate (per minute)."""

    when: float
    delta: int
    per_minute: float


@dataclass
class AerHistory:
    when: float  # monotonic of the last reading
    totals: dict[str, int]
    events: dict[str, AerEvent] = field(default_factory=dict)  # severity → its last rise still held


class AerTracker:
    """Per-function counter baselines and the rises still within their hold time."""

    def __init__(self) -> None:
        self._history: dict[str, AerHistory] = {}

    def forget(self, address: str) -> None:
        self._history.pop(address, None)

    def retain(self, addresses: set[str]) -> None:
        """Drop functions no longer seen (hot-removed): a re-added device starts a new baseline."""
        for address in list(self._history):
            if address not in addresses:
                del self._history[address]

    def update(
        self, address: str, totals: Mapping[str, int], now: float, burst_per_minute: float, hold: float
    ) -> AerHistory:
        """Record a reading; a fatal or non-fatal rise, or corrected errors faster than `burst_per_minute`, is
        an event held for `hold` seconds after the counter last rose."""
        previous = self._history.get(address)
        history = AerHistory(now, dict(totals), dict(previous.events) if previous else {})
        if previous is not None:
            elapsed = max(now - previous.when, 0.0)
            for severity, total in totals.items():
                before = previous.totals.get(severity)
                if before is None or total <= before:
                    continue  # unchanged, or reset (device re-enumerated): the new value is the baseline
                delta = total - before
                # Per minute over at least a minute, so two runs a second apart do not inflate a rate.
                rate = delta * 60.0 / max(elapsed, 60.0)
                if severity == "correctable" and rate <= burst_per_minute:
                    continue
                history.events[severity] = AerEvent(now, delta, rate)
        history.events = {s: e for s, e in history.events.items() if now - e.when < hold}
        self._history[address] = history
        return history
