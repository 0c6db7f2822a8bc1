"""npu.roce's judgements on one chip's hccn_tool outputs: pure functions of the parsed outputs and the config."""

from __future__ import annotations

from typing import Any

from probes.base import PARSE_ERROR, Check, Finding, ProbeParseError, Sample, Status
from probes.npu.chip_reasons import (
    ADDRESS,
    FLAPS,
    HCCN_TOOL_FAILED,
    LINK,
    NET_HEALTH,
    NPU_ADDRESS_MISMATCH,
    NPU_ADDRESS_MISSING,
    NPU_LINK_DOWN,
    NPU_LINK_FLAPPING,
    NPU_NET_HEALTH_INIT,
    NPU_NET_UNHEALTHY,
    NPU_OPTICAL_ABSENT,
    NPU_OPTICAL_HOT,
    NPU_OPTICAL_POWER,
    NPU_OPTICAL_SIGNAL_LOST,
    OPTICAL,
)
from probes.npu.chipmap import ChipRef
from probes.npu.config import NpuConfig
from probes.npu.hccn import Call
from probes.npu.hccn_parse import ConfiguredAddress, Optical, parse_gateway, parse_ip, parse_link, parse_optical
from probes.npu.link_window import Flaps


def failed(check: Check, chip: ChipRef, call: Call) -> Finding:
    observed = {**chip.identity(), "command": call.command, "failure": call.kind}
    return check.report(
        HCCN_TOOL_FAILED, chip.subject, f"npu{chip.logical_id}: {call.error}", observed, device=chip.logical_id
    )


def parse_error(check: Check, chip: ChipRef, call: Call, exc: ProbeParseError) -> Finding:
    observed = {**chip.identity(), "command": call.command, "output": (call.output or "")[:300]}
    message = f"npu{chip.logical_id}: `{call.command}` not understood: {exc}"
    return check.report(PARSE_ERROR, chip.subject, message, observed, device=chip.logical_id)


def link_finding(chip: ChipRef, call: Call, samples: list[Sample]) -> Finding:
    if call.output is None:
        return failed(LINK, chip, call)
    try:
        state = parse_link(call.output)
    except ProbeParseError as exc:
        return parse_error(LINK, chip, call, exc)
    observed = {**chip.identity(), "link": state}
    samples.append(
        Sample(
            "nodehealth_npu_link_up",
            "RoCE port link state per chip: 1 UP, 0 otherwise "
            "(hccn_tool -link -g; npu-exporter's npu_chip_info_link_status).",
            1 if state == "UP" else 0,
            chip.labels(),
        )
    )
    if state == "UP":
        return LINK.ok(chip.subject, f"npu{chip.logical_id} RoCE port UP", observed, device=chip.logical_id)
    message = f"npu{chip.logical_id} (hccn_tool -i {chip.physical_id}) RoCE port is {state}"
    return LINK.report(NPU_LINK_DOWN, chip.subject, message, observed, device=chip.logical_id)


def flaps_finding(
    chip: ChipRef, up_count: int, flaps: Flaps, settings: NpuConfig, now: float, samples: list[Sample]
) -> Finding:
    observed: dict[str, Any] = {
        **chip.identity(),
        "link_up_count": up_count,
        "increase": flaps.increase,
        "window_seconds": settings.link_flap_window_seconds,
        "baseline_age_seconds": round(now - flaps.since, 1),
    }
    if flaps.reset:
        observed["counter_reset"] = True
    labels = chip.labels()
    samples.append(
        Sample(
            "nodehealth_npu_link_ups",
            "Link-up count of the chip's RoCE port (hccn_tool -link_stat -g; npu-exporter's npu_chip_link_up_num).",
            up_count,
            labels,
        )
    )
    samples.append(
        Sample(
            "nodehealth_npu_link_flaps",
            "Rise of the link-up count within npu.link_flap_window_seconds.",
            flaps.increase,
            labels,
        )
    )
    window = f"{settings.link_flap_window_seconds:g}s"
    if flaps.increase > settings.link_flap_max:
        message = (
            f"npu{chip.logical_id} RoCE port came up {flaps.increase} times within {window} "
            f"(link up count {up_count}; more than npu.link_flap_max {settings.link_flap_max})"
        )
        return FLAPS.report(NPU_LINK_FLAPPING, chip.subject, message, observed, device=chip.logical_id)
    note = " (count went down: driver reloaded, window restarted)" if flaps.reset else ""
    message = f"npu{chip.logical_id}: link up {flaps.increase} times within {window}{note}"
    return FLAPS.ok(chip.subject, message, observed, device=chip.logical_id)


def net_health_finding(chip: ChipRef, status: str, samples: list[Sample]) -> Finding:
    observed = {**chip.identity(), "net_health": status}
    samples.append(
        Sample(
            "nodehealth_npu_network_status",
            "The firmware's gateway probe per chip: 0 Success, "
            "1 Init, 2 anything else (npu-exporter's npu_chip_info_network_status).",
            NET_HEALTH_METRIC.get(status.lower(), 2),
            chip.labels(),
        )
    )
    if status == "Success":
        return NET_HEALTH.ok(
            chip.subject, f"npu{chip.logical_id}: gateway probe Success", observed, device=chip.logical_id
        )
    if status.lower() == "init":
        message = f"npu{chip.logical_id}: the firmware's gateway probe has not run (Init)"
        return NET_HEALTH.report(NPU_NET_HEALTH_INIT, chip.subject, message, observed, device=chip.logical_id)
    message = f"npu{chip.logical_id} (hccn_tool -i {chip.physical_id}) gateway probe: {status}"
    return NET_HEALTH.report(NPU_NET_UNHEALTHY, chip.subject, message, observed, device=chip.logical_id)


NET_HEALTH_METRIC = {"success": 0, "init": 1}  # anything else: 2 (npu-exporter: 0 healthy, otherwise not)


def optical_finding(chip: ChipRef, call: Call, settings: NpuConfig, samples: list[Sample]) -> Finding:
    if call.output is None:
        return failed(OPTICAL, chip, call)
    try:
        optical = parse_optical(call.output)
    except ProbeParseError as exc:
        return parse_error(OPTICAL, chip, call, exc)
    _optical_samples(chip, optical, samples)
    observed: dict[str, Any] = {
        **chip.identity(),
        "present": optical.present,
        "tx_power_mw": list(optical.tx_power_mw),
        "rx_power_mw": list(optical.rx_power_mw),
        "temperature_celsius": optical.temperature_celsius,
    }
    name, device = chip.subject, chip.logical_id
    who = f"npu{chip.logical_id} (hccn_tool -i {chip.physical_id}) optical module"
    if not optical.present:
        return OPTICAL.report(NPU_OPTICAL_ABSENT, name, f"{who} not present", observed, device=device)
    flags = [
        f
        for f, on in (
            ("Rx LOS", optical.rx_los),
            ("Tx LOS", optical.tx_los),
            ("Rx LoL", optical.rx_lol),
            ("Tx LoL", optical.tx_lol),
        )
        if on
    ]
    if flags:
        return OPTICAL.report(NPU_OPTICAL_SIGNAL_LOST, name, f"{who}: {', '.join(flags)}", observed, device=device)
    power = _power_problem(optical, settings)
    if power is not None:
        status, text = power
        return OPTICAL.report(NPU_OPTICAL_POWER, name, f"{who}: {text}", observed, status=status, device=device)
    limit = settings.optical_temperature_max_celsius
    if limit is None:
        limit = optical.thresholds.get("temp_high")
    temp = optical.temperature_celsius
    if limit is not None and temp is not None and temp > limit:
        return OPTICAL.report(NPU_OPTICAL_HOT, name, f"{who} at {temp:g} C, above {limit:g} C", observed, device=device)
    return OPTICAL.ok(name, f"{who}: present, signal and power in range", observed, device=device)


def _power_problem(optical: Optical, settings: NpuConfig) -> tuple[Status, str] | None:
    own = optical.thresholds
    limits = {
        "rx": (_pick(settings.optical_rx_power_min_mw, own.get("rx_low")), own.get("rx_high")),
        "tx": (
            _pick(settings.optical_tx_power_min_mw, own.get("tx_low")),
            _pick(settings.optical_tx_power_max_mw, own.get("tx_high")),
        ),
    }
    margin = settings.optical_power_margin
    warn: str | None = None
    for side, lanes in (("rx", optical.rx_power_mw), ("tx", optical.tx_power_mw)):
        low, high = limits[side]
        for lane, value in enumerate(lanes):
            label = f"{side.upper()} power lane {lane} {value:g} mW"
            if low is not None and value < low:
                return Status.FAIL, f"{label} below {low:g} mW"
            if high is not None and value > high:
                return Status.FAIL, f"{label} above {high:g} mW"
            if warn is None and low is not None and value < low * (1 + margin):
                warn = f"{label} within {margin:.0%} of its low threshold {low:g} mW"
            if warn is None and high is not None and value > high * (1 - margin):
                warn = f"{label} within {margin:.0%} of its high threshold {high:g} mW"
    return (Status.WARN, warn) if warn else None


def _pick(configured: float | None, own: float | None) -> float | None:
    return configured if configured is not None else own


def _optical_samples(chip: ChipRef, optical: Optical, samples: list[Sample]) -> None:
    labels = chip.labels()
    samples.append(
        Sample(
            "nodehealth_npu_optical_present",
            "Optical module of the chip's RoCE port in position (npu-exporter's npu_chip_optical_state).",
            1 if optical.present else 0,
            labels,
        )
    )
    if optical.temperature_celsius is not None:
        samples.append(
            Sample(
                "nodehealth_npu_optical_temperature_celsius",
                "Optical module temperature (npu-exporter's npu_chip_optical_temp).",
                optical.temperature_celsius,
                labels,
            )
        )
    for side, lanes in (("tx", optical.tx_power_mw), ("rx", optical.rx_power_mw)):
        for lane, value in enumerate(lanes):
            samples.append(
                Sample(
                    f"nodehealth_npu_optical_{side}_power_milliwatts",
                    f"Optical {side.upper()} power per lane (npu-exporter's npu_chip_optical_{side}_power_N).",
                    value,
                    {**labels, "lane": str(lane)},
                )
            )


def address_finding(
    chip: ChipRef, ip_call: Call, gw_call: Call | None, configured: ConfiguredAddress | None, conf_path: str
) -> Finding:
    if ip_call.output is None:
        return failed(ADDRESS, chip, ip_call)
    try:
        address = parse_ip(ip_call.output)
        gateway = parse_gateway(gw_call.output) if gw_call is not None and gw_call.output is not None else None
    except ProbeParseError as exc:
        return parse_error(ADDRESS, chip, ip_call, exc)
    observed: dict[str, Any] = {
        **chip.identity(),
        "address": address.address,
        "netmask": address.netmask,
        "gateway": gateway,
    }
    if gw_call is not None and gw_call.output is None:
        observed["gateway_error"] = gw_call.error
    name, device = chip.subject, chip.logical_id
    who = f"npu{chip.logical_id} (hccn_tool -i {chip.physical_id}) RoCE port"
    if address.address is None:
        return ADDRESS.report(NPU_ADDRESS_MISSING, name, f"{who} has no IP address", observed, device=device)
    if configured is not None:
        observed["configured"] = {
            "address": configured.address,
            "netmask": configured.netmask,
            "gateway": configured.gateway,
        }
        wrong = [
            f"{what} {have} (hccn.conf: {want})"
            for what, have, want in (
                ("address", address.address, configured.address),
                ("netmask", address.netmask, configured.netmask),
                ("gateway", gateway, configured.gateway),
            )
            if want is not None and have is not None and have != want
        ]
        if wrong:
            message = f"{who}: {'; '.join(wrong)}, differs from {conf_path}"
            return ADDRESS.report(NPU_ADDRESS_MISMATCH, name, message, observed, device=device)
    where = f", as {conf_path} says" if configured is not None else ""
    return ADDRESS.ok(name, f"{who} {address.address}/{address.netmask or '?'}{where}", observed, device=device)
