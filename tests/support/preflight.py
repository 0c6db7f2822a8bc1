"""Running deploy/examples/preflight.sh as a job would: in a given shell, with only the environment given."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass

from support.netservers import Netns
from support.system import REPO, require_tool

SCRIPT = REPO / "deploy" / "examples" / "preflight.sh"
# GitHub's runner runs a job hook as `bash -e`; /bin/sh is dash on Debian, busybox sh in Alpine-based images.
SHELLS = ["sh", "dash", "busybox", "bash", "bash -e"]


@dataclass(frozen=True)
class Outcome:
    code: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def lines(self) -> list[str]:
        return self.stdout.splitlines()


def shell_argv(shell: str) -> list[str]:
    require_tool("curl")
    if shell == "busybox":
        return [require_tool("busybox"), "sh", str(SCRIPT)]
    name, *options = shell.split()
    return [require_tool(name), *options, str(SCRIPT)]


def preflight(env: dict[str, str], shell: str = "dash", netns: Netns | None = None) -> Outcome:
    """Run the script with only `env` (and PATH): nothing of this machine's environment leaks in."""
    argv = shell_argv(shell)
    if netns is not None:
        argv = ["ip", "netns", "exec", netns.name, *argv]
    started = time.monotonic()
    done = subprocess.run(
        argv, env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=60, cwd="/"
    )
    return Outcome(done.returncode, done.stdout, done.stderr, time.monotonic() - started)
