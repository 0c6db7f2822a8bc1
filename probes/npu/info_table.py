"""`npu-smi info`: the chip table (and its process table), parsed into chips. Pure functions of text.

`npu-smi info` prints box tables whose widths and columns differ by chip and tool version (310, 310P, 310B,
910A, 910B, A3 with two dies per card, the 116-column 26.x layout, the 950 layout with `NPU ID | Name` in
separate cells). The parser never uses character offsets of the whole line: it splits rows at the `|`
borders, learns the column names from the header rows, and reads each cell by the names its header cell
holds. Each chip is two rows (card-level values, then chip-level values); dies and cards are separated by
`+---` / `+===` borders. The card id (first column) is the DCMI card id, not an index: 215, 1792, 32768.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from probes.base import ProbeParseError

# npu-smi prints at most this many processes per chip in `npu-smi info` (the driver's MAX_CHIP_PROCESS_NUM);
# when a chip shows this many, `-t proc-mem` has the complete list.
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
    # Cards the process table names (a process row, or "No running processes found in NPU N"): a whole table
    # names every card of the chip table.
    process_cards: frozenset[int] = frozenset()
    # Why the processes of some cards are unknown: the output was cut in its process section, after a complete,
    # closed chip section (`probes.npu.completeness.read_table`); "" when the process section is whole.
    processes_cut: str = ""


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


def is_missing(text: str) -> bool:
    return text in ("", "NA", "N/A", "-", "--")


def parse_int(text: str | None, what: str, required: bool = False) -> int | None:
    if text is None or is_missing(text):
        if required:
            raise NpuSmiParseError(f"{what}: missing")
        return None
    try:
        return int(text)
    except ValueError:
        raise NpuSmiParseError(f"{what}: {text!r} is not a whole number") from None


def parse_float(text: str | None, what: str) -> float | None:
    if text is None or is_missing(text):
        return None
    try:
        value = float(text)
    except ValueError:
        raise NpuSmiParseError(f"{what}: {text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise NpuSmiParseError(f"{what}: {text!r} is not a finite number")
    return value


def _pair(text: str | None, what: str) -> tuple[int | None, int | None]:
    if text is None or is_missing(text):
        return (None, None)
    used, sep, total = text.partition("/")
    if not sep:
        raise NpuSmiParseError(f"{what}: {text!r} is not a `used / total` pair")
    return (parse_int(used.strip(), what), parse_int(total.strip(), what))


def _split_row(line: str) -> list[str]:
    return line[1:-1].split("|")


def _table_items(text: str) -> list[tuple[str, object]]:
    """The table's lines as ("border", is_double) and ("row", cells); text before or after the table is
    ignored (warnings some versions print first), text inside it is an error."""
    items: list[tuple[str, object]] = []
    stray: list[str] = []
    value: object
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
    sections = _Sections()
    for kind, value in _table_items(text):
        if kind == "border":
            sections.border()
        else:
            sections.row(value)  # type: ignore[arg-type]
    sections.finish()
    if sections.chip_header is None:
        raise NpuSmiParseError("no `npu-smi info` chip table (no header with Health)")
    chips = _chips_from_rows(sections.chip_header, sections.chip_rows)
    if not chips:
        raise NpuSmiParseError("the chip table lists no chips")
    header = sections.chip_header
    has_chip_column = any(name == "chip" for cell in header[1] for name, _ in _header_names(cell))
    if sections.process_header is None:
        return NpuInfo(sections.version, tuple(chips), has_process_table=False, has_chip_column=has_chip_column)
    chips, cards = _attach_processes(chips, sections.process_header, sections.process_rows)
    return NpuInfo(sections.version, tuple(chips), True, has_chip_column, cards)


class _Sections:
    """Sorts the table's rows into the title, the chip header and chips, and the process table."""

    def __init__(self) -> None:
        self.version: str | None = None
        self.chip_header: tuple[list[str], list[str]] | None = None
        self.pending_header_row: list[str] | None = None
        self.process_header: list[str] | None = None
        self.section = "title"
        self.chip_rows: list[tuple[list[str], list[str]]] = []
        self.process_rows: list[list[str]] = []
        self.group: list[list[str]] = []

    def flush(self) -> None:
        if self.section == "chips":
            if len(self.group) % 2:
                raise NpuSmiParseError(f"a chip block has {len(self.group)} rows; each chip is two rows")
            self.chip_rows.extend((self.group[i], self.group[i + 1]) for i in range(0, len(self.group), 2))
        elif self.section == "processes":
            self.process_rows.extend(self.group)
        self.group = []

    def border(self) -> None:
        if self.pending_header_row is not None:
            raise NpuSmiParseError("the chip table's header has one row; expected two")
        self.flush()

    def row(self, cells: list[str]) -> None:
        stripped = [c.strip() for c in cells]
        if self.pending_header_row is not None:
            self.chip_header = (self.pending_header_row, cells)
            self.pending_header_row = None
            self.section = "chips"
        elif any(c == "Health" or c.endswith(" Health") or c.startswith("Health ") for c in stripped):
            if self.chip_header is not None:
                raise NpuSmiParseError("two chip table headers")
            self.flush()
            self.pending_header_row = cells
            self.section = "chip-header"
        elif any(c.startswith("Process id") for c in stripped):
            if self.chip_header is None or self.process_header is not None:
                raise NpuSmiParseError("process table header in an unexpected place")
            self.flush()
            self.process_header = cells
            self.section = "processes"
        elif self.section == "title":
            match = _VERSION.search(" ".join(stripped))
            if match:
                self.version = match.group(1)
        else:
            self.group.append(cells)

    def finish(self) -> None:
        if self.pending_header_row is not None:
            raise NpuSmiParseError("the chip table's header has one row; expected two")
        self.flush()


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
        card = parse_int(both.get("card"), f"{what} NPU", required=True)
        assert card is not None
        health = both.get("health", "")
        if not re.fullmatch(r"[A-Za-z][A-Za-z_-]*", health):
            raise NpuSmiParseError(f"{what}: health {health!r} is not a health word")
        chip_index = parse_int(both.get("chip"), f"{what} Chip")
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
                logical_id=parse_int(both.get("logical"), f"{what} Device"),
                physical_id=parse_int(both.get("physical"), f"{what} Phy-ID"),
                power_watts=parse_float(both.get("power"), f"{what} Power"),
                temperature_celsius=parse_float(both.get("temp"), f"{what} Temp"),
                hugepages_used=hp_used,
                hugepages_total=hp_total,
                bus_id=None if bus is None or is_missing(bus) else bus,
                aicore_percent=parse_float(both.get("aicore"), f"{what} AICore"),
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


def _attach_processes(
    chips: list[NpuChip], header: list[str], rows: list[list[str]]
) -> tuple[list[NpuChip], frozenset[int]]:
    """The chips with their processes, and the cards the process table names."""
    by_chip: dict[tuple[int, int], list[NpuProcess]] = {(c.card_id, c.chip_index): [] for c in chips}
    cards = {c.card_id for c in chips}
    named: set[int] = set()
    for number, cells in enumerate(rows, 1):
        what = f"process row {number}"
        if len(cells) == 1:
            match = _NO_PROCESSES.match(cells[0].strip())
            if not match:
                raise NpuSmiParseError(f"{what}: {cells[0].strip()[:60]!r}")
            if int(match.group(1)) not in cards:
                raise NpuSmiParseError(f"{what}: NPU {match.group(1)} is not in the chip table")
            named.add(int(match.group(1)))
            continue
        values = _process_values(header, cells, what)
        card = parse_int(values.get("card"), f"{what} NPU", required=True)
        chip = parse_int(values.get("chip"), f"{what} Chip")
        key = (card or 0, chip or 0)
        if key not in by_chip:
            raise NpuSmiParseError(f"{what}: NPU {key[0]} chip {key[1]} is not in the chip table")
        pid = parse_int(values.get("pid"), f"{what} Process id", required=True)
        assert pid is not None
        named.add(key[0])
        by_chip[key].append(
            NpuProcess(
                pid=pid,
                name=values.get("process_name", ""),
                memory_mib=parse_int(values.get("process_memory"), f"{what} Process memory"),
                container_pid=parse_int(values.get("container_pid"), f"{what} Process id in container"),
            )
        )
    return [replace(c, processes=tuple(by_chip[(c.card_id, c.chip_index)])) for c in chips], frozenset(named)
