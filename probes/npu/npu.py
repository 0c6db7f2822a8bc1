"""npu.smi, npu.health, npu.hbm, npu.holders: Ascend NPUs as npu-smi and /proc see them.

- npu.smi: npu-smi answers (or why not: -8005 init failure, -8020 device held elsewhere, permission,
  timeout, a table cut short). A missing npu-smi is NpuToolMissing (unknown) on a node with /dev/davinciN
  nodes, where npu.holders still runs; on a node without them the whole probe skips.
- npu.health: per chip, the health word (Warning → warn, Alarm / Critical → fail; configurable) with the
  error codes of `-t health`; chips expected (a /dev/davinciN node, or npu.expected_chips) but not listed.
- npu.hbm: per chip, free device memory below npu.min_hbm_free_mib; memory in use with no process.
- npu.holders: processes holding the NPU device nodes (matched by device number, so a container's own
  /dev/davinci0 counts) merged with npu-smi's process list, classified by cgroup: outside a pod → fail,
  two pods on one chip → fail, a pod on a chip the device plugin's ledger gave to no pod or another → fail.
- npu.ledger: the device plugin's ledger (the kubelet's PodResources API, read in a child while the rest runs,
  unknown for the run when the kubelet has not answered by its end): who each chip is allocated to, and the chips
  the plugin no longer offers (probes/npu/ledger_findings.py).

Detail queries (`-m`, `-t health`, `-t proc-mem`) are not supported everywhere: when one fails, what the
main table said stands, and the failure is noted in the finding's observed data. Every run publishes the
chips' PCI Bus-Ids to the host's device inventory, so the pcie probe can name the chip behind an AER error.
"""

from __future__ import annotations

import os
import re
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
    Reason,
    Sample,
    Status,
    register,
)
from probes.npu.completeness import parse_card_list, read_table, shortfall
from probes.npu.config import NpuConfig
from probes.npu.details import ChipMapping, HealthDetail, parse_health, parse_mapping, parse_proc_mem, resolve_ids
from probes.npu.findings import chip_subject, hbm_findings, health_findings, with_identity
from probes.npu.holder_findings import holder_findings, numbers_held_by_fd, where_looked
from probes.npu.info_table import NpuChip, NpuInfo
from probes.npu.ledger_findings import FirstSeen, ledger_findings, ledger_note, ledger_verdicts, npu_ledger
from probes.npu.metrics import chip_samples
from probes.npu.reasons import (
    HBM,
    HEALTH,
    NPU_SMI_FAILED,
    NPU_TABLE_TRUNCATED,
    NPU_TOOL_MISSING,
    REASONS,
    SMI,
    configured_health_reasons,
)
from probes.npu.smi import binary_found, run_smi, search_smi, smi_binary
from probes.runtime.holders import DeviceScan, HolderScan, PodNames, device_holders, device_nodes, scan_devices
from probes.runtime.podresources.client import ledger_source

_DAVINCI = re.compile(r"^davinci(\d+)$")
ChipKey = tuple[int, int]


def davinci_numbers(dev_dir: Path) -> list[int]:
    """N of every /dev/davinciN character device in dev_dir."""
    numbers: list[int] = []
    try:
        names = os.listdir(dev_dir)
    except OSError:
        return numbers
    for name in names:
        match = _DAVINCI.match(name)
        if not match:
            continue
        try:
            if os.stat(dev_dir / name).st_mode & 0o170000 == 0o020000:
                numbers.append(int(match.group(1)))
        except OSError:
            continue
    return sorted(numbers)


def holder_scan_seconds(settings: NpuConfig, remaining: float, host_fds: int | None) -> float:
    """The holder scan's deadline: npu.holder_scan_timeout_seconds plus npu.holder_scan_seconds_per_1000_fds for
    every 1,000 fds open on the host (the scan reads them all, and so does each scan of another probe it may wait
    behind), at most 40% of what is left of the run so that npu-smi keeps its time. Before the first scan the
    count is not known: the 40%."""
    share = remaining * 0.4
    if host_fds is None:
        return max(0.1, share)
    allowance = settings.holder_scan_seconds_per_1000_fds * host_fds / 1000
    return max(0.1, min(settings.holder_scan_timeout_seconds + allowance, share))


def host_fds_seen(scan: DeviceScan | None) -> int | None:
    """The fds open on the host as a scan saw them, extrapolated over the processes it did not reach."""
    result = scan.result if scan is not None else None
    if result is None or result.processes <= 0:
        return None
    missed = result.unscanned + len(result.unreadable)
    return round(result.fds * (result.processes + missed) / result.processes)


@register
class NpuProbe(Probe):
    name = "npu"
    checks = ("npu.smi", "npu.health", "npu.hbm", "npu.holders", "npu.ledger")
    reasons = REASONS
    default_interval = 30.0
    # The holder scan takes up to 40% of it, and grows with the fds on the host (holder_scan_seconds).
    default_timeout = 20.0
    needs = "npu-smi (npu.smi_command); /dev/davinci*; /proc of the host (hostPID) for npu.holders"

    def __init__(self) -> None:
        # `-m` changes only when chips come or go: keep it while the table lists the same chips.
        self._mapping_cache: tuple[tuple[tuple[int, int, str | None], ...], tuple[ChipMapping, ...]] | None = None
        self._pod_names: PodNames | None = None
        self._host_fds: int | None = None  # as the last holder scan saw them
        self._first_seen = FirstSeen()  # pods with Ascend devices, when the ledger first showed them

    def allowed_reasons(self, ctx: ProbeContext) -> dict[str, Reason]:
        allowed = dict(super().allowed_reasons(ctx))
        for reason in configured_health_reasons(ctx.settings(NpuConfig).health_status):
            allowed.setdefault(reason.code, reason)
        return allowed

    def applicable(self, ctx: ProbeContext) -> str | None:
        argv = ctx.settings(NpuConfig).smi_command
        if not argv:
            return "npu.smi_command is empty"
        launcher = binary_found(ctx, argv[0], host_namespace=False)
        if launcher:
            binary, elsewhere = smi_binary(argv)
            if not elsewhere or binary_found(ctx, binary, host_namespace=True):
                return None
        # A davinci node says "NPU host": without npu-smi the chips cannot be read (NpuToolMissing), and
        # npu.holders still runs. (Through nsenter, npu-smi may also live anywhere on the host's PATH.)
        if davinci_numbers(ctx.host.dev):
            return None
        if launcher or Path(argv[0]).name == "npu-smi":
            return "no npu-smi on this host"
        return f"no {argv[0]} on this host"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(NpuConfig)
        davinci = davinci_numbers(ctx.host.dev)
        # The ledger read runs in a child meanwhile, taken when the run's own checks are done (a kubelet that has
        # not answered by then leaves it unknown, never the run late); the fd scan first: it is quick, and a hung
        # npu-smi must not starve it of its deadline.
        pending = ledger_source(ctx.kubelet.socket).start(ctx.kubelet.timeout)
        scan = self._scan(ctx, settings)
        info, table_findings = self._table(ctx, settings, davinci)
        out: ProbeOutput = list(required_when_unreadable(table_findings, bool(davinci), settings))
        chips: tuple[NpuChip, ...] = ()
        proc_mem_errors: dict[ChipKey, str] = {}
        if info is not None:
            chips, judged = self._judge_table(ctx, settings, info, davinci, proc_mem_errors)
            out.extend(judged)
        holders = self._holders(ctx, scan, chips)
        view = npu_ledger(pending.collect(ctx.deadline - 0.5), ctx.kubelet.pods, self._first_seen)
        numbers = sorted({c.device_number for c in chips if c.device_number is not None} | set(davinci))
        if chips:
            held = numbers_held_by_fd(holders)
            notes = {n: ledger_note(view, n) for n in numbers}
            out.extend(
                hbm_findings(chips, settings.min_hbm_free_mib, settings.hbm_leak_min_mib, held, proc_mem_errors, notes)
            )
        where = where_looked(ctx.host.dev, settings.holder_devices)
        verdicts = ledger_verdicts(view, holders, numbers, settings.holder_ignore_commands)
        found, out_of_band, shared_out_of_band = holder_findings(
            chips, davinci, holders, settings.holder_ignore_commands, ctx.redact_cmdlines, where, verdicts
        )
        out.extend(found)
        own = [item for item in out if isinstance(item, Finding)]
        out.extend(ledger_findings(view, chips, davinci, own, settings.device_plugin_unhealthy_status))
        allocated = {n: view.allocations(n) for n in numbers} if view.read.ok else None
        out.extend(chip_samples(chips, out_of_band, allocated))
        if holders is not None:
            out.append(
                Sample(
                    "nodehealth_npu_shared_out_of_band_holders",
                    "Processes outside pods holding only shared NPU nodes (davinci_manager, devmm_svm, hisi_hdc).",
                    shared_out_of_band,
                )
            )
        return with_identity(out, chips)

    # --- steps ---

    def _judge_table(
        self,
        ctx: ProbeContext,
        settings: NpuConfig,
        info: NpuInfo,
        davinci: list[int],
        proc_mem_errors: dict[ChipKey, str],
    ) -> tuple[tuple[NpuChip, ...], list[Finding]]:
        """The chips of a whole table and their npu.smi and npu.health findings; no chips for a table cut short."""
        chips, smi_finding = self._chips(ctx, settings, info, proc_mem_errors)
        cut = self._cut_short(ctx, settings, info, chips, davinci)
        if cut:
            return (), cut
        details = self._health_details(ctx, settings, info, chips)
        health = health_findings(chips, details, settings.health_status, davinci, settings.expected_chips)
        findings = [smi_finding, *health]
        ctx.host.devices.publish(
            "npu",
            [(c.logical_id, chip_subject(c), c.bus_id) for c in chips if c.bus_id and c.logical_id is not None],
        )
        return chips, findings

    def _table(
        self, ctx: ProbeContext, settings: NpuConfig, davinci: list[int]
    ) -> tuple[NpuInfo | None, list[Finding]]:
        """`npu-smi info` parsed, or the findings that say why there is no table."""
        text, failure = run_smi(ctx, settings, ["info"])
        if failure is not None and failure.kind == "not_installed":
            if davinci:
                return None, _tool_missing(ctx, settings, davinci)
            checks = (SMI, HEALTH, HBM)
            return None, [check.report(NOT_APPLICABLE, "", "no npu-smi on this host") for check in checks]
        if failure is not None:
            observed: dict[str, Any] = {"failure": failure.kind, "output": failure.detail}
            if failure.ret is not None:
                observed["ret"] = failure.ret
            return None, _no_table(NPU_SMI_FAILED, Status.FAIL, failure.message, failure.hint, observed)
        try:
            info, cut = read_table(text or "")
        except ProbeParseError as exc:
            message = f"npu-smi info not understood: {exc}"
            hint = "the table layout is new to the agent: report the `npu-smi info` output"
            return None, _no_table(PARSE_ERROR, Status.UNKNOWN, message, hint, {"output": (text or "")[:300]})
        if info is None:
            return None, _truncated(f"{cut}, before its process section", {"output": (text or "")[-300:]})
        return info, []

    def _cut_short(
        self, ctx: ProbeContext, settings: NpuConfig, info: NpuInfo, chips: tuple[NpuChip, ...], davinci: list[int]
    ) -> list[Finding]:
        """When chips are expected that the table does not list: the findings of a table cut short (npu-smi
        info -l counts more), or [] when the table is whole and the chips are missing."""
        listed = {chip.device_number for chip in chips}
        unlisted = [n for n in davinci if n not in listed]
        expected = settings.expected_chips
        if not unlisted and (expected is None or len(chips) >= expected):
            return []
        counted, error = None, ""
        text, failure = run_smi(ctx, settings, ["info", "-l"], reserve=0.5)
        if failure is not None:
            error = failure.message
        else:
            try:
                counted = parse_card_list(text or "")
            except ProbeParseError as exc:
                error = f"npu-smi info -l not understood: {exc}"
        why = shortfall(info, counted, error)
        if not why:
            return []
        observed: dict[str, Any] = {"chips_listed": len(chips), "davinci_nodes": len(davinci)}
        if unlisted:
            observed["not_listed"] = [f"davinci{n}" for n in unlisted]
        not_judged = f"; /dev/davinci{', /dev/davinci'.join(map(str, unlisted))} not judged" if unlisted else ""
        return _truncated(why + not_judged, observed)

    def _chips(
        self, ctx: ProbeContext, settings: NpuConfig, info: NpuInfo, proc_mem_errors: dict[ChipKey, str]
    ) -> tuple[tuple[NpuChip, ...], Finding]:
        smi_observed: dict[str, Any] = {"version": info.version, "chips": len(info.chips)}
        chips, mapping_error = self._resolve(ctx, settings, info)
        if mapping_error:
            smi_observed["mapping_error"] = mapping_error
        chips = self._complete_processes(ctx, settings, info, chips, proc_mem_errors)
        cards = len({c.card_id for c in chips})
        message = f"npu-smi {info.version or ''}: {len(chips)} chips on {cards} cards".replace("  ", " ")
        if info.processes_cut:  # the chips are whole; only the process rows the cut took are unknown
            smi_observed["processes_cut"] = info.processes_cut
            message += f"; {info.processes_cut} (no HBM leak judged there)"
        return chips, SMI.ok("", message, smi_observed)

    def _resolve(self, ctx: ProbeContext, settings: NpuConfig, info: NpuInfo) -> tuple[tuple[NpuChip, ...], str]:
        if all(c.logical_id is not None for c in info.chips):
            return info.chips, ""
        key = tuple((c.card_id, c.chip_index, c.bus_id) for c in info.chips)
        if self._mapping_cache is not None and self._mapping_cache[0] == key:
            return resolve_ids(info.chips, self._mapping_cache[1]), ""
        text, failure = run_smi(ctx, settings, ["info", "-m"], reserve=0.5)
        if failure is not None:
            return resolve_ids(info.chips, None), f"npu-smi info -m: {failure.message}"
        try:
            mapping = parse_mapping(text or "")
        except ProbeParseError as exc:
            return resolve_ids(info.chips, None), f"npu-smi info -m not understood: {exc}"
        self._mapping_cache = (key, mapping)
        return resolve_ids(info.chips, mapping), ""

    @staticmethod
    def _detail_args(info: NpuInfo, chip: NpuChip, kind: str) -> list[str]:
        args = ["info", "-t", kind, "-i", str(chip.card_id)]
        if info.has_chip_column:
            args += ["-c", str(chip.chip_index)]
        return args

    def _complete_processes(
        self,
        ctx: ProbeContext,
        settings: NpuConfig,
        info: NpuInfo,
        chips: tuple[NpuChip, ...],
        errors: dict[ChipKey, str],
    ) -> tuple[NpuChip, ...]:
        """Chips showing the table's 8-process limit: take the full list from `-t proc-mem`."""
        out = list(chips)
        for i, chip in enumerate(chips):
            if not chip.processes_truncated:
                continue
            text, error = self._detail(ctx, settings, info, chip, "proc-mem")
            if error:
                errors[(chip.card_id, chip.chip_index)] = error
                continue
            try:
                processes = parse_proc_mem(text or "")
            except ProbeParseError as exc:
                errors[(chip.card_id, chip.chip_index)] = f"npu-smi info -t proc-mem not understood: {exc}"
                continue
            if len(processes) >= len(chip.processes or ()):
                out[i] = replace(chip, processes=processes)
        return tuple(out)

    def _health_details(
        self, ctx: ProbeContext, settings: NpuConfig, info: NpuInfo, chips: tuple[NpuChip, ...]
    ) -> dict[ChipKey, HealthDetail | str]:
        """Error codes of every chip whose health is not ok."""
        ok_words = {w.lower() for w, s in settings.health_status.items() if s == "ok"}
        details: dict[ChipKey, HealthDetail | str] = {}
        for chip in chips:
            if chip.health.lower() in ok_words:
                continue
            key = (chip.card_id, chip.chip_index)
            text, error = self._detail(ctx, settings, info, chip, "health")
            if error:
                details[key] = error
                continue
            try:
                details[key] = parse_health(text or "")
            except ProbeParseError as exc:
                details[key] = f"npu-smi info -t health not understood: {exc}"
        return details

    def _detail(
        self, ctx: ProbeContext, settings: NpuConfig, info: NpuInfo, chip: NpuChip, kind: str
    ) -> tuple[str | None, str]:
        """(output, "") of `npu-smi info -t KIND` for one chip, or (None, why it is missing)."""
        if ctx.remaining(0) < 1.0:
            return None, f"{kind} not asked: probe deadline near"
        text, failure = run_smi(ctx, settings, self._detail_args(info, chip, kind), reserve=0.5)
        if failure is not None:
            return None, f"npu-smi info -t {kind}: {failure.message}"
        return text, ""

    def scan_deadline(self, settings: NpuConfig, remaining: float) -> float:
        """The deadline the next holder scan gets when `remaining` seconds of the run are left."""
        return holder_scan_seconds(settings, remaining, self._host_fds)

    def _scan(self, ctx: ProbeContext, settings: NpuConfig) -> DeviceScan | None:
        nodes = device_nodes(ctx.host.dev, settings.holder_devices)
        if not nodes:
            return None
        scan = scan_devices(ctx.host, nodes, self.scan_deadline(settings, ctx.remaining()))
        self._host_fds = host_fds_seen(scan) or self._host_fds
        return scan

    def _holders(self, ctx: ProbeContext, scan: DeviceScan | None, chips: tuple[NpuChip, ...]) -> HolderScan | None:
        listed: dict[int, set[str]] = {}
        for chip in chips:
            for process in chip.processes or ():
                listed.setdefault(process.pid, set()).add(f"davinci{chip.device_number}")
        if scan is None and not listed:
            return None  # no NPU device nodes and no processes: nothing to say
        if self._pod_names is None or self._pod_names.root != ctx.host.root:
            self._pod_names = PodNames(ctx.host.root)
        return device_holders(
            ctx.host,
            scan,
            listed=listed,
            listed_source="npu-smi",
            pod_names=self._pod_names,
            exclude=(os.getpid(),),
            read_commands=not ctx.redact_cmdlines,
        )


def _tool_missing(ctx: ProbeContext, settings: NpuConfig, davinci: list[int]) -> list[Finding]:
    """NPU device nodes but no npu-smi to read the chips: their health cannot be known (not a failed chip)."""
    search = search_smi(ctx, settings.smi_command)
    nodes = f"{len(davinci)} /dev/davinciN nodes (davinci{davinci[0]}…davinci{davinci[-1]})"
    message = f"{nodes} but no npu-smi: looked at {search.looked}"
    observed: dict[str, Any] = {"device_nodes": len(davinci), "smi_command": list(settings.smi_command)}
    hint = NPU_TOOL_MISSING.hint
    if search.elsewhere:
        observed["found_elsewhere"] = list(search.elsewhere)
        message += f"; a copy is at {', '.join(search.elsewhere)}, which npu.smi_command does not run"
        hint = (
            f"point npu.smi_command at it, e.g. [nsenter, -t, 1, -m, --, {search.elsewhere[-1]}] (the host's "
            "npu-smi needs the host's driver libraries)"
        )
    return [check.report(NPU_TOOL_MISSING, "", message, observed, hint=hint) for check in (SMI, HEALTH, HBM)]


def required_when_unreadable(findings: list[Finding], chips_present: bool, settings: NpuConfig) -> list[Finding]:
    """Never ready on a guess: on a node with /dev/davinciN nodes, chips whose health cannot be read (no npu-smi,
    a table not understood or cut short) block readiness whatever health.required_checks says, unless the operator
    opted out (npu.unreadable_blocks_ready: false)."""
    if not chips_present or not settings.unreadable_blocks_ready:
        return findings
    return [replace(f, required=True) if f.status == Status.UNKNOWN else f for f in findings]


def _truncated(why: str, observed: dict[str, Any]) -> list[Finding]:
    """A table cut short: no chip is judged from it (the chips it left out are not missing, only unseen)."""
    message = f"npu-smi info ended early: {why}"
    return _no_table(NPU_TABLE_TRUNCATED, Status.UNKNOWN, message, NPU_TABLE_TRUNCATED.hint, observed)


def _no_table(reason: Reason, status: Status, message: str, hint: str, observed: dict[str, Any]) -> list[Finding]:
    """npu.smi failed: it says why; npu.health and npu.hbm have no chip data (unknown, node-wide)."""
    out = [SMI.report(reason, "", message, observed, hint=hint, status=status)]
    out.extend(
        check.report(reason, "", f"no chip data: {message}", observed, hint=hint, status=Status.UNKNOWN)
        for check in (HEALTH, HBM)
    )
    return out
