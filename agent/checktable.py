"""`node-health check`'s table: as wide as the terminal, aligned columns, worst first, colour on a terminal.

Width: `$COLUMNS` when set, else the terminal's width when stdout is one, else 120 (a CI log, a ticket); never
under 80. Columns STATUS, CHECK, SUBJECT and REASON are aligned; a subject wider than its column is shortened
with an ellipsis in the middle (a path keeps its head and its last component; `--json` has it whole); the
message follows in its own column, wrapped between words, or on indented lines below when the column would be
too narrow (or a word in it wider than the column: a path, an escaped name is never split where it need not be).
Colour (FAIL red, UNKNOWN magenta, WARN yellow) only when stdout is a terminal and `$NO_COLOR` is not
set; colour codes never count towards the width. Everything shown was escaped where the finding was made.
"""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from probes.base import Finding, Status
from probes.text import ELLIPSIS, clip

NOT_A_TTY_WIDTH = 120  # a CI log, a ticket
MIN_WIDTH = 80
SUBJECT_SHARE = 4  # a subject column takes at most a quarter of the width
MESSAGE_COLUMN_MIN = 30  # a narrower message column puts the message on lines of its own
INDENT = "    "

STATUS_MARK = {
    Status.OK: "ok",
    Status.WARN: "WARN",
    Status.FAIL: "FAIL",
    Status.UNKNOWN: "UNKNOWN",
    Status.SKIP: "skip",
}
# Rows worst first: what blocks a job, what cannot be vouched for, what needs a look, then the rest.
SEVERITY = {Status.FAIL: 0, Status.UNKNOWN: 1, Status.WARN: 2, Status.OK: 3, Status.SKIP: 4}
PROBLEMS = (Status.FAIL, Status.UNKNOWN, Status.WARN)
_COLOURS = {Status.FAIL: "\x1b[1;31m", Status.UNKNOWN: "\x1b[1;35m", Status.WARN: "\x1b[1;33m"}
_RESET = "\x1b[0m"
# An escape as probes/text.py writes it: a shortened subject never cuts one in two.
_ESCAPE = re.compile(r"\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})")


@dataclass(frozen=True)
class Style:
    width: int = NOT_A_TTY_WIDTH
    colour: bool = False


def terminal_style(stream: IO[str], environ: Mapping[str, str] | None = None) -> Style:
    """The width and colour for `stream`: $COLUMNS, else the terminal's width, else 120; at least 80. Colour on
    a terminal unless $NO_COLOR is set to anything non-empty (no-color.org)."""
    env = os.environ if environ is None else environ
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    width = NOT_A_TTY_WIDTH
    columns = env.get("COLUMNS", "").strip()
    if columns.isdigit():
        width = int(columns)
    elif tty:
        try:
            width = os.get_terminal_size(stream.fileno()).columns or NOT_A_TTY_WIDTH
        except (OSError, ValueError):
            width = NOT_A_TTY_WIDTH
    return Style(max(MIN_WIDTH, width), tty and not env.get("NO_COLOR"))


def shorten_middle(text: str, limit: int) -> str:
    """`text` when it fits in `limit`, else its head, an ellipsis and its tail, `limit` characters at most; no
    escape is cut in two (the cut moves out of it)."""
    if len(text) <= limit:
        return text
    if limit <= len(ELLIPSIS):
        return clip(text, limit)
    room = limit - len(ELLIPSIS)
    head = clip(text, (room + 1) // 2, ellipsis="")
    start = len(text) - (room - len(head))
    for match in _ESCAPE.finditer(text, max(0, start - 9), start + 10):
        if match.start() < start < match.end():
            start = match.end()
    return head + ELLIPSIS + text[start:]


def _paint(text: str, status: Status, style: Style) -> str:
    colour = _COLOURS.get(status) if style.colour else None
    return f"{colour}{text}{_RESET}" if colour else text


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    """`text` in lines of at most `width`, broken between words (a word longer than a line is split)."""
    lines = textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)
    return lines or [first.rstrip()]


def _longest_word(text: str) -> int:
    return max((len(word) for word in text.split()), default=0)


@dataclass(frozen=True)
class _Columns:
    mark: int
    check: int
    subject: int
    reason: int

    @property
    def message_start(self) -> int:
        return self.mark + self.check + self.subject + self.reason + 8


def _columns(findings: Sequence[Finding], width: int) -> _Columns:
    return _Columns(
        max(len(mark) for mark in ("STATUS", *STATUS_MARK.values())),
        max([len("CHECK"), *(len(f.check) for f in findings)]),
        max([len("SUBJECT"), *(min(len(f.subject or "-"), width // SUBJECT_SHARE) for f in findings)]),
        max([len("REASON"), *(len(f.reason) for f in findings)]),
    )


def _row(finding: Finding, cols: _Columns, style: Style) -> list[str]:
    """The head line (status, check, subject, reason, and the message in its column), the message on lines of
    its own when its column is too narrow, and the fix for a fail, unknown or warn."""
    width = style.width
    subject = shorten_middle(finding.subject or "-", cols.subject)
    mark = STATUS_MARK[finding.status]
    plain_head = f"{mark:<{cols.mark}}  {finding.check:<{cols.check}}  {subject:<{cols.subject}}  "
    plain_head += f"{finding.reason:<{cols.reason}}  "
    head = _paint(mark, finding.status, style) + plain_head[len(mark) :]
    if len(plain_head) > width:  # a check or reason name wider than the terminal: the head wraps by itself
        lines = _wrap(plain_head.rstrip(), width, "", INDENT + INDENT)
        lines[0] = _paint(mark, finding.status, style) + lines[0][len(mark) :]
        lines += _wrap(finding.message, width, INDENT, INDENT) if finding.message else []
    elif len(plain_head) + len(finding.message) <= width or (
        width - len(plain_head) >= max(MESSAGE_COLUMN_MIN, _longest_word(finding.message))
    ):
        body = _wrap(finding.message, width - len(plain_head), "", "") if finding.message else [""]
        lines = [(head + body[0]).rstrip(), *(" " * len(plain_head) + line for line in body[1:])]
    else:
        lines = [head.rstrip(), *(_wrap(finding.message, width, INDENT, INDENT) if finding.message else [])]
    if finding.hint and finding.status in PROBLEMS:
        lines += _wrap(finding.hint, width, f"{INDENT}fix: ", INDENT + " " * len("fix: "))
    return lines


def verdict_lines(node: str, ready: bool, blocking: int, counts: Mapping[Status, int], style: Style) -> list[str]:
    """`node NAME: READY (tally)` or `node NAME: NOT READY: N reasons block jobs (tally)`, wrapped between words
    when wider than the table; the word READY or NOT READY coloured on a terminal."""
    tally = ", ".join(f"{counts[status]} {STATUS_MARK[status].lower()}" for status in SEVERITY if counts[status])
    word = "READY" if ready else "NOT READY"
    if ready:
        rest = f" ({tally or 'no checks'})"
    else:
        reasons = "1 reason blocks" if blocking == 1 else f"{blocking} reasons block"
        rest = f": {reasons} jobs ({tally})"
    prefix = f"node {shorten_middle(node, style.width // 2)}: "
    lines = _wrap(prefix + word + rest, style.width, "", INDENT)
    lines[0] = prefix + _paint(word, Status.OK if ready else Status.FAIL, style) + lines[0][len(prefix) + len(word) :]
    return lines


def format_table(
    node: str,
    findings: Sequence[Finding],
    ready: bool,
    blocking: int,
    style: Style = Style(),
    problems_only: bool = False,
    cpu: str = "",
) -> str:
    """The table of `findings` worst first, then a blank line, the `cpu` line when given, and the verdict (which
    counts every finding, also those `problems_only` leaves out)."""
    ordered = sorted(findings, key=lambda f: SEVERITY[f.status])  # stable: the snapshot's order within a status
    shown = [f for f in ordered if f.status in PROBLEMS] if problems_only else ordered
    cols = _columns(shown, style.width)
    header = f"{'STATUS':<{cols.mark}}  {'CHECK':<{cols.check}}  {'SUBJECT':<{cols.subject}}  "
    header += f"{'REASON':<{cols.reason}}  MESSAGE"
    lines = [header[: style.width].rstrip()] if shown or not problems_only else []
    for finding in shown:
        lines.extend(_row(finding, cols, style))
    counts = {status: sum(1 for f in findings if f.status == status) for status in SEVERITY}
    if lines:
        lines.append("")
    if cpu and lines:  # a ready node with --problems is the verdict alone
        lines += [cpu[: style.width], ""]
    lines += verdict_lines(node, ready, blocking, counts, style)
    return "\n".join(lines)
