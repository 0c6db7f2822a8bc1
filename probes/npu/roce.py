"""npu.roce: each NPU's RoCE port (the HCCL parameter plane) through hccn_tool, per chip by physical id.

- npu.roce.link: `-link -g` UP, else NpuLinkDown.
- npu.roce.flaps: `-link_stat -g`'s link-up count rising by more than npu.link_flap_max within
  npu.link_flap_window_seconds (probes/npu/link_window.py: kept across restarts, a reset is not a burst).
- npu.roce.net_health: `-net_health -g`, the firmware's gateway probe: Success ok, Init unknown, else a fault.
- npu.roce.optical: `-optical -g` every npu.optical_interval_seconds (the last verdict stands in between):
  presence, LOS/LoL, TX/RX power and temperature against thresholds.
- npu.roce.address: `-ip -g` and `-gateway -g` present and as /etc/hccn.conf (under host.root) says.

hccn_tool runs as probes/npu/hccn.py says (bounded children, deadline, output cap). A node without NPUs skips;
NPUs without hccn_tool is HccnToolMissing (unknown) on every check.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from probes.base import (
    NOT_APPLICABLE,
    PARSE_ERROR,
    Finding,
    Probe,
    ProbeContext,
    ProbeOutput,
    ProbeParseError,
    Sample,
    register,
)
from probes.npu.chip_reasons import (
    ADDRESS,
    FLAPS,
    HCCN_TOOL_MISSING,
    LINK,
    NET_HEALTH,
    OPTICAL,
    ROCE_CHECKS,
    ROCE_REASONS,
)
from probes.npu.chipmap import ChipMap, ChipRef
from probes.npu.config import NpuConfig
from probes.npu.hccn import Call, Runner, hccn_available
from probes.npu.hccn_parse import ConfiguredAddress, parse_hccn_conf, parse_link_stat, parse_net_health
from probes.npu.link_window import STATE_FILE, LinkWindow
from probes.npu.npu import davinci_numbers
from probes.npu.roce_findings import (
    address_finding,
    failed,
    flaps_finding,
    link_finding,
    net_health_finding,
    optical_finding,
    parse_error,
)
from probes.npu.smi import search_smi

VERBS = ("link", "link_stat", "net_health", "ip", "gateway")


@register
class RoceProbe(Probe):
    name = "npu.roce"
    checks = tuple(check.name for check in ROCE_CHECKS)
    reasons = ROCE_REASONS
    default_interval = 60.0
    default_timeout = 30.0
    needs = "hccn_tool (the Ascend driver's tools) and /dev/davinciN"

    def __init__(self) -> None:
        self._chipmap = ChipMap()
        self._window: LinkWindow | None = None
        self._calls: dict[tuple[int, str], tuple[Call, float]] = {}  # the last answer of each read, and when
        self._flaps: dict[int, tuple[Finding, list[Sample]]] = {}
        self.spawned = 0  # hccn_tool children started by the last run (benchmarks/npu_links.py)

    def applicable(self, ctx: ProbeContext) -> str | None:
        if not davinci_numbers(ctx.host.dev):
            return "no NPUs on this host (no /dev/davinciN): no RoCE ports to check"
        return None

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(NpuConfig)
        davinci = davinci_numbers(ctx.host.dev)
        if not davinci:
            return [c.report(NOT_APPLICABLE, "", "no NPUs on this host") for c in ROCE_CHECKS]
        if not hccn_available(ctx, settings):
            return self._missing(ctx, settings, davinci)
        chips, note = self._chipmap.chips(ctx, davinci)
        now = time.monotonic()
        runner = Runner(ctx, settings)
        fresh = runner.run(self.due(settings, chips, now))
        self.spawned = runner.spawned
        if any(call.kind == "not_installed" for call in fresh.values()):
            return self._missing(ctx, settings, davinci)
        self._calls.update({key: (call, now) for key, call in fresh.items()})
        calls = {
            key: self._calls[key][0]
            for c in chips
            for v in (*VERBS, "optical")
            if (key := (c.physical_id, v)) in self._calls
        }
        out: ProbeOutput = []
        out.extend(self._links(ctx, settings, chips, calls, fresh, note))
        configured = self._hccn_conf(ctx, settings)
        for chip in chips:
            samples: list[Sample] = []
            out.append(self._net_health(chip, calls[(chip.physical_id, "net_health")], samples))
            conf = configured.get(chip.physical_id) if configured is not None else None
            if configured is not None and conf is None:
                conf = ConfiguredAddress(None, None, None)
            ip, gateway = calls[(chip.physical_id, "ip")], calls.get((chip.physical_id, "gateway"))
            out.append(address_finding(chip, ip, gateway, conf, settings.hccn_conf))
            out.append(optical_finding(chip, calls[(chip.physical_id, "optical")], settings, samples))
            out.extend(samples)
        return out

    def due(self, settings: NpuConfig, chips: tuple[ChipRef, ...], now: float) -> list[tuple[int, str]]:
        """The reads of this run: every read never made, `link` of every chip, then the most overdue reads up to
        npu.hccn_max_calls_per_run."""
        intervals = {
            "link": 0.0,
            "link_stat": settings.link_stat_interval_seconds,
            "net_health": settings.net_health_interval_seconds,
            "ip": settings.address_interval_seconds,
            "gateway": settings.address_interval_seconds,
            "optical": settings.optical_interval_seconds,
        }
        must: list[tuple[int, str]] = []
        overdue: list[tuple[float, tuple[int, str]]] = []
        for chip in chips:
            for verb, interval in intervals.items():
                key = (chip.physical_id, verb)
                last = self._calls.get(key)
                if last is None or verb == "link":
                    must.append(key)
                elif now - last[1] >= interval:
                    overdue.append((now - last[1] - interval, key))
        overdue.sort(key=lambda item: -item[0])
        room = max(0, settings.hccn_max_calls_per_run - len(must))
        return must + [key for _, key in overdue[:room]]

    def _net_health(self, chip: ChipRef, call: Call, samples: list[Sample]) -> Finding:
        if call.output is None:
            return failed(NET_HEALTH, chip, call)
        try:
            return net_health_finding(chip, parse_net_health(call.output), samples)
        except ProbeParseError as exc:
            return parse_error(NET_HEALTH, chip, call, exc)

    def _links(
        self,
        ctx: ProbeContext,
        settings: NpuConfig,
        chips: tuple[ChipRef, ...],
        calls: dict[tuple[int, str], Call],
        fresh: dict[tuple[int, str], Call],
        note: str,
    ) -> ProbeOutput:
        """npu.roce.link of every chip; npu.roce.flaps from this run's link-up counts (the window moves only on a
        fresh read; a chip whose count was not read this run keeps its last verdict)."""
        out: ProbeOutput = []
        for chip in chips:
            samples: list[Sample] = []
            link = link_finding(chip, calls[(chip.physical_id, "link")], samples)
            out.extend([_noted(link, note) if note else link, *samples])
        counts: dict[int, int] = {}
        for chip in chips:
            call = fresh.get((chip.physical_id, "link_stat"))
            if call is None:
                continue
            if call.output is None:
                self._flaps[chip.physical_id] = (failed(FLAPS, chip, call), [])
                continue
            try:
                counts[chip.physical_id] = parse_link_stat(call.output).up_count
            except ProbeParseError as exc:
                self._flaps[chip.physical_id] = (parse_error(FLAPS, chip, call, exc), [])
        now = time.time()
        window = self._link_window(ctx, settings)
        flaps = window.observe(counts, now, settings.link_flap_window_seconds) if counts else {}
        for chip in chips:
            if chip.physical_id in flaps:
                samples = []
                count = counts[chip.physical_id]
                finding = flaps_finding(chip, count, flaps[chip.physical_id], settings, now, samples)
                if window.error:
                    finding = _noted(finding, window.error, key="state_error")
                self._flaps[chip.physical_id] = (finding, samples)
            finding, samples = self._flaps[chip.physical_id]
            out.extend([finding, *samples])
        return out

    def _link_window(self, ctx: ProbeContext, settings: NpuConfig) -> LinkWindow:
        path = Path(settings.state_dir) / STATE_FILE if settings.state_dir else None
        if self._window is None or self._window.path != path:
            self._window = LinkWindow(path)
        return self._window

    @staticmethod
    def _hccn_conf(ctx: ProbeContext, settings: NpuConfig) -> dict[int, ConfiguredAddress] | None:
        try:
            with open(ctx.host.root_path(settings.hccn_conf), encoding="utf-8", errors="replace") as handle:
                return parse_hccn_conf(handle.read(1 << 16))
        except OSError:
            return None

    @staticmethod
    def _missing(ctx: ProbeContext, settings: NpuConfig, davinci: list[int]) -> ProbeOutput:
        search = search_smi(ctx, settings.hccn_command or ["hccn_tool"])
        message = f"{len(davinci)} /dev/davinciN nodes but no hccn_tool: looked at {search.looked}"
        observed: dict[str, Any] = {"device_nodes": len(davinci), "hccn_command": list(settings.hccn_command)}
        hint = HCCN_TOOL_MISSING.hint
        if search.elsewhere:
            observed["found_elsewhere"] = list(search.elsewhere)
            hint = f"point npu.hccn_command at it, e.g. [nsenter, -t, 1, -m, --, {search.elsewhere[-1]}]"
        return [c.report(HCCN_TOOL_MISSING, "", message, observed, hint=hint) for c in ROCE_CHECKS]


def _noted(finding: Finding, note: str, key: str = "chip_map") -> Finding:
    return replace(finding, observed={**finding.observed, key: note})


__all__ = ["ADDRESS", "LINK", "OPTICAL", "PARSE_ERROR", "Path", "RoceProbe"]
