"""Is an `npu-smi info` table whole? Pure functions of text and parsed output.

A table cut short (npu-smi killed or its output lost part-way, a driver that stops answering mid-query) lists
fewer chips than the node has. Those chips did not fall off the bus: the table only says nothing about them, so
they must not be reported missing (NpuMissing). Two signs tell a cut table:

- its last line is a row, not the closing border (`table_cut`);
- chips are expected (a /dev/davinciN node npu-smi does not list, or npu.expected_chips) and `npu-smi info -l`
  counts more NPUs or chips than the table lists (`shortfall`). When `-l` cannot count them, a table whose
  process section names every card it lists is taken as whole; any other is not known to be.

A table cut in its process section (after the process header: the chip section before it is complete and closed)
still tells every chip's health and memory: `read_table` reads it as far as it is whole, and only the processes
of the cards the section does not name in a closed block are unknown (None, so no HBM leak is judged there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from probes.npu.details import parse_key_values
from probes.npu.info_table import NpuInfo, NpuSmiParseError, parse_info, parse_int


def table_cut(text: str) -> str:
    """Why the table of `npu-smi info` output looks cut off ("" when it ends with its border). Text after the
    table (warnings some versions print) is not the table."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(("+", "|"))]
    if lines and lines[-1].startswith("|"):
        return "the table ends in a row, without its closing border"
    return ""


def read_table(text: str) -> tuple[NpuInfo | None, str]:
    """`npu-smi info` read as far as it is whole: (the table, why it is cut: "" when it is whole). The table is
    None when the cut leaves its chip section not known whole (no process header before the cut); cut after the
    process header, every chip is read and the processes of the cards not named in a closed block are unknown
    (`NpuInfo.processes_cut` says which). Raises NpuSmiParseError for a table it cannot read."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(("+", "|"))]
    partial = bool(lines) and not (lines[-1].startswith("|") and lines[-1].endswith("|") and len(lines[-1]) > 1)
    partial = partial and not (lines[-1].startswith("+") and lines[-1].endswith("+") and len(lines[-1]) > 1)
    cut = "the table ends in a cut line" if partial else table_cut(text)
    if not cut:
        info = parse_info(text)
        if not info.has_process_table or info.process_cards:
            return info, ""
        return _processes_unknown(info, "the table ends after its process header"), ""
    kept = lines[:-1] if partial else lines
    header = next((i for i, line in enumerate(kept) if line.startswith("|") and "Process id" in line), None)
    if header is None:
        return None, cut
    last_border = max((i for i, line in enumerate(kept) if line.startswith("+")), default=-1)
    kept = kept[: max(header, last_border) + 1]  # the header, and each block of process rows closed by a border
    info = parse_info("\n".join(kept))
    return _processes_unknown(info, f"{cut}, in its process section"), ""


def _processes_unknown(info: NpuInfo, why: str) -> NpuInfo:
    """`info` with the processes of the cards its process section does not name made unknown (None)."""
    named = info.process_cards
    chips = tuple(chip if chip.card_id in named else replace(chip, processes=None) for chip in info.chips)
    unknown = sorted({chip.card_id for chip in info.chips} - named)
    if not unknown:
        return info
    cards = ", ".join(map(str, unknown))
    return replace(info, chips=chips, processes_cut=f"{why}: the processes of NPU {cards} are unknown")


@dataclass(frozen=True)
class CardCount:
    """`npu-smi info -l`: the NPUs (cards) the driver counts, and the chips of each."""

    total: int
    chips: dict[int, int]  # NPU ID → Chip Count (absent when the output lists no per-card count)

    @property
    def chip_total(self) -> int | None:
        return sum(self.chips.values()) if self.chips and len(self.chips) == self.total else None


def parse_card_list(text: str) -> CardCount:
    """`npu-smi info -l` → Total Count, and each NPU ID's Chip Count."""
    total: int | None = None
    chips: dict[int, int] = {}
    card: int | None = None
    for key, value in parse_key_values(text):
        name = key.lower()
        if name == "total count":
            total = parse_int(value, "-l Total Count", required=True)
        elif name == "npu id":
            card = parse_int(value, "-l NPU ID", required=True)
        elif name == "chip count" and card is not None:
            chips[card] = parse_int(value, "-l Chip Count", required=True) or 0
    if total is None:
        raise NpuSmiParseError("no `Total Count` in `npu-smi info -l`")
    return CardCount(total, chips)


def shortfall(info: NpuInfo, counted: CardCount | None, count_error: str) -> str:
    """Why a table that lists fewer chips than expected is not whole ("" when it is: the chips are missing).
    `counted` is `npu-smi info -l` parsed, or None with `count_error` saying why it could not be had."""
    cards = {chip.card_id for chip in info.chips}
    listed = f"the table lists {len(cards)} NPUs ({len(info.chips)} chips)"
    if counted is not None:
        chips = counted.chip_total
        if counted.total > len(cards) or set(counted.chips) - cards or (chips is not None and chips > len(info.chips)):
            in_chips = f" ({chips} chips)" if chips is not None else ""
            return f"`npu-smi info -l` counts {counted.total} NPUs{in_chips}, {listed}"
        return ""
    if info.has_process_table and cards <= info.process_cards:
        return ""
    section = "names only some of them" if info.has_process_table else "is absent"
    return f"{listed}, its process section {section}, and `npu-smi info -l` could not count them ({count_error})"
