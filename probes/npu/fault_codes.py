"""Huawei's fault grading: error code → level, from MindCluster's faultCode.json when the node has it, else a
small built-in table of common codes, each entry from the public source named beside it.

faultCode.json (the device plugin's `component/ascend-device-plugin/build/faultCode.json`, also its ConfigMap
`mindx-dl-fault-config`) is an object of lists of hex codes: NotHandleFaultCodes, RestartRequestCodes,
RestartBusinessCodes, FreeRestartNPUCodes, RestartNPUCodes, SeparateNPUCodes, PreSeparateNPUCodes,
SubHealthFaultCodes. A code in no list is NotHandleFault (as the device plugin treats it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

LEVELS = (
    "SeparateNPU",
    "PreSeparateNPU",
    "RestartNPU",
    "FreeRestartNPU",
    "RestartBusiness",
    "RestartRequest",
    "SubHealthFault",
    "NotHandleFault",
)  # worst first
SEPARATE = frozenset({"SeparateNPU", "PreSeparateNPU"})
RESET = frozenset({"RestartNPU", "FreeRestartNPU", "RestartBusiness", "RestartRequest"})
MAX_FILE_BYTES = 1 << 20

_DOC = "mind-cluster @22bb3d98 component/ascend-device-plugin/build/faultCode.json"
# code → (level, source): a few common codes, as the public fault lists grade them.
BUILTIN: Mapping[str, tuple[str, str]] = {
    "80E18402": ("SeparateNPU", _DOC + " (SeparateNPUCodes)"),
    "80E3A201": ("SeparateNPU", _DOC + " (SeparateNPUCodes)"),
    "8118043C": ("PreSeparateNPU", _DOC + " (PreSeparateNPUCodes)"),
    "8118045A": ("PreSeparateNPU", _DOC + " (PreSeparateNPUCodes)"),
    "8C03A000": ("RestartNPU", _DOC + " (RestartNPUCodes)"),
    "8C1FA006": ("RestartNPU", _DOC + " (RestartNPUCodes)"),
    "8C0E4E00": ("FreeRestartNPU", _DOC + " (FreeRestartNPUCodes)"),
    "8C204E00": ("RestartBusiness", _DOC + " (RestartBusinessCodes)"),
    "80C98008": ("RestartRequest", _DOC + " (RestartRequestCodes)"),
    "80CB8009": ("RestartRequest", _DOC + " (RestartRequestCodes)"),
    "81A3880C": ("SubHealthFault", _DOC + " (SubHealthFaultCodes)"),
    "80E21007": ("NotHandleFault", _DOC + " (NotHandleFaultCodes)"),
    "81078603": ("NotHandleFault", _DOC + " (NotHandleFaultCodes: the parameter-plane link code)"),
}


@dataclass(frozen=True)
class Grade:
    code: str
    level: str
    source: str  # the file, or the built-in entry's public source


class FaultCodeError(ValueError):
    """A faultCode.json that is not the device plugin's format (the message names the file)."""


@dataclass(frozen=True)
class FaultTable:
    levels: Mapping[str, str]  # code (upper-case hex) → level
    source: str  # the file's path, or "built-in"

    def grade(self, code: str) -> Grade:
        key = code.upper()
        if self.source == "built-in":
            level, source = BUILTIN.get(key, ("NotHandleFault", "not in the built-in table: NotHandleFault"))
            return Grade(key, level, source)
        found = self.levels.get(key)
        if found is None:
            return Grade(key, "NotHandleFault", f"not in {self.source}: NotHandleFault")
        return Grade(key, found, self.source)


def load_table(paths: Sequence[str]) -> FaultTable:
    """The first faultCode.json of `paths` that exists, else the built-in table; FaultCodeError when the one
    found is unreadable or malformed."""
    for path in paths:
        if not os.path.exists(path):
            continue
        try:
            with open(path, "rb") as handle:
                raw = handle.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise FaultCodeError(f"{path}: {exc.strerror or exc}") from exc
        if len(raw) > MAX_FILE_BYTES:
            raise FaultCodeError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
        return FaultTable(parse_fault_codes(raw, path), path)
    return FaultTable({}, "built-in")


def parse_fault_codes(raw: bytes, path: str) -> dict[str, str]:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FaultCodeError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise FaultCodeError(f"{path}: not a JSON object of code lists")
    levels: dict[str, str] = {}
    known = 0
    for level in reversed(LEVELS):  # the worst level wins for a code listed twice
        codes = data.get(level + "Codes")
        if codes is None:
            continue
        if not isinstance(codes, list) or not all(isinstance(c, str) for c in codes):
            raise FaultCodeError(f"{path}: {level}Codes is not a list of hex strings")
        known += 1
        levels.update({c.strip().upper(): level for c in codes})
    if not known:
        raise FaultCodeError(f"{path}: none of the lists {', '.join(level + 'Codes' for level in LEVELS)}")
    return levels


def worst(grades: Sequence[Grade]) -> Grade | None:
    return min(grades, key=lambda g: LEVELS.index(g.level)) if grades else None
