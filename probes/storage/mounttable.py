"""The mount table: /proc/PID/mountinfo parsed, and which mount a path is on. Reading it never touches
the mounted filesystems, so it is safe while one of them hangs."""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from probes.base import ProbeContext, ProbeParseError
from probes.runtime.paths import normalize_host_path

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def decode_mount_field(text: str) -> str:
    """Undo the kernel's octal escapes in mountinfo fields (\\040 space, \\011 tab, \\012 newline, \\134 \\)."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), text)


@dataclass(frozen=True)
class MountEntry:
    mount_id: int
    parent_id: int
    major: int
    minor: int
    root: str
    mount_point: str
    options: str
    optional_fields: tuple[str, ...]
    fstype: str
    source: str
    super_options: str

    @property
    def dev(self) -> int:
        return os.makedev(self.major, self.minor)


def parse_mountinfo_line(line: str, number: int) -> MountEntry:
    """One mountinfo line: `id parent maj:min root mountpoint options [optional fields...] - fstype source super`."""
    fields = line.split(" ")
    try:
        separator = fields.index("-", 6)
    except ValueError:
        raise ProbeParseError(f"mountinfo line {number}: no ' - ' separator: {line[:120]!r}") from None
    if len(fields) < separator + 3:
        raise ProbeParseError(f"mountinfo line {number}: {len(fields)} fields: {line[:120]!r}")
    major_minor = fields[2].split(":")
    if len(major_minor) != 2:
        raise ProbeParseError(f"mountinfo line {number}: bad maj:min {fields[2]!r}")
    try:
        mount_id, parent_id = int(fields[0]), int(fields[1])
        major, minor = int(major_minor[0]), int(major_minor[1])
    except ValueError:
        raise ProbeParseError(f"mountinfo line {number}: bad ids or maj:min: {line[:120]!r}") from None
    return MountEntry(
        mount_id=mount_id,
        parent_id=parent_id,
        major=major,
        minor=minor,
        root=decode_mount_field(fields[3]),
        mount_point=decode_mount_field(fields[4]),
        options=fields[5],
        optional_fields=tuple(fields[6:separator]),
        fstype=fields[separator + 1],
        source=decode_mount_field(fields[separator + 2]),
        super_options=" ".join(fields[separator + 3 :]),
    )


def parse_mountinfo(text: str) -> list[MountEntry]:
    """/proc/PID/mountinfo → entries in file order (proc(5); kernel Documentation/filesystems/proc.rst 3.5)."""
    entries = [parse_mountinfo_line(line, number) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not entries:
        raise ProbeParseError("mountinfo is empty")
    return entries


def read_mount_table(ctx: ProbeContext, pid: int = 1) -> list[MountEntry]:
    """A mount namespace's table (pid 1's is the host's, hostPID in the DaemonSet). Never touches the mounts."""
    path = ctx.host.proc_path(pid, "mountinfo")
    return parse_mountinfo(path.read_text(errors="surrogateescape"))


def mount_at(entries: Sequence[MountEntry], path: str) -> MountEntry | None:
    """The mount visible at exactly `path` (the last one mounted there: mounts stack)."""
    wanted = normalize_host_path(path)
    found = None
    for entry in entries:
        if entry.mount_point == wanted:
            found = entry
    return found


def mount_containing(entries: Sequence[MountEntry], path: str, dev: int | None = None) -> MountEntry | None:
    """The mount a path lives on: by device number when one mount under the path's prefix has it, else the
    longest mount point that is a prefix of the path (the last mounted wins)."""
    wanted = normalize_host_path(path)

    def is_prefix(point: str) -> bool:
        return point == "/" or wanted == point or wanted.startswith(point + "/")

    candidates = [e for e in entries if is_prefix(e.mount_point)]
    if dev is not None:
        by_dev = [e for e in candidates if e.dev == dev]
        if by_dev:
            candidates = by_dev
    best: MountEntry | None = None
    for entry in candidates:
        if best is None or len(entry.mount_point) >= len(best.mount_point):
            best = entry
    return best


def fstype_matches(fstype: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(fstype, pattern) for pattern in patterns)
