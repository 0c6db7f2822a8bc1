"""interconnect.ports: every InfiniBand/RoCE HCA port of the node, its state, rate and error counters.

Per port (subject `<hca>/<port>`, e.g. `mlx5_0/1`): down (not ACTIVE/LinkUp) fails; a rate below
`expected_rate_gbps` warns or fails; link_downed/link_error_recovery and the error counters are judged by their
increase within `window_seconds` (window.py: persisted, a reset is a new baseline). An HCA port is the node's
interconnect (category `interconnect`), not one GPU's: NCCL uses every port for every GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from probes.base import (
    NOT_APPLICABLE,
    PARSE_ERROR,
    Check,
    Finding,
    Probe,
    ProbeContext,
    ProbeOutput,
    ProbeParseError,
    Sample,
    Status,
    register,
)
from probes.interconnect.config import ERROR_COUNTERS, LINK_COUNTERS, PORTS_STATE, InterconnectConfig
from probes.interconnect.reasons import (
    HCA_PORT_DEGRADED,
    HCA_PORT_DOWN,
    HCA_PORT_ERRORS,
    HCA_PORT_FLAPPING,
    HCA_PORT_MISSING,
    INTERCONNECT_REASONS,
)
from probes.interconnect.sysfs import PortReading, infiniband_dir, list_ports, read_port
from probes.interconnect.window import CounterWindows

PORTS = Check("interconnect.ports")
COUNTERS = (*LINK_COUNTERS, *ERROR_COUNTERS)
PARSE_HINT = "the sysfs format of this HCA port is new to the agent: report it with `ls -R` of the port directory"


def port_samples(reading: PortReading) -> list[Sample]:
    """Labelled `device` and `port` as node_exporter's infiniband collector labels the same ports, so its series
    (node_infiniband_*) join without label_replace."""
    labels = {"device": reading.hca, "port": reading.port}
    out = [
        Sample("nodehealth_interconnect_port_state_id", "HCA port state (4: ACTIVE)", float(reading.state[0]), labels),
        Sample(
            "nodehealth_interconnect_port_physical_state_id",
            "HCA port physical state (5: LinkUp)",
            float(reading.phys_state[0]),
            labels,
        ),
    ]
    if reading.rate_gbps is not None:
        out.append(
            Sample(
                "nodehealth_interconnect_port_rate_bytes_per_second",
                "HCA port rate",
                reading.rate_gbps * 1e9 / 8,
                labels,
            )
        )
    out.extend(
        Sample(
            "nodehealth_interconnect_port_errors_total",
            "HCA port error counters since the driver loaded, by counter (the sysfs file's name)",
            float(value),
            {**labels, "counter": name},
            kind="counter",
        )
        for name, value in reading.counters.items()
    )
    return out


@register
class InterconnectPortsProbe(Probe):
    name = "interconnect.ports"
    checks = ("interconnect.ports",)
    reasons = INTERCONNECT_REASONS
    default_interval = 30.0
    default_timeout = 5.0
    needs = "/sys/class/infiniband (an InfiniBand or RoCE HCA with its driver, e.g. mlx5_ib)"

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        # Wall-clock seconds: the windows are kept across restarts. Tests pass their own clock.
        self._clock = clock or time.time
        self._windows: CounterWindows | None = None

    def applicable(self, ctx: ProbeContext) -> str | None:
        if ctx.settings(InterconnectConfig).expected_ports or list_ports(ctx.host.sys):
            return None
        return f"no InfiniBand/RoCE HCA port under {infiniband_dir(ctx.host.sys)} and none expected"

    def _windows_for(self, settings: InterconnectConfig) -> CounterWindows:
        windows = self._windows
        wanted = (settings.state_path(PORTS_STATE), settings.window_seconds)
        if windows is None or (windows.state_file, windows.window) != wanted:
            windows = self._windows = CounterWindows(*wanted, self._clock)
        return windows

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(InterconnectConfig)
        found = list_ports(ctx.host.sys)
        why = self.applicable(ctx)
        if why is not None:
            return [PORTS.report(NOT_APPLICABLE, "", why)]
        windows = self._windows_for(settings)
        out: ProbeOutput = []
        names = {f"{hca}/{port}" for hca, port in found}
        for missing in sorted(set(settings.expected_ports) - names):
            out.append(PORTS.report(HCA_PORT_MISSING, missing, f"{missing}: expected, not in sysfs"))
        read_keys: list[str] = []
        for hca, port in found:
            try:
                reading = read_port(ctx.host.sys, hca, port, COUNTERS)
            except ProbeParseError as exc:
                out.append(PORTS.report(PARSE_ERROR, f"{hca}/{port}", f"{hca}/{port}: {exc}", hint=PARSE_HINT))
                continue
            if reading.link_layer not in settings.link_layers:
                continue
            for name, value in reading.counters.items():
                windows.update(f"{reading.name} {name}", value)
                read_keys.append(f"{reading.name} {name}")
            out.extend(port_samples(reading))
            out.append(self._judge(reading, windows, settings))
        windows.retain(read_keys)
        windows.save()
        return out

    @staticmethod
    def _judge(reading: PortReading, windows: CounterWindows, settings: InterconnectConfig) -> Finding:
        increases = {name: windows.increase(f"{reading.name} {name}") for name in reading.counters}
        observed: dict[str, object] = {
            "state": reading.state[1],
            "phys_state": reading.phys_state[1],
            "link_layer": reading.link_layer,
            **{f"{name}_in_window": value for name, value in increases.items() if value},
        }
        if reading.rate_gbps is not None:
            observed["rate_gbps"] = reading.rate_gbps
        if windows.error:
            observed["state_error"] = windows.error  # the windows will not survive a restart
        subject = reading.name
        if not reading.up:
            message = f"{subject}: {reading.state[1]}/{reading.phys_state[1]} ({reading.link_layer})"
            return PORTS.report(HCA_PORT_DOWN, subject, message, observed)
        flaps = sum(increases.get(name, 0) for name in LINK_COUNTERS)
        if flaps >= settings.link_down_threshold:
            message = f"{subject}: the link went down or retrained {flaps} time(s) in the last {_span(settings)}"
            return PORTS.report(HCA_PORT_FLAPPING, subject, message, observed)
        expected = settings.expected_rate_gbps
        if expected is not None and (reading.rate_gbps is None or reading.rate_gbps < expected):
            rate = "no rate" if reading.rate_gbps is None else f"{reading.rate_gbps:g} Gb/s"
            message = f"{subject}: {rate}, expected {expected:g} Gb/s"
            status = Status.FAIL if settings.degraded_status == "fail" else Status.WARN
            return PORTS.report(HCA_PORT_DEGRADED, subject, message, observed, status=status)
        errors = {name: increases.get(name, 0) for name in ERROR_COUNTERS if increases.get(name, 0)}
        if sum(errors.values()) >= settings.error_threshold:
            listed = ", ".join(f"{name} +{value}" for name, value in errors.items())
            message = f"{subject}: {listed} in the last {_span(settings)}"
            return PORTS.report(HCA_PORT_ERRORS, subject, message, observed)
        rate = f" at {reading.rate_gbps:g} Gb/s" if reading.rate_gbps is not None else ""
        return PORTS.ok(subject, f"{subject}: ACTIVE{rate} ({reading.link_layer})", observed)


def _span(settings: InterconnectConfig) -> str:
    seconds = settings.window_seconds
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"
