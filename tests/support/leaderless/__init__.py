"""A real process whose main thread has exited (leaderless.c, built with gcc): it holds device nodes, a file and a
listening socket in its one live thread, and maps a device node with no fd left; /proc/PID/fd and /proc/PID/maps
of its leader (a zombie) read empty."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from support.processes import stop
from support.system import require_tool

SOURCE = Path(__file__).resolve().parent / "leaderless.c"


def build(directory: Path) -> Path:
    """Compile leaderless.c into `directory` (gcc must be there: the test is skipped, or fails in CI, without)."""
    gcc = require_tool("gcc")
    target = directory / "leaderless"
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [gcc, "-Wall", "-Wextra", "-Werror", "-O1", "-pthread", "-o", str(target), str(SOURCE)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return target


@dataclass(frozen=True)
class Leaderless:
    process: subprocess.Popen[bytes]
    port: int  # the TCP port of 127.0.0.1 it listens on

    @property
    def pid(self) -> int:
        return self.process.pid


def _leader_gone(pid: int) -> bool:
    """The leader is a zombie and its fd table reads empty, while another thread lives."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    threads = [line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Threads:")]
    return (
        stat[stat.rfind(")") + 2] == "Z" and threads != ["Threads:\t1"] and not list(Path(f"/proc/{pid}/fd").iterdir())
    )


@contextlib.contextmanager
def leaderless(directory: Path, mapped: Path | None, *held: Path) -> Iterator[Leaderless]:
    """The built helper started holding `held` open and `mapped` mapped; yielded once its leader has exited."""
    binary = build(directory)
    argv = [str(binary), str(mapped) if mapped is not None else "-", *map(str, held)]
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.strip().isdigit(), f"leaderless did not start: {line!r}, exit {process.poll()}"
        deadline = time.monotonic() + 60
        while not _leader_gone(process.pid):  # the main thread exits just after printing
            assert time.monotonic() < deadline, "the leader of leaderless did not exit"
            time.sleep(0.01)
        yield Leaderless(process, int(line))
    finally:
        stop(process)
