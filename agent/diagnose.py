"""`node-health diagnose PID`: print the classified py-spy stack dump of a stuck process (probes.runtime.pyspy).

The dump is the tenant's: its thread names, file names and locals are printed escaped (probes/text.py).
"""

from __future__ import annotations

import json
import sys

from probes.runtime.pyspy import BLOCKED_IO, FILEBATON_WAIT, IDLE_EVENT_LOOP, LOCK_WAIT, Diagnosis, diagnose
from probes.text import escape, escape_value

_HINTS = {
    FILEBATON_WAIT: "if no live process holds the lock (fuser {lock}; node-health check --only storage.locks), "
    "remove it: rm {lock}; the waiting job then continues",
    LOCK_WAIT: "find the holder (fuser {lock}; cat /proc/locks); if none lives, remove the stale lock file",
    IDLE_EVENT_LOOP: "the loop waits on something outside this process: check the engine core / worker processes "
    "(node-health diagnose on each, py-spy dump --pid) and the devices they use",
    BLOCKED_IO: "look at what the thread reads from (ls -l /proc/{pid}/fd); a hung mount shows in "
    "node-health check --only storage",
}


def format_diagnosis(d: Diagnosis) -> str:
    """A readable report: classification, hint, then every thread's stack (innermost first)."""
    lines = [f"PID {d.pid}: {d.kind}" + (f" — {d.detail}" if d.detail else "")]
    if d.error:
        return escape(lines[0])
    if d.reason:
        lines.append(f"reason: {d.reason}")
    hint = _HINTS.get(d.kind)
    if hint:
        lines.append("hint: " + hint.format(lock=d.lock_path or "<lock path>", pid=d.pid))
    for thread in d.threads:
        state = "active" if thread.active else "idle"
        kernel = ""
        if thread.kernel_state or thread.wchan:
            kernel = f", kernel {thread.kernel_state or '?'}" + (f" in {thread.wchan}" if thread.wchan else "")
        lines.append("")
        lines.append(f"Thread {thread.label} [{state}{', holds GIL' if thread.owns_gil else ''}{kernel}]")
        for frame in thread.frames:
            lines.append(f"    {frame.where()}")
            for name, value in frame.locals.items():
                lines.append(f"        {name} = {value}")
    return "\n".join(escape(line) for line in lines)


def main_diagnose(pid: int, as_json: bool, timeout: float = 10.0, py_spy: str = "py-spy") -> int:
    """CLI entry (node-health diagnose PID): 0 classified, 1 process not found or py-spy failed, 2 bad input."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        print(f"node-health diagnose: PID must be a positive integer, got {pid!r}", file=sys.stderr)
        return 2
    diagnosis = diagnose(pid, timeout, py_spy=py_spy)
    if as_json:
        print(json.dumps(escape_value(diagnosis.to_dict()), indent=2, default=str))
    elif diagnosis.error:
        print(f"node-health diagnose: PID {pid}: {escape(diagnosis.error)}", file=sys.stderr)
    else:
        print(format_diagnosis(diagnosis))
    return 1 if diagnosis.error else 0
