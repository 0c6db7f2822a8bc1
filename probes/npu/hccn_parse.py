"""hccn_tool outputs (`hccn_tool -i N VERB -g`) and /etc/hccn.conf: pure functions of text.

Formats as MindCluster's sources and Huawei's documentation print them (tests/fixtures/hccn_tool/SOURCES.md):
`link status: UP`, `[device 0]link up count : 2` (or `[devid 0]`), `net health status: Success`, the
`key : value` lines of `-optical -g`, `ipaddr:` / `netmask:` of `-ip -g`, `address_N=` of hccn.conf.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from probes.base import ProbeParseError

_LINK = re.compile(r"^\s*link status\s*:\s*(\S+)\s*$", re.IGNORECASE | re.MULTILINE)
_LINK_UP_COUNT = re.compile(r"^\s*(?:\[dev(?:ice|id)?\s*\d+\])?\s*link up count\s*:\s*(\d+)\s*$", re.I | re.M)
_LINK_DOWN_COUNT = re.compile(r"^\s*(?:\[dev(?:ice|id)?\s*\d+\])?\s*link down count\s*:\s*(\d+)\s*$", re.I | re.M)
_NET_HEALTH = re.compile(r"^\s*net health status\s*:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_IPV4 = re.compile(r"\b(\d{1,3}(?:\.\d{1,3}){3})\b")
_NUMBER = re.compile(r"^(-?\d+(?:\.\d+)?)")


def parse_link(text: str) -> str:
    """`link status: UP` → "UP" (DOWN, or whatever word the tool prints, upper-cased)."""
    match = _LINK.search(text)
    if not match:
        raise ProbeParseError(f"no `link status:` line in {text.strip()[:80]!r}")
    return match.group(1).upper()


@dataclass(frozen=True)
class LinkStat:
    up_count: int
    down_count: int | None


def parse_link_stat(text: str) -> LinkStat:
    """`[device 0]link up count : 2` (and, on some drivers, `link down count`)."""
    up = _LINK_UP_COUNT.search(text)
    if not up:
        raise ProbeParseError(f"no `link up count` line in {text.strip()[:80]!r}")
    down = _LINK_DOWN_COUNT.search(text)
    return LinkStat(int(up.group(1)), int(down.group(1)) if down else None)


def parse_net_health(text: str) -> str:
    """`net health status: Success` → "Success" (Fault, Init, Socket failed, ... as printed)."""
    match = _NET_HEALTH.search(text)
    if not match:
        raise ProbeParseError(f"no `net health status:` line in {text.strip()[:80]!r}")
    return match.group(1)


@dataclass(frozen=True)
class Optical:
    present: bool
    temperature_celsius: float | None
    tx_power_mw: tuple[float, ...]  # per lane (one value on single-lane modules)
    rx_power_mw: tuple[float, ...]
    thresholds: dict[str, float]  # tx_low, tx_high, rx_low, rx_high, temp_high (the module's own)
    rx_los: bool
    tx_los: bool
    rx_lol: bool
    tx_lol: bool


def _number(value: str) -> float | None:
    match = _NUMBER.match(value.strip())
    return float(match.group(1)) if match else None


def _flag(value: str) -> bool:
    try:
        return int(value.strip(), 0) != 0
    except ValueError:
        return False


_THRESHOLDS = {
    "txpower low thres": "tx_low",
    "txpower high thres": "tx_high",
    "rxpower low thres": "rx_low",
    "rxpower high thres": "rx_high",
    "temp high thres": "temp_high",
}


def parse_optical(text: str) -> Optical:
    """`optical info:` then `key : value` lines; lanes `Tx Power0..3` (or one `Tx Power`)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            fields.setdefault(re.sub(r"\s+", " ", key.strip().lower()), value.strip())
    if "present" not in fields:
        raise ProbeParseError(f"no `present :` line in the optical output {text.strip()[:80]!r}")
    lanes: dict[str, dict[int, float]] = {"tx": {}, "rx": {}}
    for key, value in fields.items():
        match = re.fullmatch(r"(tx|rx) power(\d*)", key)
        number = _number(value) if match else None
        if match and number is not None:
            lanes[match.group(1)][int(match.group(2) or 0)] = number
    thresholds = {
        name: number for key, name in _THRESHOLDS.items() if (number := _number(fields.get(key, ""))) is not None
    }
    return Optical(
        present=fields["present"].lower() == "present",
        temperature_celsius=_number(fields.get("temperature", "")),
        tx_power_mw=tuple(v for _, v in sorted(lanes["tx"].items())),
        rx_power_mw=tuple(v for _, v in sorted(lanes["rx"].items())),
        thresholds=thresholds,
        rx_los=_flag(fields.get("rx los flag", "0")),
        tx_los=_flag(fields.get("tx los flag", "0")),
        rx_lol=_flag(fields.get("rx lol flag", "0")),
        tx_lol=_flag(fields.get("tx lol flag", "0")),
    )


@dataclass(frozen=True)
class Address:
    address: str | None  # None: no address configured (the tool printed nothing)
    netmask: str | None


def parse_ip(text: str) -> Address:
    """`ipaddr:192.161.200.10` / `netmask:255.255.255.0`; empty output: no address."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip().lower()] = value.strip()
        elif line.strip():
            raise ProbeParseError(f"`-ip -g` line {line.strip()[:60]!r} is not `key:value`")
    address = fields.get("ipaddr") or None
    if address is not None:
        _check_ipv4(address, "ipaddr")
    return Address(address, fields.get("netmask") or None)


def parse_gateway(text: str) -> str | None:
    """The IPv4 address on a `gateway` line, or None when the output names none."""
    for line in text.splitlines():
        if "gateway" in line.lower():
            match = _IPV4.search(line)
            if match:
                return _check_ipv4(match.group(1), "gateway")
    return None


def _check_ipv4(value: str, what: str) -> str:
    try:
        return str(ipaddress.IPv4Address(value))
    except ValueError as exc:
        raise ProbeParseError(f"{what} {value[:40]!r} is not an IPv4 address") from exc


@dataclass(frozen=True)
class ConfiguredAddress:
    address: str | None
    netmask: str | None
    gateway: str | None


def parse_hccn_conf(text: str) -> dict[int, ConfiguredAddress]:
    """`address_0=...`, `netmask_0=...`, `gateway_0=...` → per device id; other keys (netdetect_N, ...) ignored."""
    found: dict[int, dict[str, str]] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.fullmatch(r"(address|netmask|gateway)_(\d+)\s*=\s*(\S+)", line)
        if match:
            found.setdefault(int(match.group(2)), {})[match.group(1)] = match.group(3)
    return {
        device: ConfiguredAddress(values.get("address"), values.get("netmask"), values.get("gateway"))
        for device, values in found.items()
    }
