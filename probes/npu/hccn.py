"""Running hccn_tool: found like npu-smi (npu.hccn_command, PATH, the host's bin dirs, the driver's tools dir),
each call through the host-command path (a deadline, an output cap, the process group killed at the deadline),
the chips read in parallel by at most npu.hccn_parallel children at once.

A hung tool costs one deadline per worker, not one per call: after a call times out, the chip's other verbs are
not asked, and once npu.hccn_parallel calls have timed out, nothing more is asked in this run.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from probes.base import ProbeContext
from probes.npu.config import NpuConfig
from probes.npu.smi import binary_found, smi_binary

# Output of one hccn_tool call is a few lines (optics ~50): anything past this is a tool gone wrong.
MAX_OUTPUT_BYTES = 64 * 1024


@dataclass(frozen=True)
class Call:
    """One hccn_tool call's outcome: its output, or why there is none."""

    physical_id: int
    verb: str  # "link", "link_stat", "net_health", "optical", "ip", "gateway"
    output: str | None
    error: str = ""  # why output is None
    kind: str = ""  # timeout, not_installed, exit_status, truncated, skipped

    @property
    def command(self) -> str:
        return f"hccn_tool -i {self.physical_id} -{self.verb} -g"


def hccn_available(ctx: ProbeContext, settings: NpuConfig) -> bool:
    argv = settings.hccn_command
    if not argv or not binary_found(ctx, argv[0], host_namespace=False):
        return False
    binary, elsewhere = smi_binary(argv)
    return not elsewhere or binary_found(ctx, binary, host_namespace=True)


class Runner:
    """The calls of one run, shared by the worker threads."""

    def __init__(self, ctx: ProbeContext, settings: NpuConfig) -> None:
        self.ctx = ctx
        self.settings = settings
        self._lock = threading.Lock()
        self._hung_chips: set[int] = set()
        self._timeouts = 0
        self.spawned = 0

    def run(self, jobs: Sequence[tuple[int, str]]) -> dict[tuple[int, str], Call]:
        """Every (physical id, verb), a chip's verbs in order on one worker; the chips in parallel."""
        by_chip: dict[int, list[str]] = {}
        for physical, verb in jobs:
            by_chip.setdefault(physical, []).append(verb)
        results: dict[tuple[int, str], Call] = {}
        workers = max(1, min(self.settings.hccn_parallel, len(by_chip)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hccn") as pool:
            for calls in pool.map(lambda item: self._chip(*item), by_chip.items()):
                for call in calls:
                    results[(call.physical_id, call.verb)] = call
        return results

    def _chip(self, physical: int, verbs: list[str]) -> list[Call]:
        return [self._call(physical, verb) for verb in verbs]

    def _call(self, physical: int, verb: str) -> Call:
        with self._lock:
            if physical in self._hung_chips:
                return Call(physical, verb, None, "not asked: an earlier call on this chip timed out", "skipped")
            if self._timeouts >= self.settings.hccn_parallel:
                return Call(physical, verb, None, "not asked: hccn_tool timed out on other chips", "skipped")
        remaining = self.ctx.remaining(0) - 0.3
        if remaining < 0.2:
            return Call(physical, verb, None, "not asked: probe deadline near", "skipped")
        timeout = min(self.settings.hccn_timeout_seconds, remaining)
        argv = [*self.settings.hccn_command, "-i", str(physical), f"-{verb}", "-g"]
        with self._lock:
            self.spawned += 1
        result = self.ctx.host.run(argv, timeout=timeout)
        command = f"hccn_tool -i {physical} -{verb} -g"
        if result.timed_out:
            with self._lock:
                self._hung_chips.add(physical)
                self._timeouts += 1
            return Call(physical, verb, None, f"`{command}` did not answer within {timeout:.1f}s", "timeout")
        if result.not_found:
            return Call(physical, verb, None, "no hccn_tool on this host", "not_installed")
        if result.truncated or len(result.stdout) > MAX_OUTPUT_BYTES:
            return Call(physical, verb, None, f"`{command}` printed more than the agent reads", "truncated")
        if result.returncode != 0:
            detail = " | ".join(line.strip() for line in result.output.splitlines() if line.strip())[:200]
            error = f"`{command}` exited with status {result.returncode}: {detail or 'no output'}"
            return Call(physical, verb, None, error, "exit_status")
        return Call(physical, verb, result.stdout)
