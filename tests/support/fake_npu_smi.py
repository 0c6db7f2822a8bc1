#!/usr/bin/env python3
"""A stand-in for `npu-smi` that answers from a JSON spec, for tests that drive the npu probe end to end.

    fake_npu_smi.py SPEC.json [npu-smi arguments...]

SPEC: {"responses": {"info": R, "info -m": R, "info -t health -i 0 -c 0": R, ...}, "default": R,
       "log": "/path/calls.log"}
R:    {"stdout": str, "stdout_file": path, "stderr": str, "rc": int, "sleep": seconds}

The arguments joined by single spaces pick the response; unknown ones get "default" (else the usage error
npu-smi prints). Every call is appended to "log" (one line of arguments) when set.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

USAGE_ERROR = "Error parameter of -t\nUsage: npu-smi info <watch|proc|-h|-m|-l|-t type> [Options...]\n"


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    args = " ".join(argv[2:])
    if spec.get("log"):
        with open(spec["log"], "a") as log:
            log.write(args + "\n")
    response = spec.get("responses", {}).get(args, spec.get("default"))
    if response is None:
        sys.stderr.write(USAGE_ERROR)
        return 1
    if response.get("sleep"):
        time.sleep(float(response["sleep"]))
    stdout = response.get("stdout", "")
    if response.get("stdout_file"):
        stdout = Path(response["stdout_file"]).read_text()
    sys.stdout.write(stdout)
    sys.stdout.flush()
    sys.stderr.write(response.get("stderr", ""))
    return int(response.get("rc", 0))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
