"""pcie.aer and pcie.link: AER error counters and link training of the accelerators' PCI functions.

For every function under <sys>/bus/pci/devices of a configured vendor (Huawei 0x19e5 by default; PCI
bridges only as ports) and the port directly above it (the link partner, where AER may count the errors
the endpoint never sees), the kernel's AER counters are compared between runs (aer.py), and the link's
current width and speed against what both ends support.

The first run only establishes the baseline, so a nonzero fatal or non-fatal count found then, or left after
an error's hold time ran out, is PcieErrorHistory (warn). A function that is, or sits above, an accelerator
the npu/gpu probes published (ctx.host.devices) reports for that device: its index, its name in messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from probes.base import (
    NOT_APPLICABLE,
    OBSERVED_PCI_BUS_ID,
    OK,
    PARSE_ERROR,
    Check,
    Finding,
    Probe,
    ProbeContext,
    ProbeOutput,
    ProbeParseError,
    Reason,
    Sample,
    Status,
    register,
)
from probes.pcie.aer import SEVERITIES, AerCounts, AerHistory, AerTracker, read_aer
from probes.pcie.config import PcieConfig
from probes.pcie.devices import VENDOR_CATEGORY, Target, accelerators_below, targets_of
from probes.pcie.sysfs import LinkState, PciFunction, discover_functions, function_at, pci_devices_dir, read_link

AER = Check("pcie.aer")
LINK = Check("pcie.link")

PCIE_FATAL = Reason(
    "PcieFatalErrors",
    Status.FAIL,
    "the fatal (uncorrectable) AER counter of the function rose within pcie.hold_seconds",
    "an uncorrectable PCIe error hit this device (the driver may have reset it): check `dmesg | grep -i aer`, "
    "reseat or replace the card or riser; reboot the node to clear it",
)
PCIE_NONFATAL = Reason(
    "PcieNonFatalErrors",
    Status.WARN,
    "the non-fatal uncorrectable AER counter rose within pcie.hold_seconds",
    "uncorrectable (non-fatal) PCIe errors: check `dmesg | grep -i aer` for the error type; repeated errors "
    "point at the card, riser or slot",
)
PCIE_BURST = Reason(
    "PcieCorrectableBurst",
    Status.WARN,
    "corrected AER errors faster than pcie.correctable_burst_per_minute (counted over at least a minute)",
    "a burst of corrected PCIe errors (signal integrity): check cabling, riser and slot; watch for a trend",
)
PCIE_HISTORY = Reason(
    "PcieErrorHistory",
    Status.WARN,
    "fatal or non-fatal AER errors since boot, none new (found at agent start, or the hold ran out)",
    "this device logged uncorrectable PCIe errors since boot, before the current window: check `dmesg | grep "
    "-i aer`; a reboot clears the counters",
)
PCIE_LINK_DEGRADED = Reason(
    "PcieLinkDegraded",
    Status.WARN,
    "the link trained narrower or slower than both ends support, or is down",
    "the link trained below what both ends support (bad contact, riser, or a lane down): reseat the card; "
    "compare `lspci -vv -s ADDRESS | grep -E 'LnkCap|LnkSta'`",
)
PCIE_UNSUPPORTED = Reason(
    "Unsupported",
    Status.SKIP,
    "the kernel exposes no AER counters (aer_dev_*) or no link status for this function",
    "AER counters need CONFIG_PCIEAER and OS-native AER; under firmware-first AER errors reach only the "
    "firmware log. A function without link files is not PCIe (virtio) or is integrated",
)
AER_FORMAT_HINT = "the kernel's aer_dev_* format is new to the agent: report it with the file's content"


def _speed_text(gts: float | None) -> str:
    return "unknown" if gts is None else f"{gts:g} GT/s"


def _vendor_category(function: PciFunction, by_address: Mapping[str, PciFunction]) -> str | None:
    vendor = function.vendor
    if function.role == "port" and function.below:
        vendor = by_address[function.below[0]].vendor
    return VENDOR_CATEGORY.get(vendor if vendor is not None else -1)


def _report(
    check: Check, reason: Reason, target: Target, message: str, observed: Mapping[str, object], hint: str | None = None
) -> Finding:
    observed = dict(observed)
    if target.accelerator is not None:
        observed["accelerator"] = target.accelerator.name
        observed[OBSERVED_PCI_BUS_ID] = target.accelerator.bus_id
    return check.report(
        reason,
        target.subject,
        f"{target.label}: {message}",
        observed,
        hint=hint,
        device=target.device,
        category=target.category,
    )


def aer_observed(function: PciFunction, counters: Mapping[str, AerCounts] | None = None) -> dict[str, object]:
    observed: dict[str, object] = {"role": function.role}
    if function.upstream:
        observed["upstream"] = function.upstream
    if function.role == "port":
        observed["below"] = ", ".join(function.below)
    for severity, counts in (counters or {}).items():
        observed[f"{severity}_total"] = counts.total
        named = ", ".join(f"{name} {count}" for name, count in counts.counts.items() if count)
        if named:
            observed[f"{severity}_errors"] = named
    return observed


def aer_verdict(history: AerHistory) -> tuple[Reason, str, dict[str, object]]:
    """The reason, message and extra observed values of one function's AER state."""
    totals, events = history.totals, history.events
    if "fatal" in events:
        delta = events["fatal"].delta
        return PCIE_FATAL, f"{delta} new fatal PCIe error(s), {totals['fatal']} since boot", {"new_fatal": delta}
    if "nonfatal" in events:
        delta = events["nonfatal"].delta
        message = f"{delta} new non-fatal PCIe error(s), {totals['nonfatal']} since boot"
        return PCIE_NONFATAL, message, {"new_nonfatal": delta}
    if "correctable" in events:
        event = events["correctable"]
        message = (
            f"{event.delta} corrected PCIe errors at {event.per_minute:.1f}/min, {totals['correctable']} since boot"
        )
        rate = round(event.per_minute, 2)
        return PCIE_BURST, message, {"new_correctable": event.delta, "correctable_per_minute": rate}
    fatal, nonfatal = totals.get("fatal", 0), totals.get("nonfatal", 0)
    if fatal or nonfatal:
        return PCIE_HISTORY, f"{fatal} fatal and {nonfatal} non-fatal PCIe errors since boot, none new", {}
    return OK, f"no uncorrectable PCIe errors, {totals.get('correctable', 0)} corrected since boot", {}


def expected_link(function: PciFunction, links: Mapping[str, LinkState]) -> tuple[int, float | None, str | None]:
    """Width and speed the link should train to: what both ends support. The partner is the port above an
    endpoint, or the function below a port. Returns (width, speed, partner address)."""
    link = links[function.address]
    partner_address = function.upstream if function.role == "endpoint" else next(iter(function.below), None)
    partner = links.get(partner_address or "")
    if partner is None and function.role == "endpoint" and partner_address:
        partner = read_link(function_at(function.path.parent, "port"))  # ports not checked themselves
    width = link.max_width or 0
    speed = link.max_speed
    if partner is not None and partner.max_width:
        width = min(width, partner.max_width)
    if partner is not None and partner.max_speed is not None and speed is not None:
        speed = min(speed, partner.max_speed)
    return width, speed, partner_address


def series_labels(address: str) -> dict[str, str]:
    """`pci_bus_id`, in the form npu-smi prints and npu-exporter labels (`0000:C1:00.0`, upper-case hex), so the
    PCIe series join the NPU series and npu-exporter's without label_replace. Messages and subjects keep the
    kernel's form (`0000:c1:00.0`), which lspci and sysfs take."""
    return {"pci_bus_id": address.upper()}


def link_samples(address: str, link: LinkState) -> list[Sample]:
    labels = series_labels(address)
    out = [
        Sample("nodehealth_pcie_link_width_lanes", "Negotiated PCIe link width", float(link.width or 0), labels),
        Sample("nodehealth_pcie_link_max_width_lanes", "Maximum PCIe link width", float(link.max_width or 0), labels),
    ]
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
    return out


def link_problems(link: LinkState, width: int, speed: float | None, check_speed: bool) -> list[str]:
    problems = []
    current = link.width or 0
    if current == 0:
        problems.append(f"link down (x0 of x{width})")
    elif current < width:
        problems.append(f"x{current} of x{width} lanes")
    if check_speed and link.speed is not None and speed is not None and link.speed < speed:
        problems.append(f"{_speed_text(link.speed)} of {_speed_text(speed)}")
    return problems


@register
class PcieProbe(Probe):
    name = "pcie"
    checks = ("pcie.aer", "pcie.link")
    categories = tuple(sorted(set(VENDOR_CATEGORY.values())))  # an accelerator's function is its device's
    reasons = (
        PCIE_FATAL,
        PCIE_NONFATAL,
        PCIE_BURST,
        PCIE_HISTORY,
        PCIE_LINK_DEGRADED,
        PCIE_UNSUPPORTED,
    )
    default_interval = 30.0
    default_timeout = 5.0
    needs = "/sys/bus/pci (AER counters need CONFIG_PCIEAER and OS-native AER)"

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        # Monotonic seconds; tests pass their own clock to step time without sleeping.
        self._clock = clock or time.monotonic
        self._aer = AerTracker()

    def _functions(self, ctx: ProbeContext) -> list[PciFunction]:
        settings = ctx.settings(PcieConfig)
        return discover_functions(
            ctx.host.sys,
            {int(v, 16) for v in settings.vendors},
            {int(d, 16) for d in settings.device_ids},
            settings.upstream_ports,
        )

    def applicable(self, ctx: ProbeContext) -> str | None:
        bus = pci_devices_dir(ctx.host.sys)
        if not bus.is_dir():
            return f"no PCI bus visible ({bus} missing)"
        if not self._functions(ctx):
            settings = ctx.settings(PcieConfig)
            ids = f" with device id {', '.join(settings.device_ids)}" if settings.device_ids else ""
            return f"no PCI function of vendor {', '.join(settings.vendors)}{ids} under {bus}"
        return None

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(PcieConfig)
        functions = self._functions(ctx)
        if not functions:
            why = self.applicable(ctx) or "no matching PCI function"
            return [AER.report(NOT_APPLICABLE, "", why), LINK.report(NOT_APPLICABLE, "", why)]
        by_address = {f.address: f for f in functions}
        served = accelerators_below(functions, ctx.host.devices.all(), ctx.host.sys)
        links = {f.address: read_link(f) for f in functions}
        now = self._clock()
        out: ProbeOutput = []
        for function in functions:
            targets = targets_of(function, served.get(function.address, []), _vendor_category(function, by_address))
            out.extend(self._aer_output(function, targets, now, settings))
            out.extend(self._link_output(function, targets, links, settings.link_speed_check))
        self._aer.retain(set(by_address))
        return out

    def _aer_output(
        self, function: PciFunction, targets: list[Target], now: float, settings: PcieConfig
    ) -> ProbeOutput:
        try:
            counters = read_aer(function)
        except ProbeParseError as exc:
            self._aer.forget(function.address)
            observed = aer_observed(function)
            message = f"unreadable AER counters: {exc}"
            return [_report(AER, PARSE_ERROR, t, message, observed, AER_FORMAT_HINT) for t in targets]
        if counters is None:
            self._aer.forget(function.address)
            message = (
                "no AER counters in sysfs (kernel without CONFIG_PCIEAER, firmware-first AER, or not a PCIe function)"
            )
            return [_report(AER, PCIE_UNSUPPORTED, t, message, aer_observed(function)) for t in targets]
        totals = {severity: counts.total for severity, counts in counters.items()}
        history = self._aer.update(
            function.address, totals, now, settings.correctable_burst_per_minute, settings.hold_seconds
        )
        reason, message, extra = aer_verdict(history)
        observed = {**aer_observed(function, counters), **extra}
        out: ProbeOutput = [
            Sample(
                "nodehealth_pcie_aer_errors_total",
                "PCIe AER errors the kernel counted for a PCI function since boot, by severity",
                float(totals[severity]),
                {**series_labels(function.address), "severity": severity},
                kind="counter",
            )
            for severity in SEVERITIES
            if severity in totals
        ]
        out.extend(_report(AER, reason, target, message, observed) for target in targets)
        return out

    @staticmethod
    def _link_output(
        function: PciFunction, targets: list[Target], links: Mapping[str, LinkState], check_speed: bool
    ) -> ProbeOutput:
        link = links[function.address]
        if not link.supported:
            message = "no PCIe link status in sysfs (not a PCIe function, or an integrated one)"
            return [_report(LINK, PCIE_UNSUPPORTED, target, message, {}) for target in targets]
        width, speed, partner = expected_link(function, links)
        observed: dict[str, object] = {
            "width": link.width or 0,
            "max_width": link.max_width,
            "expected_width": width,
            "speed_gts": link.speed,
            "max_speed_gts": link.max_speed,
            "expected_speed_gts": speed,
            "role": function.role,
        }
        if partner:
            observed["partner"] = partner
        out: ProbeOutput = list(link_samples(function.address, link))
        problems = link_problems(link, width, speed, check_speed)
        if problems:
            message = f"PCIe link degraded: {', '.join(problems)}"
            hint = PCIE_LINK_DEGRADED.hint.replace("ADDRESS", function.address)
            out.extend(_report(LINK, PCIE_LINK_DEGRADED, t, message, observed, hint) for t in targets)
            return out
        message = f"link x{link.width or 0} at {_speed_text(link.speed)} (expected x{width} at {_speed_text(speed)})"
        out.extend(_report(LINK, OK, target, message, observed, "") for target in targets)
        return out
