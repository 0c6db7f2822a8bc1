"""Running npu-smi: where it is, one call with a deadline, and what a failed call means.

Failures are classified from the finished command alone (`classify_failure`, a pure function): DCMI return
codes (`ret is -8020`: the device is held by another container or process; `-8005`: DCMI initialisation
failed), permission, timeout, unsupported queries and usage errors.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from probes.base import ProbeContext
    from probes.npu.config import NpuConfig
    from probes.runtime.commands import CommandResult

# Where npu-smi lives on Ascend hosts, for a command run in the host's mount namespace (nsenter ... --).
HOST_BIN_DIRS = ("/usr/local/bin", "/usr/local/sbin", "/usr/bin", "/usr/sbin", "/bin", "/sbin")
# Where the Ascend driver's run package installs it (the links in /usr/local/sbin may be missing).
DRIVER_TOOL_DIRS = ("/usr/local/Ascend/driver/tools",)

# --- failures --------------------------------------------------------------------------------------

# DCMI return codes, as the Ascend DCMI API documents them.
DCMI_RETURN_CODES: Mapping[int, str] = {
    -8001: "invalid parameter",
    -8002: "operation not permitted",
    -8005: "internal error",
    -8006: "timeout",
    -8007: "invalid device id",
    -8008: "device does not exist",
    -8012: "device not ready",
    -8013: "not supported in a container",
    -8017: "device is being upgraded",
    -8020: "device occupied by another container or process",
    -8255: "not supported",
}
_RET_CODE = re.compile(r"\bret(?:urn)?(?:\s+code)?\s*(?:is|=|:)?\s*(-\d{3,5})\b", re.IGNORECASE)

_HOLDER_HINT = (
    "find the holder (npu.holders lists processes holding /dev/davinci*; or `lsof /dev/davinci*` on the host "
    "and in containers) and stop it, or run it through Kubernetes so the device plugin accounts for the NPU"
)


@dataclass(frozen=True)
class SmiFailure:
    """Why an npu-smi call gave no usable output."""

    kind: str  # not_installed, timeout, permission_denied, device_busy, dcmi_init_failed, dcmi_error,
    #            invalid_argument, unsupported, truncated, exit_status
    message: str
    hint: str
    ret: int | None = None
    detail: str = ""  # the first lines of the output, for observed


def _first_lines(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines)[:limit]


def classify_failure(result: CommandResult, timeout: float | None = None, command: str = "") -> SmiFailure | None:
    """A finished npu-smi run → the failure it shows, or None when the output is worth parsing.

    `command` names the call in messages (default: the whole argv, nsenter prefix and all)."""
    detail = _first_lines(result.output)
    command = command or " ".join(result.argv)
    if result.timed_out:
        limit = f" within {timeout:g}s" if timeout else ""
        return SmiFailure(
            "timeout",
            f"`{command}` did not answer{limit}",
            "the NPU driver is not answering: check `dmesg` for davinci/drv errors and for hung tasks; "
            "if it persists, reset the chip or reboot the node",
            detail=detail,
        )
    if result.not_found:
        return SmiFailure("not_installed", "no npu-smi on this host", "install the Ascend driver", detail=detail)
    if getattr(result, "truncated", False):
        return SmiFailure(
            "truncated",
            f"`{command}` printed more than the agent reads; its output was cut off",
            "run the command by hand on the host: a driver printing endless errors needs `dmesg` and a reboot",
            detail=detail,
        )
    match = _RET_CODE.search(result.output)
    ret = int(match.group(1)) if match else None
    return _dcmi_failure(result, ret, detail) or _other_failure(result, ret, detail, command)


def _dcmi_failure(result: CommandResult, ret: int | None, detail: str) -> SmiFailure | None:
    lowered = result.output.lower()
    if result.permission_denied or "permission denied" in lowered or ret == -8002:
        return SmiFailure(
            "permission_denied",
            f"npu-smi was refused access to the NPU driver ({detail or 'permission denied'})",
            "DCMI answers only root on some hosts: run the agent as root (privileged, or nsenter into the host) "
            "and give it /dev/davinci_manager, /dev/devmm_svm and /dev/hisi_hdc",
            ret,
            detail,
        )
    if ret == -8020 or "device is used" in lowered:
        return SmiFailure(
            "device_busy",
            "npu-smi cannot open the NPU: the device is held by another container or process (ret -8020)",
            _HOLDER_HINT,
            ret if ret is not None else -8020,
            detail,
        )
    if ret == -8005 or "dcmi module initialize failed" in lowered or "dcmi model initialized failed" in lowered:
        return SmiFailure(
            "dcmi_init_failed",
            f"npu-smi failed: dcmi module initialize failed (ret {ret if ret is not None else 'unknown'}); "
            "the NPU is often held by another container, or the driver is not answering",
            _HOLDER_HINT + "; if nothing holds it, check `dmesg` for driver errors and reload the driver or reboot",
            ret,
            detail,
        )
    if ret is not None and ret <= -8000:
        return SmiFailure(
            "dcmi_error",
            f"npu-smi failed with DCMI error {ret} ({DCMI_RETURN_CODES.get(ret, 'DCMI error')})",
            "check `dmesg` for NPU driver errors and the driver/firmware versions (npu-smi info -t board)",
            ret,
            detail,
        )
    return None


def _other_failure(result: CommandResult, ret: int | None, detail: str, command: str) -> SmiFailure | None:
    lowered = result.output.lower()
    if "invalid card id" in lowered or "error parameter" in lowered:
        return SmiFailure(
            "invalid_argument",
            f"npu-smi rejected `{command}`: {detail}",
            "the card or chip id is not on this host",
            ret,
            detail,
        )
    if "not support" in lowered:
        return SmiFailure("unsupported", f"`{command}` is not supported here: {detail}", "", ret, detail)
    if result.returncode not in (0, None):
        return SmiFailure(
            "exit_status",
            f"`{command}` exited with status {result.returncode}: {detail or 'no output'}",
            "run the command by hand on the host; check `dmesg` for NPU driver errors",
            ret,
            detail,
        )
    return None


# --- running it ------------------------------------------------------------------------------------


def smi_binary(argv: Sequence[str]) -> tuple[str, bool]:
    """(the npu-smi binary, whether it runs in another mount namespace): `nsenter ... -- npu-smi` → npu-smi."""
    if "--" in argv[:-1] and Path(argv[0]).name == "nsenter":
        return argv[list(argv).index("--") + 1], True
    return argv[0], False


def binary_found(ctx: ProbeContext, binary: str, host_namespace: bool) -> bool:
    """Whether `binary` can be run here, or (host_namespace) in the host's mount namespace."""
    if not host_namespace:
        if "/" in binary:
            # Present but not executable is a failure to report (permission), not an absent tool.
            return os.path.exists(binary)
        return ctx.host.which(binary) is not None
    if "/" in binary:
        return os.access(ctx.host.root_path(binary), os.X_OK)
    return any(os.access(ctx.host.root_path(f"{d}/{binary}"), os.X_OK) for d in HOST_BIN_DIRS) or (
        str(ctx.host.root) == "/" and shutil.which(binary) is not None
    )


@dataclass(frozen=True)
class SmiSearch:
    """Where npu-smi was looked for when the configured command could not run it, and any copy found there
    that the command does not reach (for the hint)."""

    looked: str
    elsewhere: tuple[str, ...]


def search_smi(ctx: ProbeContext, argv: Sequence[str]) -> SmiSearch:
    """npu-smi on the agent's PATH, in the host's bin directories and the driver's tool directory under
    host.root: where it was looked for, and the host paths where a copy is."""
    binary, _ = smi_binary(argv)
    name = Path(binary).name or "npu-smi"
    found = [binary] if "/" not in binary and ctx.host.which(binary) else []
    host_dirs = (*HOST_BIN_DIRS, *DRIVER_TOOL_DIRS)
    found += [f"{d}/{name}" for d in host_dirs if os.access(ctx.host.root_path(f"{d}/{name}"), os.X_OK)]
    where = "" if str(ctx.host.root) == "/" else f" under host.root {ctx.host.root}"
    looked = f"`{' '.join(argv)}`, the agent's PATH and {', '.join(host_dirs)}{where}"
    return SmiSearch(looked, tuple(dict.fromkeys(found)))


def run_smi(
    ctx: ProbeContext, settings: NpuConfig, args: Sequence[str], reserve: float = 0.0
) -> tuple[str | None, SmiFailure | None]:
    """Run `npu-smi ARGS` bounded by npu.smi_timeout_seconds and the probe's deadline (less `reserve`)."""
    timeout = max(0.1, min(settings.smi_timeout_seconds, ctx.remaining() - reserve))
    result = ctx.host.run([*settings.smi_command, *args], timeout=timeout)
    failure = classify_failure(result, timeout, command=" ".join(["npu-smi", *args]))
    if failure is not None:
        return None, failure
    return result.stdout, None
