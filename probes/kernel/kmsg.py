"""/dev/kmsg: its record format and a non-blocking reader that keeps the file open between runs.

The reader opens /dev/kmsg once (O_RDONLY|O_NONBLOCK), starts at the end, and each run drains what is there
without blocking. Only kernel-facility records count: anyone may write a line to /dev/kmsg, and such lines
carry the user facility, so a process cannot raise a "GPU has fallen off the bus" problem by writing one.

Record format (Documentation/ABI/testing/dev-kmsg):
    PRI,SEQ,TS_USEC,FLAGS[,MORE...];MESSAGE\\n
    [ KEY=VALUE\\n]...
PRI is the syslog priority (facility << 3 | level); non-printable bytes of MESSAGE and of the KEY=VALUE
continuation lines are escaped as \\xHH. A read() returns one record; when the reader fell behind and records
were overwritten, read() fails once with EPIPE and the next read returns the oldest record still there.

The escapes are decoded only to put UTF-8 text back together: a control character (a task may name its file
with ESC sequences, and the kernel logs that name) is escaped again, so no message holds one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from probes.text import escape

KERNEL_FACILITY = 0
# The kernel refuses reads into a buffer smaller than one record (CONSOLE_EXT_LOG_MAX is 8 KiB).
READ_SIZE = 16384

# --- parsing -------------------------------------------------------------------------------------------

_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")


def _unescape(raw: bytes) -> str:
    return escape(_ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), raw).decode("utf-8", "replace"))


@dataclass(frozen=True)
class KmsgRecord:
    priority: int  # syslog PRI: facility << 3 | level
    sequence: int
    timestamp_usec: int  # since boot (the kernel's local clock)
    flags: str
    message: str
    properties: dict[str, str] = field(default_factory=dict)  # continuation lines: SUBSYSTEM=pci, DEVICE=+pci:...

    @property
    def facility(self) -> int:
        return self.priority >> 3

    @property
    def level(self) -> int:
        return self.priority & 7

    @property
    def from_kernel(self) -> bool:
        return self.facility == KERNEL_FACILITY


def parse_kmsg_record(data: bytes) -> KmsgRecord | None:
    """One /dev/kmsg record (as one read() returns it) → KmsgRecord; None when it is not in that format."""
    head, sep, rest = data.partition(b";")
    if not sep:
        return None
    fields = head.split(b",")
    if len(fields) < 4:
        return None
    try:
        priority = int(fields[0])
        sequence = int(fields[1])
        timestamp = int(fields[2])
    except ValueError:
        return None
    if priority < 0 or sequence < 0 or timestamp < 0:
        return None
    lines = rest.split(b"\n")
    properties: dict[str, str] = {}
    for line in lines[1:]:
        if not line.startswith(b" "):
            continue
        key, eq, value = line[1:].partition(b"=")
        if eq and key:
            properties[_unescape(key)] = _unescape(value)
    return KmsgRecord(
        priority=priority,
        sequence=sequence,
        timestamp_usec=timestamp,
        flags=fields[3].decode("ascii", "replace"),
        message=_unescape(lines[0]),
        properties=properties,
    )


def split_records(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Split a byte stream into records (a header line plus its ' KEY=VALUE' lines); returns (records, rest).

    /dev/kmsg hands out one record per read(); a regular file or FIFO in the same format gives arbitrary
    chunks, so the reader splits on line starts and keeps an unterminated tail for the next read.
    """
    records: list[bytes] = []
    end = buffer.rfind(b"\n")
    if end < 0:
        return records, buffer
    complete, rest = buffer[: end + 1], buffer[end + 1 :]
    current: list[bytes] = []
    for line in complete.split(b"\n")[:-1]:
        if line.startswith(b" ") and current:
            current.append(line)
            continue
        if current:
            records.append(b"\n".join(current))
        current = [line]
    if current:
        records.append(b"\n".join(current))
    return records, rest


# --- reading -------------------------------------------------------------------------------------------


@dataclass
class ReadResult:
    records: list[KmsgRecord]
    read: int = 0  # records read (all facilities)
    ignored: int = 0  # records of a non-kernel facility, or malformed
    overwritten: int = 0  # EPIPE: the ring buffer overwrote records before we read them
    truncated: bool = False  # stopped at max_records or the deadline with more to read


class KmsgReader:
    """A non-blocking reader of /dev/kmsg (or of a file in its format) that keeps its file open between runs."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._fd: int | None = None
        self._tail = b""

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def open(self) -> None:
        """Open and seek to the end, so only records logged from now on are read. Raises OSError."""
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.close(fd)
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), self.path)
        with contextlib.suppress(OSError):  # a FIFO cannot seek; it has no backlog either
            os.lseek(fd, 0, os.SEEK_END)
        self._fd = fd
        self._tail = b""

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
            self._tail = b""

    def fileno(self) -> int | None:
        return self._fd

    def read_available(self, max_records: int = 20000, deadline: float | None = None) -> ReadResult:
        """Read every record available now without blocking; only kernel-facility records are returned."""
        self.open()
        assert self._fd is not None
        result = ReadResult(records=[])
        while True:
            if result.read >= max_records or (deadline is not None and time.monotonic() >= deadline):
                result.truncated = True
                break
            try:
                chunk = os.read(self._fd, READ_SIZE)
            except BlockingIOError:
                break  # EAGAIN: nothing more for now
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    result.overwritten += 1
                    self._tail = b""
                    continue
                raise
            if not chunk:
                break  # a regular file at its end, or a FIFO with no writer
            raw_records, self._tail = split_records(self._tail + chunk)
            for raw in raw_records:
                result.read += 1
                record = parse_kmsg_record(raw)
                if record is None or not record.from_kernel:
                    result.ignored += 1
                    continue
                result.records.append(record)
        return result
