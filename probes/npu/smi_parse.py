"""npu-smi output: pure parsers, and the classification of the tool's failures.

Everything here is a function of text (or of a finished command's result): no I/O, no clock.

`npu-smi info` prints box tables whose widths and columns differ by chip and tool version (310, 310P, 310B,
910A, 910B, A3 with two dies per card, the 116-column 26.x layout, the 950 layout with `NPU ID | Name` in
separate cells). The parser never uses character offsets of the whole line: it splits rows at the `|`
borders, learns the column names from the header rows, and reads each cell by the names its header cell
holds. Each chip is two rows (card-level values, then chip-level values); dies and cards are separated by
`+---` / `+===` borders. The card id (first column) is the DCMI card id, not an index: 215, 1792, 32768.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from probes.base import ProbeParseError

if TYPE_CHECKING:
    from probes.runtime.host import CommandResult

# npu-smi prints at most this many processes per chip in `npu-smi info` (DRV npu_common.h
# MAX_CHIP_PROCESS_NUM); when a chip shows this many, `-t proc-mem` has the complete list.
MAX_TABLE_PROCESSES_PER_CHIP = 8


class NpuSmiParseError(ProbeParseError):
    """npu-smi output this module could not make sense of."""


# --- data ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NpuProcess:
    pid: int  # host PID (DCMI reports host PIDs)
    name: str  # may be empty: npu-smi could not see the PID in its own PID namespace
    memory_mib: int | None
    container_pid: int | None = None  # 26.x `Process id in container`; None when NA or not printed


@dataclass(frozen=True)
class NpuChip:
    card_id: int  # DCMI card id (the NPU column): not an index
    chip_index: int  # chip (die) index inside the card
    name: str
    health: str  # OK, Warning, Alarm, Critical, UNKNOWN (as printed)
    logical_id: int | None = None  # from the 310/310P `Device` column, or `npu-smi info -m`
    physical_id: int | None = None  # from the A3 `Phy-ID` column, or `npu-smi info -m`
    power_watts: float | None = None
    temperature_celsius: float | None = None
    hugepages_used: int | None = None
    hugepages_total: int | None = None
    bus_id: str | None = None
    aicore_percent: float | None = None
    memory_used_mib: int | None = None  # DDR (910B, A3, 950 print 0 / 0)
    memory_total_mib: int | None = None
    hbm_used_mib: int | None = None
    hbm_total_mib: int | None = None
    # None: the output had no process table for this chip (310, 310B, truncated output).
    processes: tuple[NpuProcess, ...] | None = None

    @property
    def processes_truncated(self) -> bool:
        """The table shows at most 8 processes per chip: at 8 there may be more."""
        return self.processes is not None and len(self.processes) >= MAX_TABLE_PROCESSES_PER_CHIP

    @property
    def device_number(self) -> int | None:
        """N of /dev/davinciN: the physical id when known, else the logical id (equal on a full host view)."""
        return self.physical_id if self.physical_id is not None else self.logical_id

    def device_memory(self) -> tuple[str, int, int] | None:
        """(kind, used MiB, total MiB) of the memory jobs allocate: HBM when the chip has it, else DDR."""
        if self.hbm_total_mib and self.hbm_used_mib is not None:
            return ("hbm", self.hbm_used_mib, self.hbm_total_mib)
        if self.memory_total_mib and self.memory_used_mib is not None:
            return ("ddr", self.memory_used_mib, self.memory_total_mib)
        return None


@dataclass(frozen=True)
class NpuInfo:
    version: str | None
    chips: tuple[NpuChip, ...]
    has_process_table: bool
    # False on the 950 layout, which has no chip column: detail queries then take `-i CARD` only.
    has_chip_column: bool = True


@dataclass(frozen=True)
class ChipMapping:
    """One row of `npu-smi info -m`."""

    card_id: int
    chip_index: int
    logical_id: int | None
    physical_id: int | None
    name: str


@dataclass(frozen=True)
class HealthDetail:
    """`npu-smi info -t health -i N [-c C]`."""

    health: str
    error_codes: tuple[str, ...]  # upper-case hex, e.g. ("A4025021", "8C03A000")
    error_information: tuple[str, ...]


# --- npu-smi info ----------------------------------------------------------------------------------

# Column names as npu-smi prints them; longer names first so `NPU ID` wins over `NPU`. A name nobody has
# seen yet is still read as a word group (words joined by single spaces).
_KNOWN_HEADERS = sorted(
    [
        "NPU ID",
        "NPU Util(%)",
        "NPU",
        "Name",
        "Health",
        "Power(W)",
        "Temp(C)",
        "Hugepages-Usage(page)",
        "Chip",
        "Device",
        "Phy-ID",
        "Bus-Id",
        "AICore(%)",
        "Memory-Usage(MB)",
        "HBM-Usage(MB)",
        "Process id in container",
        "Process id",
        "Process name",
        "Process memory(MB)",
    ],
    key=len,
    reverse=True,
)
_HEADER_TOKEN = re.compile("(?:" + "|".join(re.escape(name) for name in _KNOWN_HEADERS) + r")(?=\s|$)|\S+(?: \S+)*")
# A value: a `used / total` pair (any spacing around the slash: `59356/ 65536`) or one word.
_VALUE_TOKEN = re.compile(r"[^\s/]+\s*/\s*[^\s/]+|\S+")
_BORDER = re.compile(r"^\+[-=+]*\+$")
_NO_PROCESSES = re.compile(r"^No running processes found in NPU\s+(\d+)\s*$")
_VERSION = re.compile(r"Version:\s*(\S+)")


def _canonical(name: str) -> str:
    """Header name → field key; unknown names map to themselves (their values are read but not used)."""
    key = re.sub(r"[\s_]", "", name.lower())
    if key in ("npu", "npuid"):
        return "card"
    if key == "name":
        return "name"
    if key == "health":
        return "health"
    if key.startswith("power"):
        return "power"
    if key.startswith("temp"):
        return "temp"
    if key.startswith("hugepages"):
        return "hugepages"
    if key in ("chip", "chipid"):
        return "chip"
    if key in ("device", "logicid", "chiplogicid"):
        return "logical"
    if key in ("phy-id", "phyid", "chipphy-id"):
        return "physical"
    if key in ("bus-id", "busid"):
        return "bus"
    if key.startswith(("aicore", "npuutil")):
        return "aicore"
    if key.startswith("memory-usage"):
        return "memory"
    if key.startswith("hbm"):
        return "hbm"
    if key == "processidincontainer":
        return "container_pid"
    if key == "processid":
        return "pid"
    if key == "processname":
        return "process_name"
    if key.startswith("processmemory"):
        return "process_memory"
    return "?" + key


def _header_names(cell: str) -> list[tuple[str, int]]:
    """(canonical name, start offset in the cell) of each column a header cell holds."""
    return [(_canonical(m.group(0)), m.start()) for m in _HEADER_TOKEN.finditer(cell)]


def _assign(cell: str, names: list[tuple[str, int]], what: str) -> dict[str, str]:
    """Read one data cell by the names of its header cell."""
    tokens = [(m.group(0), m.start()) for m in _VALUE_TOKEN.finditer(cell)]
    if not names:
        if tokens:
            raise NpuSmiParseError(f"{what}: value {cell.strip()!r} under an empty header cell")
        return {}
    if len(tokens) == len(names):
        return {name: token for (name, _), (token, _) in zip(names, tokens, strict=True)}
    keys = [name for name, _ in names]
    if len(tokens) > len(names) and "name" in keys:
        # A chip name with spaces: the words beyond the other columns belong to the name.
        index = keys.index("name")
        extra = len(tokens) - len(names)
        merged = " ".join(token for token, _ in tokens[index : index + extra + 1])
        values = [t for t, _ in tokens[:index]] + [merged] + [t for t, _ in tokens[index + extra + 1 :]]
        return dict(zip(keys, values, strict=True))
    if 0 < len(tokens) < len(names):
        # A value left blank: align each value with the header name that starts nearest to it.
        out: dict[str, str] = {}
        for token, start in tokens:
            name = min(names, key=lambda item: abs(item[1] - start))[0]
            if name in out:
                raise NpuSmiParseError(f"{what}: cannot align {cell.strip()!r} with its header")
            out[name] = token
        return out
    raise NpuSmiParseError(f"{what}: {len(tokens)} values in {cell.strip()!r} for {len(names)} columns")


def _is_missing(text: str) -> bool:
    return text in ("", "NA", "N/A", "-", "--")


def _int(text: str | None, what: str, required: bool = False) -> int | None:
    if text is None or _is_missing(text):
        if required:
            raise NpuSmiParseError(f"{what}: missing")
        return None
    try:
        return int(text)
    except ValueError:
        raise NpuSmiParseError(f"{what}: {text!r} is not a whole number") from None


def _float(text: str | None, what: str) -> float | None:
    if text is None or _is_missing(text):
        return None
    try:
        value = float(text)
    except ValueError:
        raise NpuSmiParseError(f"{what}: {text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise NpuSmiParseError(f"{what}: {text!r} is not a finite number")
    return value


def _pair(text: str | None, what: str) -> tuple[int | None, int | None]:
    if text is None or _is_missing(text):
        return (None, None)
    used, sep, total = text.partition("/")
    if not sep:
        raise NpuSmiParseError(f"{what}: {text!r} is not a `used / total` pair")
    return (_int(used.strip(), what), _int(total.strip(), what))


def _split_row(line: str) -> list[str]:
    return line[1:-1].split("|")


def _table_items(text: str) -> list[tuple[str, object]]:
    """The table's lines as ("border", is_double) and ("row", cells); text before or after the table is
    ignored (warnings some versions print first), text inside it is an error."""
    items: list[tuple[str, object]] = []
    stray: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("+"):
            if not _BORDER.match(line):
                raise NpuSmiParseError(f"broken table border {line[:60]!r}")
            kind, value = "border", "=" in line
        elif line.startswith("|"):
            if len(line) < 2 or not line.endswith("|"):
                raise NpuSmiParseError(f"table row without a closing border: {line[:60]!r}")
            kind, value = "row", _split_row(line)
        else:
            if items:
                stray.append(line)
            continue
        if stray:
            raise NpuSmiParseError(f"unexpected text inside the table: {stray[0][:60]!r}")
        items.append((kind, value))
    return items


def parse_info(text: str) -> NpuInfo:
    """`npu-smi info` → chips (with their processes when the output has a process table)."""
    items = _table_items(text)
    version: str | None = None
    chip_header: tuple[list[str], list[str]] | None = None
    pending_header_row: list[str] | None = None
    process_header: list[str] | None = None
    section = "title"
    chip_rows: list[tuple[list[str], list[str]]] = []
    process_rows: list[list[str]] = []
    group: list[list[str]] = []

    def flush() -> None:
        if section == "chips":
            if len(group) % 2:
                raise NpuSmiParseError(f"a chip block has {len(group)} rows; each chip is two rows")
            chip_rows.extend((group[i], group[i + 1]) for i in range(0, len(group), 2))
        elif section == "processes":
            process_rows.extend(group)
        group.clear()

    for kind, value in items:
        if kind == "border":
            if pending_header_row is not None:
                raise NpuSmiParseError("the chip table's header has one row; expected two")
            flush()
            continue
        cells: list[str] = value  # type: ignore[assignment]
        stripped = [c.strip() for c in cells]
        if pending_header_row is not None:
            chip_header = (pending_header_row, cells)
            pending_header_row = None
            section = "chips"
            continue
        if any(c == "Health" or c.endswith(" Health") or c.startswith("Health ") for c in stripped):
            if chip_header is not None:
                raise NpuSmiParseError("two chip table headers")
            flush()
            pending_header_row = cells
            section = "chip-header"
            continue
        if any(c.startswith("Process id") for c in stripped):
            if chip_header is None or process_header is not None:
                raise NpuSmiParseError("process table header in an unexpected place")
            flush()
            process_header = cells
            section = "processes"
            continue
        if section == "title":
            match = _VERSION.search(" ".join(stripped))
            if match:
                version = match.group(1)
            continue
        group.append(cells)
    if pending_header_row is not None:
        raise NpuSmiParseError("the chip table's header has one row; expected two")
    flush()
    if chip_header is None:
        raise NpuSmiParseError("no `npu-smi info` chip table (no header with Health)")
    chips = _chips_from_rows(chip_header, chip_rows)
    if not chips:
        raise NpuSmiParseError("the chip table lists no chips")
    has_chip_column = any(name == "chip" for cell in chip_header[1] for name, _ in _header_names(cell))
    if process_header is None:
        return NpuInfo(version, tuple(chips), has_process_table=False, has_chip_column=has_chip_column)
    chips = _attach_processes(chips, process_header, process_rows)
    return NpuInfo(version, tuple(chips), has_process_table=True, has_chip_column=has_chip_column)


def _row_values(header: list[str], cells: list[str], what: str) -> dict[str, str]:
    if len(cells) != len(header):
        raise NpuSmiParseError(f"{what}: {len(cells)} cells, the header has {len(header)}")
    values: dict[str, str] = {}
    for head, cell in zip(header, cells, strict=True):
        for key, token in _assign(cell, _header_names(head), what).items():
            if key in values:
                raise NpuSmiParseError(f"{what}: column {key} appears twice")
            values[key] = token
    return values


def _chips_from_rows(header: tuple[list[str], list[str]], rows: list[tuple[list[str], list[str]]]) -> list[NpuChip]:
    chips: list[NpuChip] = []
    seen: set[tuple[int, int]] = set()
    dies_per_card: dict[int, int] = {}
    for number, (first, second) in enumerate(rows, 1):
        what = f"chip row {number}"
        top = _row_values(header[0], first, what)
        bottom = _row_values(header[1], second, what)
        both = {**top, **bottom}
        if len(both) != len(top) + len(bottom):
            raise NpuSmiParseError(f"{what}: a column appears in both rows")
        card = _int(both.get("card"), f"{what} NPU", required=True)
        assert card is not None
        health = both.get("health", "")
        if not re.fullmatch(r"[A-Za-z][A-Za-z_-]*", health):
            raise NpuSmiParseError(f"{what}: health {health!r} is not a health word")
        chip_index = _int(both.get("chip"), f"{what} Chip")
        if chip_index is None:
            # No chip column (950 layout): the n-th row of a card is its n-th chip.
            chip_index = dies_per_card.get(card, 0)
        dies_per_card[card] = dies_per_card.get(card, 0) + 1
        if (card, chip_index) in seen:
            raise NpuSmiParseError(f"{what}: NPU {card} chip {chip_index} listed twice")
        seen.add((card, chip_index))
        hp_used, hp_total = _pair(both.get("hugepages"), f"{what} Hugepages-Usage")
        mem_used, mem_total = _pair(both.get("memory"), f"{what} Memory-Usage")
        hbm_used, hbm_total = _pair(both.get("hbm"), f"{what} HBM-Usage")
        bus = both.get("bus")
        chips.append(
            NpuChip(
                card_id=card,
                chip_index=chip_index,
                name=both.get("name", ""),
                health=health,
                logical_id=_int(both.get("logical"), f"{what} Device"),
                physical_id=_int(both.get("physical"), f"{what} Phy-ID"),
                power_watts=_float(both.get("power"), f"{what} Power"),
                temperature_celsius=_float(both.get("temp"), f"{what} Temp"),
                hugepages_used=hp_used,
                hugepages_total=hp_total,
                bus_id=None if bus is None or _is_missing(bus) else bus,
                aicore_percent=_float(both.get("aicore"), f"{what} AICore"),
                memory_used_mib=mem_used,
                memory_total_mib=mem_total,
                hbm_used_mib=hbm_used,
                hbm_total_mib=hbm_total,
            )
        )
    return chips


def _process_values(header: list[str], cells: list[str], what: str) -> dict[str, str]:
    head_names = [_header_names(h) for h in header]
    if len(cells) > len(header):
        # A process name holding `|`: give the surplus cells back to the name.
        index = next(
            (i for i, names in enumerate(head_names) if len(names) == 1 and names[0][0] == "process_name"), None
        )
        if index is None:
            raise NpuSmiParseError(f"{what}: {len(cells)} cells, the header has {len(header)}")
        extra = len(cells) - len(header)
        cells = [*cells[:index], "|".join(cells[index : index + extra + 1]), *cells[index + extra + 1 :]]
    if len(cells) != len(header):
        raise NpuSmiParseError(f"{what}: {len(cells)} cells, the header has {len(header)}")
    values: dict[str, str] = {}
    for names, cell in zip(head_names, cells, strict=True):
        if len(names) == 1:
            # One column: the whole cell is the value (process names may be empty or hold spaces).
            values[names[0][0]] = cell.strip()
        else:
            values.update(_assign(cell, names, what))
    return values


def _attach_processes(chips: list[NpuChip], header: list[str], rows: list[list[str]]) -> list[NpuChip]:
    by_chip: dict[tuple[int, int], list[NpuProcess]] = {(c.card_id, c.chip_index): [] for c in chips}
    cards = {c.card_id for c in chips}
    for number, cells in enumerate(rows, 1):
        what = f"process row {number}"
        if len(cells) == 1:
            match = _NO_PROCESSES.match(cells[0].strip())
            if not match:
                raise NpuSmiParseError(f"{what}: {cells[0].strip()[:60]!r}")
            if int(match.group(1)) not in cards:
                raise NpuSmiParseError(f"{what}: NPU {match.group(1)} is not in the chip table")
            continue
        values = _process_values(header, cells, what)
        card = _int(values.get("card"), f"{what} NPU", required=True)
        chip = _int(values.get("chip"), f"{what} Chip")
        key = (card or 0, chip or 0)
        if key not in by_chip:
            raise NpuSmiParseError(f"{what}: NPU {key[0]} chip {key[1]} is not in the chip table")
        pid = _int(values.get("pid"), f"{what} Process id", required=True)
        assert pid is not None
        by_chip[key].append(
            NpuProcess(
                pid=pid,
                name=values.get("process_name", ""),
                memory_mib=_int(values.get("process_memory"), f"{what} Process memory"),
                container_pid=_int(values.get("container_pid"), f"{what} Process id in container"),
            )
        )
    return [replace(c, processes=tuple(by_chip[(c.card_id, c.chip_index)])) for c in chips]


# --- npu-smi info -m -------------------------------------------------------------------------------


def parse_mapping(text: str) -> tuple[ChipMapping, ...]:
    """`npu-smi info -m` → card/chip → logical (and physical) id; Mcu rows are skipped."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    header_at = next((i for i, line in enumerate(lines) if "NPU ID" in line and "Chip ID" in line), None)
    if header_at is None:
        raise NpuSmiParseError("no `npu-smi info -m` header (NPU ID, Chip ID)")
    columns = [re.sub(r"[\s_]", "", c.lower()) for c in re.split(r"\s{2,}|\t", lines[header_at])]
    index = {name: i for i, name in enumerate(columns)}
    if "npuid" not in index or "chipid" not in index:
        raise NpuSmiParseError(f"`npu-smi info -m` header {lines[header_at]!r}")
    width = len(columns)
    rows: list[ChipMapping] = []
    for line in lines[header_at + 1 :]:
        parts = line.split(None, width - 1)
        if len(parts) != width:
            raise NpuSmiParseError(f"`npu-smi info -m` row {line!r}: {len(parts)} fields, expected {width}")

        def field(key: str, parts: list[str] = parts) -> str | None:
            return parts[index[key]] if key in index else None

        name = field("chipname") or ""
        logical_text = field("chiplogicid")
        if name.strip().lower() == "mcu" or logical_text == "-":
            continue  # the board's management controller, not a chip
        card = _int(field("npuid"), "-m NPU ID", required=True)
        chip = _int(field("chipid"), "-m Chip ID", required=True)
        assert card is not None and chip is not None
        rows.append(
            ChipMapping(
                card,
                chip,
                _int(logical_text, "-m Chip Logic ID"),
                _int(field("chipphy-id") or field("chipphyid"), "-m Chip Phy-ID"),
                name.strip(),
            )
        )
    if not rows:
        raise NpuSmiParseError("`npu-smi info -m` lists no chips")
    return tuple(rows)


def resolve_ids(chips: Sequence[NpuChip], mapping: Sequence[ChipMapping] | None) -> tuple[NpuChip, ...]:
    """Fill logical and physical ids from `-m`; chips still without a logical id get the lowest free ids in
    table order (npu-smi lists chips in logical-id order, and renumbers from 0 inside a container)."""
    by_key = {(m.card_id, m.chip_index): m for m in mapping or ()}
    out: list[NpuChip] = []
    for chip in chips:
        row = by_key.get((chip.card_id, chip.chip_index))
        if row is not None:
            chip = replace(
                chip,
                logical_id=chip.logical_id if chip.logical_id is not None else row.logical_id,
                physical_id=chip.physical_id if chip.physical_id is not None else row.physical_id,
            )
        out.append(chip)
    taken = {c.logical_id for c in out if c.logical_id is not None}
    next_free = 0
    for i, chip in enumerate(out):
        if chip.logical_id is None:
            while next_free in taken:
                next_free += 1
            out[i] = replace(chip, logical_id=next_free)
            taken.add(next_free)
    return tuple(out)


# --- `-t` key : value outputs ----------------------------------------------------------------------

_KEY_VALUE = re.compile(r"^(?P<key>.*?)(?:\s+|^):(?:\s+(?P<value>.*?))?\s*$")


def parse_key_values(text: str) -> list[tuple[str, str]]:
    """`\\tKey<padding> : value` lines → [(key, value)]; a continuation line has the key ""."""
    pairs: list[tuple[str, str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        match = _KEY_VALUE.match(line)
        if not match:
            raise NpuSmiParseError(f"not a `key : value` line: {line[:60]!r}")
        pairs.append((match.group("key").strip(), (match.group("value") or "").strip()))
    return pairs


def parse_health(text: str) -> HealthDetail:
    """`npu-smi info -t health -i N -c C` (or `-i N` on 950): health word, hex error codes, information."""
    health: str | None = None
    codes: tuple[str, ...] = ()
    information: list[str] = []
    in_information = False
    for key, value in parse_key_values(text):
        if key == "" and in_information:
            if not _is_missing(value):
                information.append(value)
            continue
        in_information = False
        if key in ("Health Status", "Health"):
            if health is not None:
                raise NpuSmiParseError("health output has more than one health status (card-level output?)")
            if not re.fullmatch(r"[A-Za-z][A-Za-z_-]*", value):
                raise NpuSmiParseError(f"health status {value!r} is not a health word")
            health = value
        elif key == "Error Code":
            if not _is_missing(value):
                words = value.split()
                if not all(re.fullmatch(r"(?:0[xX])?[0-9A-Fa-f]{1,16}", w) for w in words):
                    raise NpuSmiParseError(f"error codes {value!r} are not hex numbers")
                codes = tuple(w.upper().removeprefix("0X") for w in words)
        elif key == "Error Information":
            in_information = True
            if not _is_missing(value):
                information.append(value)
        elif key == "":
            raise NpuSmiParseError(f"continuation line {value[:60]!r} outside Error Information")
    if health is None:
        raise NpuSmiParseError("no Health Status in the health output")
    return HealthDetail(health, codes, tuple(information))


def parse_usages(text: str) -> dict[int, dict[str, float | None]]:
    """`npu-smi info -t usages -i N` → {chip id: {label: number}} (labels as printed, e.g. `HBM Usage Rate(%)`).

    Each chip block ends with its `Chip ID` line; output without one (950) is chip 0.
    """
    blocks: dict[int, dict[str, float | None]] = {}
    current: dict[str, float | None] = {}
    for key, value in parse_key_values(text):
        if key in ("NPU ID", "Chip Count"):
            _int(value, f"usages {key}", required=True)
            continue
        if key == "Chip ID":
            chip = _int(value, "usages Chip ID", required=True)
            assert chip is not None
            if chip in blocks:
                raise NpuSmiParseError(f"usages: chip {chip} listed twice")
            blocks[chip] = current
            current = {}
            continue
        if key == "":
            raise NpuSmiParseError(f"usages: unexpected continuation line {value[:60]!r}")
        current[key] = _float(value, f"usages {key}")
    if current:
        if 0 in blocks:
            raise NpuSmiParseError("usages: values after the last Chip ID line")
        blocks[0] = current
    if not blocks:
        raise NpuSmiParseError("usages output has no values")
    return blocks


_PROC_MEM_LINE = re.compile(
    r"^Process id:\s*(?P<pid>\d+)\s+Process name:(?P<name>.*?)\s+Process memory\(MB\):\s*(?P<mem>\d+)\s*$"
)


def parse_proc_mem(text: str) -> tuple[NpuProcess, ...]:
    """`npu-smi info -t proc-mem -i N [-c C]` → every process on the chip (no 8-row limit)."""
    processes: list[NpuProcess] = []
    saw_anything = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        match = _PROC_MEM_LINE.match(line)
        if match:
            saw_anything = True
            processes.append(NpuProcess(int(match.group("pid")), match.group("name").strip(), int(match.group("mem"))))
            continue
        if line.rstrip(".").lower() == "no process in device":
            saw_anything = True
            continue
        key_value = _KEY_VALUE.match(line)
        if key_value and key_value.group("key").strip() in ("NPU ID", "Chip ID", "Chip Count"):
            _int((key_value.group("value") or "").strip(), f"proc-mem {key_value.group('key')}", required=True)
            continue
        raise NpuSmiParseError(f"proc-mem: unexpected line {line[:60]!r}")
    if not saw_anything:
        raise NpuSmiParseError("proc-mem output lists neither processes nor `No process in device`")
    return tuple(processes)


# --- failures --------------------------------------------------------------------------------------

# DCMI return codes (DRV Ascend_910B_DCMI_API return-codes.md).
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
    #            invalid_argument, unsupported, exit_status
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
    text = result.output
    detail = _first_lines(text)
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
        return SmiFailure(
            "not_installed", "no npu-smi on this host", "install the Ascend driver package", detail=detail
        )
    match = _RET_CODE.search(text)
    ret = int(match.group(1)) if match else None
    lowered = text.lower()
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
        meaning = DCMI_RETURN_CODES.get(ret, "DCMI error")
        return SmiFailure(
            "dcmi_error",
            f"npu-smi failed with DCMI error {ret} ({meaning})",
            "check `dmesg` for NPU driver errors and the driver/firmware versions (npu-smi info -t board)",
            ret,
            detail,
        )
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
