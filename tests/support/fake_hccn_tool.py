#!/usr/bin/env python3
"""A stand-in for `hccn_tool` that serves the sourced outputs of tests/fixtures/hccn_tool/ per chip, for tests
and benchmarks that drive npu.roce end to end, and the helper (FakeHccn) that sets it up.

    fake_hccn_tool.py SPEC.json -i N -VERB -g

SPEC: {"chips": {"N": {"VERB": R, ...}}, "default": {"VERB": R}, "log": path}
R:    {"file": fixture name, "stdout": str, "rc": int, "sleep": seconds, "count": link up count}

A chip's own response wins over the default. `[devid 0]` / `[device 0]` prefixes are rewritten to the chip's
id; "count" rewrites the `link up count` value. Every call is appended to "log" when set.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hccn_tool"
USAGE = "hccn_tool: invalid option\nUsage: hccn_tool -i <device_id> -<verb> -g\n"


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    args = argv[2:]
    if spec.get("log"):
        with open(spec["log"], "a") as log:
            log.write(" ".join(args) + "\n")
    if len(args) != 4 or args[0] != "-i" or args[3] != "-g":
        sys.stderr.write(USAGE)
        return 1
    chip, verb = args[1], args[2].lstrip("-")
    response = spec.get("chips", {}).get(chip, {}).get(verb) or spec.get("default", {}).get(verb)
    if response is None:
        sys.stderr.write(USAGE)
        return 1
    if response.get("sleep"):
        time.sleep(float(response["sleep"]))
    text = response.get("stdout", "")
    if response.get("file"):
        text = (FIXTURES / response["file"]).read_text()
    text = re.sub(r"\[(devid|device) 0\]", rf"[\g<1> {chip}]", text)
    if "count" in response:
        text = re.sub(r"(link up count\s*:\s*)\d+", rf"\g<1>{int(response['count'])}", text)
    sys.stdout.write(text)
    sys.stdout.flush()
    return int(response.get("rc", 0))


# --- the test side ---------------------------------------------------------------------------------

HEALTHY: dict[str, dict[str, Any]] = {
    "link": {"file": "link-up-doc.txt"},
    "link_stat": {"file": "link_stat-devid-faultdiag.txt"},
    "net_health": {"file": "net_health-success-doc.txt"},
    "optical": {"file": "optical-present-healthy-DERIVED.txt"},
    "ip": {"file": "ip-configured-faultdiag.txt"},
    "gateway": {"file": "gateway-format-unverified.txt"},
}


class FakeHccn:
    """A fake `hccn_tool` executable in root/bin (put it on PATH or in npu.hccn_command)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        self.spec = root / "hccn-spec.json"
        self.log = root / "hccn-calls.log"
        self.tool = self.bin / "hccn_tool"
        self.tool.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" "{self.spec}" "$@"\n')
        self.tool.chmod(0o755)
        self.serve({})

    def serve(
        self, chips: dict[int, dict[str, dict[str, Any]]], default: dict[str, dict[str, Any]] | None = None
    ) -> None:
        """Every chip answers `default` (the healthy outputs) but for the verbs `chips` names."""
        spec = {
            "chips": {str(n): verbs for n, verbs in chips.items()},
            "default": HEALTHY if default is None else default,
            "log": str(self.log),
        }
        tmp = self.spec.with_suffix(".tmp")
        tmp.write_text(json.dumps(spec))
        os.replace(tmp, self.spec)
        self.log.write_text("")

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
