"""/proc/PID/stat, parsed in one place (proc(5)): the task name, the state letter, the start time and the CPU
time.

The task name (field 2, in parentheses) is whatever the process set (prctl PR_SET_NAME, the executable's
name): it may hold spaces and ')', so the fields after it are split at the last ')'. Pure and import-free
beyond the standard library: the forked /proc/*/fd scanners call it too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProcStat:
    comm: str  # field 2: the kernel's task name, at most 15 characters
    state: str  # field 3: R running, S sleeping, D uninterruptible, Z zombie, T stopped...
    # Field 22: clock ticks from boot to the process's start. PIDs are reused; (pid, start_time) never is.
    start_time: int
    # Fields 14 and 15: clock ticks the process has run in user and kernel mode (whether it makes progress).
    cpu_ticks: int = 0


def parse_stat(text: str) -> ProcStat:
    """One /proc/PID/stat line → ProcStat; ValueError when it is not one (a process exiting mid-read leaves
    a truncated or empty file)."""
    open_paren = text.find("(")
    close_paren = text.rfind(")")
    if open_paren < 0 or close_paren < open_paren:
        raise ValueError(f"not a /proc/PID/stat line: {text[:80]!r}")
    fields = text[close_paren + 1 :].split()  # fields[0] is field 3
    if len(fields) < 20:
        raise ValueError(f"/proc/PID/stat has {len(fields) + 2} fields, need 22")
    return ProcStat(text[open_paren + 1 : close_paren], fields[0], int(fields[19]), int(fields[11]) + int(fields[12]))


def state_of(text: str) -> str:
    """The state letter of a /proc/PID/stat line; "" when the text is not one (the process is gone)."""
    try:
        return parse_stat(text).state
    except ValueError:
        return ""
