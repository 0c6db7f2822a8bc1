"""npu-smi detail outputs: `info -m` (card/chip → logical and physical ids) and the `key : value` outputs of
`info -t TYPE` (health, proc-mem). Pure functions of text."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from probes.npu.info_table import NpuChip, NpuProcess, NpuSmiParseError, is_missing, parse_int


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
        card = parse_int(field("npuid"), "-m NPU ID", required=True)
        chip = parse_int(field("chipid"), "-m Chip ID", required=True)
        assert card is not None and chip is not None
        rows.append(
            ChipMapping(
                card,
                chip,
                parse_int(logical_text, "-m Chip Logic ID"),
                parse_int(field("chipphy-id") or field("chipphyid"), "-m Chip Phy-ID"),
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
            if not is_missing(value):
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
            if not is_missing(value):
                words = value.split()
                if not all(re.fullmatch(r"(?:0[xX])?[0-9A-Fa-f]{1,16}", w) for w in words):
                    raise NpuSmiParseError(f"error codes {value!r} are not hex numbers")
                codes = tuple(w.upper().removeprefix("0X") for w in words)
        elif key == "Error Information":
            in_information = True
            if not is_missing(value):
                information.append(value)
        elif key == "":
            raise NpuSmiParseError(f"continuation line {value[:60]!r} outside Error Information")
    if health is None:
        raise NpuSmiParseError("no Health Status in the health output")
    return HealthDetail(health, codes, tuple(information))


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
            parse_int((key_value.group("value") or "").strip(), f"proc-mem {key_value.group('key')}", required=True)
            continue
        raise NpuSmiParseError(f"proc-mem: unexpected line {line[:60]!r}")
    if not saw_anything:
        raise NpuSmiParseError("proc-mem output lists neither processes nor `No process in device`")
    return tuple(processes)
