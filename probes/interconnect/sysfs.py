"""HCA ports in sysfs (Documentation/ABI/stable/sysfs-class-infiniband).

`<sys>/class/infiniband/<hca>/ports/<n>/` holds `state` (`4: ACTIVE`), `phys_state` (`5: LinkUp`), `rate`
(`400 Gb/sec (4X NDR)`), `link_layer` (`InfiniBand` or `Ethernet`) and `counters/<name>` (decimal, cumulative
since the driver loaded). Sysfs reads do not hang; a file that is absent is None, one in a format the agent does
not know is a ProbeParseError.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from probes.base import ProbeParseError

_STATE = re.compile(r"^\s*([0-9]+):\s*([A-Za-z_]+)\s*$")
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")
ACTIVE = 4  # enum ib_port_state IB_PORT_ACTIVE
LINK_UP = 5  # phys_state LinkUp
# Ports listed at most per node: an HCA has 1 or 2; a bound on what a hostile or broken sysfs can cost.
MAX_PORTS = 256


@dataclass(frozen=True)
class PortReading:
    hca: str
    port: str
    state: tuple[int, str]
    phys_state: tuple[int, str]
    rate_gbps: float | None
    link_layer: str
    counters: Mapping[str, int]

    @property
    def name(self) -> str:
        return f"{self.hca}/{self.port}"

    @property
    def up(self) -> bool:
        return self.state[0] == ACTIVE and self.phys_state[0] == LINK_UP


def infiniband_dir(sys_root: str | Path) -> Path:
    return Path(sys_root) / "class" / "infiniband"


def _read(path: Path) -> str | None:
    try:
        with path.open(errors="replace") as handle:
            return handle.read(4096)
    except OSError:
        return None


def parse_state(text: str, what: str) -> tuple[int, str]:
    """`4: ACTIVE` → (4, "ACTIVE")."""
    match = _STATE.match(text)
    if match is None:
        raise ProbeParseError(f"{what} is {text.strip()[:60]!r}, not `<n>: <NAME>`")
    return int(match.group(1)), match.group(2)


def parse_rate(text: str) -> float | None:
    """`400 Gb/sec (4X NDR)`, `2.5 Gb/sec (1X SDR)` → Gb/s; an empty rate (a port still training) → None."""
    if not text.strip():
        return None
    match = _RATE.match(text)
    if match is None:
        raise ProbeParseError(f"rate is {text.strip()[:60]!r}, not `<n> Gb/sec (...)`")
    return float(match.group(1))


def parse_counter(text: str, what: str) -> int:
    value = text.strip()
    if not value.isdigit():
        raise ProbeParseError(f"counter {what} is {value[:40]!r}, not a number")
    return int(value)


def list_ports(sys_root: str | Path) -> list[tuple[str, str]]:
    """(hca, port) of every port in sysfs, sorted; at most MAX_PORTS."""
    base = infiniband_dir(sys_root)
    out: list[tuple[str, str]] = []
    try:
        hcas = sorted(entry.name for entry in base.iterdir())
    except OSError:
        return []
    for hca in hcas:
        try:
            ports = sorted((p.name for p in (base / hca / "ports").iterdir() if p.name.isdigit()), key=int)
        except OSError:
            continue
        out.extend((hca, port) for port in ports)
        if len(out) >= MAX_PORTS:
            return out[:MAX_PORTS]
    return out


def read_port(sys_root: str | Path, hca: str, port: str, counters: Iterable[str]) -> PortReading:
    """One port's files; raises ProbeParseError for a file in an unknown format or a missing state."""
    path = infiniband_dir(sys_root) / hca / "ports" / port
    state = _read(path / "state")
    phys = _read(path / "phys_state")
    if state is None or phys is None:
        raise ProbeParseError(f"{hca}/{port} has no state or phys_state file")
    values: dict[str, int] = {}
    for name in counters:
        text = _read(path / "counters" / name)
        if text is not None:
            values[name] = parse_counter(text, name)
    return PortReading(
        hca,
        port,
        parse_state(state, "state"),
        parse_state(phys, "phys_state"),
        parse_rate(_read(path / "rate") or ""),
        (_read(path / "link_layer") or "InfiniBand").strip(),
        values,
    )
