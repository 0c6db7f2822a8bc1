"""pcie.aer and pcie.link: AER error counters and link training of the accelerators' PCI functions.

For every function under <sys>/bus/pci/devices of a configured vendor (Huawei 0x19e5 by default; PCI
bridges only as ports) and the port directly above it (the link partner, where AER may count the errors
the endpoint never sees), the kernel's counters (Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats)
are compared between runs, and the link's current width and speed against what both ends support.

Counters are cumulative since boot. The first run only establishes the baseline, so a nonzero fatal or
non-fatal count found then, or left after an error's hold time ran out, is PcieErrorHistory (warn).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from probes.base import Finding, Probe, ProbeContext, ProbeOutput, ProbeParseError, Sample, Status, register

SEVERITIES = ("fatal", "nonfatal", "correctable")
_AER_FILES = {"fatal": "aer_dev_fatal", "nonfatal": "aer_dev_nonfatal", "correctable": "aer_dev_correctable"}
_TOTAL_NAMES = {"fatal": "TOTAL_ERR_FATAL", "nonfatal": "TOTAL_ERR_NONFATAL", "correctable": "TOTAL_ERR_COR"}
_BDF = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_BRIDGE_CLASS = 0x0604
# Category (taint, condition) of an error on a function of this vendor: the accelerator is what breaks.
_VENDOR_CATEGORY = {0x19E5: "npu", 0x10DE: "gpu"}

HINT_FATAL = (
    "an uncorrectable PCIe error hit this device (the driver may have reset it): check `dmesg | grep -i aer`, "
    "reseat or replace the card or riser; reboot the node to clear it"
)
HINT_NONFATAL = (
    "uncorrectable (non-fatal) PCIe errors: check `dmesg | grep -i aer` for the error type; repeated errors "
    "point at the card, riser or slot"
)
HINT_BURST = "a burst of corrected PCIe errors (signal integrity): check cabling, riser and slot; watch for a trend"
HINT_HISTORY = (
    "this device logged uncorrectable PCIe errors since boot, before the current window: check `dmesg | grep "
    "-i aer`; a reboot clears the counters"
)
HINT_LINK = (
    "the link trained below what both ends support (bad contact, riser, or a lane down): reseat the card; "
    "compare `lspci -vv -s ADDRESS | grep -E 'LnkCap|LnkSta'`"
)


# --- parsing ---------------------------------------------------------------------------------------


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


def parse_link_speed(text: str) -> float | None:
    """`16.0 GT/s PCIe`, `8 GT/s`, `2.5 GT/s` → GT/s; `Unknown` (or empty) → None."""
    match = re.match(r"\s*([0-9]+(?:\.[0-9]+)?)\s*GT/s", text)
    return float(match.group(1)) if match else None


def parse_link_width(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def parse_hex(text: str) -> int | None:
    try:
        return int(text.strip(), 16)
    except ValueError:
        return None


# --- sysfs -----------------------------------------------------------------------------------------


@dataclass
class PciFunction:
    address: str
    path: Path  # the real sysfs directory (symlinks resolved)
    vendor: int | None
    device: int | None
    pci_class: int | None
    role: str  # "endpoint" (a configured vendor's function) or "port" (the port above one)
    upstream: str | None = None  # address of the port above, when that is a PCI function
    below: list[str] = field(default_factory=list)  # for ports: the matched functions under them

    @property
    def is_bridge(self) -> bool:
        return self.pci_class is not None and self.pci_class >> 8 == _BRIDGE_CLASS


@dataclass(frozen=True)
class LinkState:
    width: int | None
    max_width: int | None
    speed: float | None  # GT/s
    max_speed: float | None

    @property
    def supported(self) -> bool:
        return self.width is not None and self.max_width is not None and self.max_width > 0


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _function_at(path: Path, role: str) -> PciFunction:
    return PciFunction(
        address=path.name,
        path=path,
        vendor=parse_hex(_read(path / "vendor") or ""),
        device=parse_hex(_read(path / "device") or ""),
        pci_class=parse_hex(_read(path / "class") or ""),
        role=role,
    )


def discover_functions(
    sys_dir: Path, vendors: set[int], device_ids: set[int], upstream_ports: bool = True
) -> list[PciFunction]:
    """Matched functions (sorted by address), then the ports above them (deduplicated)."""
    bus = Path(sys_dir) / "bus" / "pci" / "devices"
    endpoints: list[PciFunction] = []
    ports: dict[str, PciFunction] = {}
    try:
        names = sorted(os.listdir(bus))
    except OSError:
        return []
    for name in names:
        real = Path(os.path.realpath(bus / name))
        function = _function_at(real, "endpoint")
        function.address = name
        if function.vendor not in vendors or function.is_bridge:
            continue
        if device_ids and function.device not in device_ids:
            continue
        parent = real.parent
        if _BDF.match(parent.name):
            function.upstream = parent.name
            if upstream_ports:
                port = ports.get(parent.name)
                if port is None:
                    port = ports[parent.name] = _function_at(parent, "port")
                port.below.append(name)
        endpoints.append(function)
    matched = {f.address for f in endpoints}
    return endpoints + [p for a, p in sorted(ports.items()) if a not in matched]


def read_link(function: PciFunction) -> LinkState:
    return LinkState(
        width=parse_link_width(_read(function.path / "current_link_width") or ""),
        max_width=parse_link_width(_read(function.path / "max_link_width") or ""),
        speed=parse_link_speed(_read(function.path / "current_link_speed") or ""),
        max_speed=parse_link_speed(_read(function.path / "max_link_speed") or ""),
    )


def read_aer(function: PciFunction) -> dict[str, AerCounts] | None:
    """severity → counts; None when the kernel exposes no AER counters for this function."""
    texts = {severity: _read(function.path / name) for severity, name in _AER_FILES.items()}
    if all(text is None for text in texts.values()):
        return None
    return {severity: parse_aer_counters(text) for severity, text in texts.items() if text is not None}


# --- the probe -------------------------------------------------------------------------------------


@dataclass
class _AerHistory:
    when: float  # monotonic of the last reading
    totals: dict[str, int]
    # severity → (monotonic when the counter last rose, by how much, errors per minute for correctable)
    events: dict[str, tuple[float, int, float]] = field(default_factory=dict)


def _speed_text(gts: float | None) -> str:
    return "unknown" if gts is None else f"{gts:g} GT/s"


@register
class PcieProbe(Probe):
    name = "pcie"
    checks = ("pcie.aer", "pcie.link")
    default_interval = 30.0
    default_timeout = 5.0
    needs = "/sys/bus/pci (AER counters need CONFIG_PCIEAER and OS-native AER)"

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        # Monotonic seconds; tests pass their own clock to step time without sleeping.
        self._clock = clock or time.monotonic
        self._aer: dict[str, _AerHistory] = {}

    def _functions(self, ctx: ProbeContext) -> list[PciFunction]:
        cfg = ctx.config.pcie
        return discover_functions(
            ctx.host.sys,
            {int(v, 16) for v in cfg.vendors},
            {int(d, 16) for d in cfg.device_ids},
            cfg.upstream_ports,
        )

    def applicable(self, ctx: ProbeContext) -> str | None:
        bus = ctx.host.sys / "bus" / "pci" / "devices"
        if not bus.is_dir():
            return f"no PCI bus visible ({bus} missing)"
        if not self._functions(ctx):
            cfg = ctx.config.pcie
            ids = f" with device id {', '.join(cfg.device_ids)}" if cfg.device_ids else ""
            return f"no PCI function of vendor {', '.join(cfg.vendors)}{ids} under {bus}"
        return None

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        cfg = ctx.config.pcie
        functions = self._functions(ctx)
        if not functions:
            reason = self.applicable(ctx) or "no matching PCI function"
            return [Finding(check, "", Status.SKIP, "NotApplicable", reason) for check in self.checks]
        by_address = {f.address: f for f in functions}
        links = {f.address: read_link(f) for f in functions}
        now = self._clock()
        out: ProbeOutput = []
        for function in functions:
            category = self._category(function, by_address)
            out.extend(self._aer_output(function, now, cfg.correctable_burst_per_minute, cfg.hold_seconds, category))
            out.extend(self._link_output(function, links, cfg.link_speed_check, category))
        seen = set(by_address)
        for address in list(self._aer):
            if address not in seen:  # hot-removed: a re-added device starts a new baseline
                del self._aer[address]
        return out

    @staticmethod
    def _category(function: PciFunction, by_address: Mapping[str, PciFunction]) -> str | None:
        vendor = function.vendor
        if function.role == "port" and function.below:
            vendor = by_address[function.below[0]].vendor
        return _VENDOR_CATEGORY.get(vendor or -1)

    # --- pcie.aer ------------------------------------------------------------------------------

    def _aer_output(
        self, function: PciFunction, now: float, burst_per_minute: float, hold: float, category: str | None
    ) -> ProbeOutput:
        address = function.address
        observed_base = {"role": function.role, **({"upstream": function.upstream} if function.upstream else {})}
        if function.role == "port":
            observed_base["below"] = ", ".join(function.below)
        try:
            counters = read_aer(function)
        except ProbeParseError as exc:
            self._aer.pop(address, None)
            return [
                Finding(
                    "pcie.aer",
                    address,
                    Status.UNKNOWN,
                    "ParseError",
                    f"{address}: unreadable AER counters: {exc}",
                    "the kernel's aer_dev_* format is new to the agent",
                    observed_base,
                    category_override=category,
                )
            ]
        if counters is None:
            self._aer.pop(address, None)
            return [
                Finding(
                    "pcie.aer",
                    address,
                    Status.SKIP,
                    "Unsupported",
                    f"{address}: no AER counters in sysfs (kernel without CONFIG_PCIEAER, firmware-first AER, "
                    "or not a PCIe function)",
                    observed=observed_base,
                    category_override=category,
                )
            ]
        totals = {severity: counts.total for severity, counts in counters.items()}
        previous = self._aer.get(address)
        history = _AerHistory(now, totals, dict(previous.events) if previous else {})
        if previous is not None:
            elapsed = max(now - previous.when, 0.0)
            for severity, total in totals.items():
                before = previous.totals.get(severity)
                if before is None or total < before:
                    continue  # counters reset (device re-enumerated): the new value is the baseline
                delta = total - before
                if delta <= 0:
                    continue
                # Per minute over at least a minute, so two runs a second apart do not inflate a rate.
                rate = delta * 60.0 / max(elapsed, 60.0)
                if severity == "correctable" and rate <= burst_per_minute:
                    continue
                history.events[severity] = (now, delta, rate)
        history.events = {s: e for s, e in history.events.items() if now - e[0] < hold}
        self._aer[address] = history

        observed = {
            **observed_base,
            **{f"{severity}_total": total for severity, total in totals.items()},
            **{
                f"{severity}_errors": ", ".join(f"{name} {count}" for name, count in counts.counts.items() if count)
                for severity, counts in counters.items()
                if any(counts.counts.values())
            },
        }
        out: ProbeOutput = [
            Sample(
                "nodehealth_pcie_aer_errors_total",
                "PCIe AER errors the kernel counted for a PCI function since boot, by severity",
                float(total),
                {"device": address, "severity": severity},
                kind="counter",
            )
            for severity, total in totals.items()
        ]
        out.append(self._aer_finding(function, history, totals, observed, category))
        return out

    @staticmethod
    def _aer_finding(
        function: PciFunction,
        history: _AerHistory,
        totals: Mapping[str, int],
        observed: dict[str, object],
        category: str | None,
    ) -> Finding:
        address = function.address
        what = f"{address} ({function.role}{' above ' + ', '.join(function.below) if function.below else ''})"
        events = history.events
        if "fatal" in events:
            _, delta, _ = events["fatal"]
            return Finding(
                "pcie.aer",
                address,
                Status.FAIL,
                "PcieFatalErrors",
                f"{what}: {delta} new fatal PCIe error(s), {totals['fatal']} since boot",
                HINT_FATAL,
                {**observed, "new_fatal": delta},
                category_override=category,
            )
        if "nonfatal" in events:
            _, delta, _ = events["nonfatal"]
            return Finding(
                "pcie.aer",
                address,
                Status.WARN,
                "PcieNonFatalErrors",
                f"{what}: {delta} new non-fatal PCIe error(s), {totals['nonfatal']} since boot",
                HINT_NONFATAL,
                {**observed, "new_nonfatal": delta},
                category_override=category,
            )
        if "correctable" in events:
            _, delta, rate = events["correctable"]
            return Finding(
                "pcie.aer",
                address,
                Status.WARN,
                "PcieCorrectableBurst",
                f"{what}: {delta} corrected PCIe errors at {rate:.1f}/min, {totals['correctable']} since boot",
                HINT_BURST,
                {**observed, "new_correctable": delta, "correctable_per_minute": round(rate, 2)},
                category_override=category,
            )
        fatal, nonfatal = totals.get("fatal", 0), totals.get("nonfatal", 0)
        if fatal or nonfatal:
            return Finding(
                "pcie.aer",
                address,
                Status.WARN,
                "PcieErrorHistory",
                f"{what}: {fatal} fatal and {nonfatal} non-fatal PCIe errors since boot, none new",
                HINT_HISTORY,
                observed,
                category_override=category,
            )
        return Finding(
            "pcie.aer",
            address,
            Status.OK,
            "OK",
            f"{what}: no uncorrectable PCIe errors, {totals.get('correctable', 0)} corrected since boot",
            observed=observed,
            category_override=category,
        )

    # --- pcie.link -----------------------------------------------------------------------------

    def _link_output(
        self,
        function: PciFunction,
        links: Mapping[str, LinkState],
        check_speed: bool,
        category: str | None,
    ) -> ProbeOutput:
        address = function.address
        link = links[address]
        if not link.supported:
            return [
                Finding(
                    "pcie.link",
                    address,
                    Status.SKIP,
                    "Unsupported",
                    f"{address}: no PCIe link status in sysfs (not a PCIe function, or an integrated one)",
                    category_override=category,
                )
            ]
        # The link trains to what both ends support: the partner is the port above an endpoint, or the
        # function below a port.
        partner_address = function.upstream if function.role == "endpoint" else next(iter(function.below), None)
        partner = links.get(partner_address or "")
        if partner is None and function.role == "endpoint" and partner_address:
            partner = read_link(_function_at(function.path.parent, "port"))  # ports not checked themselves
        expected_width = link.max_width or 0
        expected_speed = link.max_speed
        if partner is not None and partner.max_width:
            expected_width = min(expected_width, partner.max_width)
        if partner is not None and partner.max_speed is not None and expected_speed is not None:
            expected_speed = min(expected_speed, partner.max_speed)
        width = link.width or 0
        out: ProbeOutput = []
        labels = {"device": address}
        out.append(Sample("nodehealth_pcie_link_width_lanes", "Negotiated PCIe link width", float(width), labels))
        out.append(
            Sample(
                "nodehealth_pcie_link_max_width_lanes", "Maximum PCIe link width", float(link.max_width or 0), labels
            )
        )
        if link.speed is not None:
            out.append(
                Sample(
                    "nodehealth_pcie_link_speed_transfers_per_second",
                    "Negotiated PCIe link speed",
                    link.speed * 1e9,
                    labels,
                )
            )
        if link.max_speed is not None:
            out.append(
                Sample(
                    "nodehealth_pcie_link_max_speed_transfers_per_second",
                    "Maximum PCIe link speed",
                    link.max_speed * 1e9,
                    labels,
                )
            )
        observed: dict[str, object] = {
            "width": width,
            "max_width": link.max_width,
            "expected_width": expected_width,
            "speed_gts": link.speed,
            "max_speed_gts": link.max_speed,
            "expected_speed_gts": expected_speed,
            "role": function.role,
        }
        if partner_address:
            observed["partner"] = partner_address
        problems = []
        if width == 0:
            problems.append(f"link down (x0 of x{expected_width})")
        elif width < expected_width:
            problems.append(f"x{width} of x{expected_width} lanes")
        if check_speed and link.speed is not None and expected_speed is not None and link.speed < expected_speed:
            problems.append(f"{_speed_text(link.speed)} of {_speed_text(expected_speed)}")
        now_text = f"x{width} at {_speed_text(link.speed)}"
        if problems:
            return [
                *out,
                Finding(
                    "pcie.link",
                    address,
                    Status.WARN,
                    "PcieLinkDegraded",
                    f"{address} ({function.role}): PCIe link degraded: {', '.join(problems)}",
                    HINT_LINK.replace("ADDRESS", address),
                    observed,
                    category_override=category,
                ),
            ]
        return [
            *out,
            Finding(
                "pcie.link",
                address,
                Status.OK,
                "OK",
                f"{address}: link {now_text} (expected x{expected_width} at {_speed_text(expected_speed)})",
                observed=observed,
                category_override=category,
            ),
        ]
