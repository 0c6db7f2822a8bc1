"""The README's set-up, as written, on a fresh Debian 12: the commands of its first shell block run in a
debian:bookworm-slim container (with python3, which a Debian 12 install has and the -slim image does not) on a
copy of this checkout, as root (so `sudo` is left out). pip inside the venv installs the agent, and `node-health
check` prints its table and verdict; pip outside a venv is refused there (PEP 668), which is why the README says
to make one.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from support.podman import CACHE, build_volumes, ensure_base_image, podman, ulimits
from support.system import REPO, require_root, require_tool

pytestmark = [pytest.mark.system, pytest.mark.timeout(1800)]


def readme_setup() -> list[str]:
    (block,) = re.findall(r"## Set up\n.*?```sh\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_setup_works_on_a_fresh_debian_12(tmp_path: Path) -> None:
    require_root()
    require_tool("podman")
    CACHE.mkdir(parents=True, exist_ok=True)
    base = ensure_base_image()
    commands = readme_setup()
    assert commands[0].startswith("sudo apt-get install -y python3-venv"), commands
    assert any("python3 -m venv" in command for command in commands), "a venv before pip install"
    source = tmp_path / "src"
    source.mkdir()
    for name in ("agent", "probes"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    script = "\n".join(
        [
            "set -eu",
            "apt-get update -qq && apt-get install -y -qq --no-install-recommends python3 >/dev/null",
            # Debian 12's own pip refuses to install outside a venv: what the README's venv line is for.
            "apt-get install -y -qq --no-install-recommends python3-pip >/dev/null",
            "if pip3 install --quiet . 2>/tmp/pep668; then echo 'pip outside a venv worked'; exit 9; fi",
            "grep -q externally-managed-environment /tmp/pep668",
            "cp -r /src /work && cd /work",
            *(command.removeprefix("sudo ") for command in commands[:-1]),
            # The last line: install, then the check, whose exit status is 0 ready or 1 not ready.
            commands[-1].replace("&& node-health check", "&& { node-health check && echo exit=0 || echo exit=$?; }"),
        ]
    )
    work = tmp_path / "pip"
    work.mkdir()
    done = podman(
        "run", "--rm", *ulimits(), "--network=host", *build_volumes(work), "-v", f"{source}:/src:ro",
        "--env", "DEBIAN_FRONTEND=noninteractive", "--env", "PIP_DISABLE_PIP_VERSION_CHECK=1",
        base, "sh", "-c", script, timeout=1500, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] in ("exit=0", "exit=1"), lines[-5:]
    assert re.match(r"node \S+: (READY|NOT READY)", lines[-2]), lines[-5:]
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("STATUS ")) : -1]
    assert max(len(line) for line in table) <= 120, max(table, key=len)
