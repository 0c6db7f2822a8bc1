"""Pure parsers of nvidia-smi output, the GPU probe's fallback when NVML cannot be loaded.

- `parse_query`: `nvidia-smi -q` → GpuState per GPU block (the whole `-q` layout family: pre-Ampere
  `Single Bit / Double Bit` ECC tables and Ampere+ `SRAM / DRAM` counters, `Clocks Throttle Reasons` and
  the newer `Clocks Event Reasons`, `Power Readings` and `GPU Power Readings`).
- `parse_csv`: `--query-gpu=... --format=csv[,noheader]` (`, ` separated, `[N/A]` for unsupported).
- `parse_list`: `nvidia-smi -L`, including `Unable to determine the device handle for gpu ...` lines and the
  MIG devices listed under a GPU in MIG mode.
- `parse_table`: the default `nvidia-smi` table, and the `WARNING: ...` lines printed after it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from probes.base import ProbeParseError
from probes.gpu.model import CLOCK_EVENT_BITS, MIB, EnumerationFailure, GpuProcess, GpuState


class SmiParseError(ProbeParseError):
    """nvidia-smi output this module cannot make sense of."""


# --- the -q tree -----------------------------------------------------------------------------------


@dataclass
class QNode:
    """One line of `nvidia-smi -q`: `key : value`, or a section header (`value` None) with children."""

    key: str
    value: str | None = None
    children: list[QNode] = field(default_factory=list)

    def child(self, *names: str) -> QNode | None:
        """The first child whose key equals one of `names`, case-insensitively."""
        wanted = {name.lower() for name in names}
        for node in self.children:
            if node.key.lower() in wanted:
                return node
        return None

    def value_of(self, *names: str) -> str | None:
        node = self.child(*names)
        return None if node is None else node.value


# `Key    : value` (the key is padded; bus ids in values hold colons, so split at the first ` : ` or ` :`).
_KEY_VALUE = re.compile(r"^(?P<key>\S.*?)\s+:(?: (?P<value>.*))?$")
_GPU_HEADER = re.compile(r"^GPU (?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])$")
# Lines nvidia-smi prints about a GPU it cannot use, in any mode.
_UNABLE = re.compile(r"^Unable to determine the device handle for gpu (?P<bus>[0-9A-Fa-f:.]+): (?P<error>.+)$")
_WARNING = re.compile(r"^WARNING: (?P<text>.+)$")
_INFOROM_WARNING = re.compile(r"infoROM is corrupted at gpu (?P<bus>[0-9A-Fa-f:.]+)", re.IGNORECASE)


def parse_tree(text: str) -> QNode:
    """`nvidia-smi -q` text → a tree by indentation (relative, so excerpts starting indented parse too)."""
    root = QNode("")
    stack: list[tuple[int, QNode]] = [(-1, root)]
    for raw in text.splitlines():
        line = raw.rstrip()
        stripped = line.lstrip(" ")
        if not stripped or stripped.startswith("===") or _UNABLE.match(stripped) or _WARNING.match(stripped):
            continue
        indent = len(line) - len(stripped)
        match = _KEY_VALUE.match(stripped)
        node = QNode(match["key"], (match["value"] or "").strip()) if match else QNode(stripped)
        while stack[-1][0] >= indent:
            stack.pop()
        stack[-1][1].children.append(node)
        stack.append((indent, node))
    return root


@dataclass
class SmiQuery:
    driver_version: str
    attached_gpus: int | None
    gpus: list[GpuState]
    failures: list[EnumerationFailure]
    warnings: list[str]


def parse_query(text: str) -> SmiQuery:
    """`nvidia-smi -q` → one GpuState per `GPU <bus id>` block, in output order (which is index order)."""
    tree = parse_tree(text)
    attached_text = tree.value_of("Attached GPUs")
    attached = _int(attached_text, "Attached GPUs") if attached_text is not None else None
    blocks = [node for node in tree.children if _GPU_HEADER.match(node.key)]
    failures, warnings = parse_messages(text)
    if not blocks and attached != 0 and not failures:
        raise SmiParseError("no `GPU <bus id>` block in nvidia-smi -q output")
    gpus = []
    for index, block in enumerate(blocks):
        header = _GPU_HEADER.match(block.key)
        assert header is not None
        gpu = gpu_from_sections(block, index)
        gpu.bus_id = gpu.bus_id or header["bus"]
        gpus.append(gpu)
    _mark_inforom(gpus, warnings)
    return SmiQuery(tree.value_of("Driver Version") or "", attached, gpus, failures, warnings)


def parse_gpu_sections(text: str, index: int = 0) -> GpuState:
    """The sections of one GPU block without its `GPU <bus id>` header (an excerpt of `-q`)."""
    tree = parse_tree(text)
    if not tree.children:
        raise SmiParseError("empty nvidia-smi -q excerpt")
    return gpu_from_sections(tree, index)


def gpu_from_sections(block: QNode, index: int) -> GpuState:
    gpu = GpuState(index=index)
    gpu.name = block.value_of("Product Name") or ""
    gpu.uuid = block.value_of("GPU UUID") or ""
    gpu.minor = _optional_int(block.value_of("Minor Number"), "Minor Number")
    pci = block.child("PCI")
    if pci is not None:
        gpu.bus_id = pci.value_of("Bus Id") or ""
    _read_ecc(block.child("ECC Errors"), gpu)
    _read_retired_pages(block.child("Retired Pages"), gpu)
    _read_remapped_rows(block.child("Remapped Rows"), gpu)
    reasons = block.child("Clocks Event Reasons", "Clocks Throttle Reasons")
    if reasons is not None and reasons.children:
        gpu.clock_event_reasons = _clock_event_bits(reasons)
    _read_memory(block.child("FB Memory Usage"), gpu)
    temperature = block.child("Temperature")
    if temperature is not None:
        gpu.temperature_celsius = _optional_number(temperature.value_of("GPU Current Temp"), "C", "GPU Current Temp")
    power = block.child("Power Readings", "GPU Power Readings")
    if power is not None:
        draw = power.value_of("Power Draw", "Instantaneous Power Draw", "Average Power Draw")
        gpu.power_watts = _optional_number(draw, "W", "Power Draw")
    mig = block.child("MIG Mode")
    if mig is not None:
        gpu.mig_enabled = (mig.value_of("Current") or "").strip().lower() == "enabled"
    action = block.value_of("GPU Recovery Action", "Recovery Action")
    if action is not None and action != "N/A":
        gpu.recovery_action = action
    processes = block.child("Processes")
    if processes is not None:
        gpu.processes = _processes(processes)
    return gpu


def _read_ecc(node: QNode | None, gpu: GpuState) -> None:
    if node is None:
        return
    for scope, corrected_attr, uncorrected_attr in (
        ("Volatile", "ecc_corrected_volatile", "ecc_uncorrected_volatile"),
        ("Aggregate", "ecc_corrected_aggregate", "ecc_uncorrected_aggregate"),
    ):
        section = node.child(scope)
        if section is None:
            continue
        corrected, uncorrected = _ecc_counts(section)
        setattr(gpu, corrected_attr, corrected)
        setattr(gpu, uncorrected_attr, uncorrected)
        exceeded = section.value_of("SRAM Threshold Exceeded")
        if exceeded is not None and exceeded != "N/A":
            gpu.sram_threshold_exceeded = _yes_no(exceeded, "SRAM Threshold Exceeded")


def _ecc_counts(section: QNode) -> tuple[int | None, int | None]:
    single, double = section.child("Single Bit"), section.child("Double Bit")
    if single is not None or double is not None:  # pre-Ampere: per-location tables with a Total line
        return (
            _optional_int(single.value_of("Total"), "Single Bit Total") if single else None,
            _optional_int(double.value_of("Total"), "Double Bit Total") if double else None,
        )
    # Ampere and later: SRAM / DRAM counters; newer drivers split SRAM uncorrectable into Parity and SEC-DED.
    corrected: int | None = None
    uncorrected: int | None = None
    for child in section.children:
        words = child.key.lower().split()
        if child.value is None or child.value == "N/A":
            continue
        if "uncorrectable" in words:
            uncorrected = (uncorrected or 0) + _int(child.value, child.key)
        elif "correctable" in words:
            corrected = (corrected or 0) + _int(child.value, child.key)
    return corrected, uncorrected


def _read_retired_pages(node: QNode | None, gpu: GpuState) -> None:
    if node is None or node.value not in (None, ""):
        return  # `Retired Pages : N/A` on one line: not supported
    gpu.retired_pages_sbe = _optional_int(node.value_of("Single Bit ECC"), "Single Bit ECC")
    gpu.retired_pages_dbe = _optional_int(node.value_of("Double Bit ECC"), "Double Bit ECC")
    for child in node.children:
        if child.key.lower().startswith("pending") and child.value not in (None, "N/A"):
            gpu.retired_pages_pending = _yes_no(child.value or "", child.key)


def _read_remapped_rows(node: QNode | None, gpu: GpuState) -> None:
    if node is None or node.value not in (None, ""):
        return
    gpu.remapped_rows_correctable = _optional_int(node.value_of("Correctable Error"), "Correctable Error")
    gpu.remapped_rows_uncorrectable = _optional_int(node.value_of("Uncorrectable Error"), "Uncorrectable Error")
    pending = node.value_of("Pending")
    if pending not in (None, "N/A"):
        gpu.remap_pending = _yes_no(pending or "", "Pending")
    failure = node.value_of("Remapping Failure Occurred")
    if failure not in (None, "N/A"):
        gpu.remap_failed = _yes_no(failure or "", "Remapping Failure Occurred")


# -q names of the clock event reasons → CLOCK_EVENT_BITS keys.
_CLOCK_EVENT_NAMES = {
    "idle": "gpu_idle",
    "applications clocks setting": "applications_clocks_setting",
    "sw power cap": "sw_power_cap",
    "hw slowdown": "hw_slowdown",
    "sync boost": "sync_boost",
    "sw thermal slowdown": "sw_thermal_slowdown",
    "hw thermal slowdown": "hw_thermal_slowdown",
    "hw power brake slowdown": "hw_power_brake_slowdown",
    "display clock setting": "display_clock_setting",
}


def _clock_event_bits(node: QNode) -> int:
    bits = 0
    for child in _walk(node):
        name = _CLOCK_EVENT_NAMES.get(child.key.lower())
        if name is None or child.value in (None, "N/A"):
            continue
        if child.value == "Active":
            bits |= CLOCK_EVENT_BITS[name]
        elif child.value != "Not Active":
            raise SmiParseError(f"clock event reason {child.key}: {child.value!r} is neither Active nor Not Active")
    return bits


def _walk(node: QNode) -> list[QNode]:
    out = []
    for child in node.children:
        out.append(child)
        out.extend(_walk(child))
    return out


def _read_memory(node: QNode | None, gpu: GpuState) -> None:
    if node is None:
        return
    for key, attr in (("Total", "memory_total_bytes"), ("Used", "memory_used_bytes"), ("Free", "memory_free_bytes")):
        value = _optional_number(node.value_of(key), "MiB", f"FB Memory Usage {key}")
        setattr(gpu, attr, None if value is None else int(value * MIB))


def _processes(node: QNode) -> list[GpuProcess]:
    if node.value not in (None, ""):
        if node.value.lower() in ("none", "no running processes found"):
            return []
        raise SmiParseError(f"Processes: unexpected value {node.value!r}")
    processes: list[GpuProcess] = []
    # Entries are `Process ID : N` with Type / Name / Used GPU Memory either as its children (older drivers)
    # or as siblings that follow it (GPU/Compute instance ID lines come before it on MIG-aware drivers).
    for child in node.children:
        if child.key == "Process ID":
            processes.append(GpuProcess(_int(child.value, "Process ID")))
            details = child.children
        elif processes:
            details = [child]
        else:
            continue
        for detail in details:
            if detail.key == "Used GPU Memory" and detail.value not in (None, "N/A"):
                used = _optional_number(detail.value, "MiB", "Used GPU Memory")
                processes[-1].used_bytes = None if used is None else int(used * MIB)
            elif detail.key == "Type" and detail.value:
                processes[-1].kind = "graphics" if detail.value.strip() == "G" else "compute"
    return processes


def inforom_corrupted_buses(warnings: list[str]) -> set[str]:
    """Bus ids (4-digit domain, upper case) named by `WARNING: infoROM is corrupted at gpu ...` lines."""
    return {short_bus_id(m["bus"]) for w in warnings if (m := _INFOROM_WARNING.search(w))}


def _mark_inforom(gpus: list[GpuState], warnings: list[str]) -> None:
    corrupted = inforom_corrupted_buses(warnings)
    for gpu in gpus:
        gpu.inforom_corrupted = short_bus_id(gpu.bus_id) in corrupted if gpu.bus_id else None


def short_bus_id(bus_id: str) -> str:
    """00000001:00:00.0 and 0001:00:00.0 name the same device: compare with a 4-digit domain, upper case."""
    domain, _, rest = bus_id.partition(":")
    return f"{domain[-4:].rjust(4, '0')}:{rest}".upper()


def parse_messages(text: str) -> tuple[list[EnumerationFailure], list[str]]:
    """`Unable to determine the device handle ...` lines (GPUs that cannot be opened) and `WARNING:` lines."""
    failures, warnings = [], []
    for raw in text.splitlines():
        line = raw.strip()
        if match := _UNABLE.match(line):
            failures.append(EnumerationFailure(None, match["bus"], match["error"].strip()))
        elif match := _WARNING.match(line):
            warnings.append(match["text"].strip())
    return failures, warnings


# --- -L --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ListedGpu:
    index: int
    name: str
    uuid: str
    mig_uuids: tuple[str, ...] = ()


_LIST_LINE = re.compile(r"^GPU (?P<index>\d+): (?P<name>.+?) \(UUID: (?P<uuid>[^)]+)\)$")
_MIG_LINE = re.compile(r"^MIG \S+\s+Device\s+\d+: \(UUID: (?P<uuid>[^)]+)\)$")


def parse_list(text: str) -> tuple[list[ListedGpu], list[EnumerationFailure]]:
    """`nvidia-smi -L` → the GPUs it lists (with the MIG devices indented under them) and the ones it could
    not open."""
    listed: list[ListedGpu] = []
    failures = []
    for raw in text.splitlines():
        line = raw.strip()
        if match := _LIST_LINE.match(line):
            listed.append(ListedGpu(int(match["index"]), match["name"], match["uuid"]))
        elif (match := _MIG_LINE.match(line)) and listed:
            last = listed[-1]
            listed[-1] = ListedGpu(last.index, last.name, last.uuid, (*last.mig_uuids, match["uuid"]))
        elif match := _UNABLE.match(line):
            failures.append(EnumerationFailure(None, match["bus"], match["error"].strip()))
    if not listed and not failures and text.strip() and "No devices were found" not in text:
        raise SmiParseError("no `GPU N: name (UUID: ...)` line in nvidia-smi -L output")
    return listed, failures


# --- CSV -------------------------------------------------------------------------------------------


def parse_csv(text: str, fields: list[str] | None = None) -> list[dict[str, str | None]]:
    """`--format=csv` (header line first) or `--format=csv,noheader` with `fields` given.

    Values are stripped; `[N/A]`, `N/A` and `[Not Supported]` become None. A row with a different number of
    columns than the header is malformed.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if fields is None:
        if not lines:
            raise SmiParseError("empty nvidia-smi CSV output (no header)")
        fields = [name.strip() for name in lines[0].split(",")]
        lines = lines[1:]
    rows = []
    for line in lines:
        values = [value.strip() for value in line.split(", ")]
        if len(values) != len(fields):
            raise SmiParseError(f"CSV row has {len(values)} columns, expected {len(fields)} ({fields}): {line!r}")
        rows.append(
            {name: (None if value in _NOT_AVAILABLE else value) for name, value in zip(fields, values, strict=True)}
        )
    return rows


_NOT_AVAILABLE = {"[N/A]", "N/A", "[Not Supported]", "[Unknown Error]"}


# --- the default table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TableGpu:
    index: int
    name: str  # truncated by nvidia-smi (`Tesla V100-SXM2...`)
    bus_id: str
    volatile_uncorrected_ecc: int | None
    temperature_celsius: float | None
    power_watts: float | None
    memory_used_mib: int
    memory_total_mib: int


@dataclass
class SmiTable:
    driver_version: str
    gpus: list[TableGpu]
    no_processes: bool
    warnings: list[str]
    failures: list[EnumerationFailure]


_TABLE_DRIVER = re.compile(r"Driver Version: (?P<version>\S+)")
_TABLE_ROW1 = re.compile(
    r"^\|\s+(?P<index>\d+)\s+(?P<name>.+?)\s+(?:On|Off)\s+\|\s+(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d)"
    r"\s+(?:On|Off)\s+\|\s+(?P<ecc>\S+)\s+\|$"
)
_TABLE_ROW2 = re.compile(
    r"^\|\s+(?P<fan>\S+)\s+(?P<temp>\S+)\s+(?P<perf>\S+)\s+(?P<power>\S+)\s*/\s*\S+\s+\|"
    r"\s+(?P<used>\d+)MiB\s*/\s*(?P<total>\d+)MiB\s+\|"
)


def parse_table(text: str) -> SmiTable:
    """The default `nvidia-smi` table: per-GPU rows (two lines each), the process table, trailing warnings."""
    driver = _TABLE_DRIVER.search(text)
    if driver is None:
        raise SmiParseError("no `Driver Version:` in the nvidia-smi table header")
    gpus: list[TableGpu] = []
    pending: re.Match[str] | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        if match := _TABLE_ROW1.match(line):
            pending = match
            continue
        if pending is not None and (match := _TABLE_ROW2.match(line)):
            gpus.append(
                TableGpu(
                    index=int(pending["index"]),
                    name=pending["name"],
                    bus_id=pending["bus"],
                    volatile_uncorrected_ecc=_optional_int(pending["ecc"], "Volatile Uncorr. ECC"),
                    temperature_celsius=_optional_number(match["temp"], "C", "Temp"),
                    power_watts=_optional_number(match["power"], "W", "Pwr:Usage"),
                    memory_used_mib=int(match["used"]),
                    memory_total_mib=int(match["total"]),
                )
            )
        pending = None
    if not gpus:
        raise SmiParseError("no GPU rows in the nvidia-smi table")
    failures, warnings = parse_messages(text)
    return SmiTable(driver["version"], gpus, "No running processes found" in text, warnings, failures)


# --- values ----------------------------------------------------------------------------------------


def _int(value: str | None, what: str) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise SmiParseError(f"{what}: {value!r} is not an integer") from None


def _optional_int(value: str | None, what: str) -> int | None:
    if value is None or value.strip() in _NOT_AVAILABLE or value.strip() == "":
        return None
    return _int(value, what)


def _optional_number(value: str | None, unit: str, what: str) -> float | None:
    if value is None or value.strip() in _NOT_AVAILABLE or value.strip() == "":
        return None
    text = value.strip()
    if text.endswith(unit):
        text = text[: -len(unit)].strip()
    try:
        return float(text)
    except ValueError:
        raise SmiParseError(f"{what}: {value!r} is not a number of {unit}") from None


def _yes_no(value: str, what: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("yes", "true"):
        return True
    if lowered in ("no", "false"):
        return False
    raise SmiParseError(f"{what}: {value!r} is neither Yes nor No")
