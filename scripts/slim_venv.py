#!/usr/bin/env python3
"""Slim the image's venv (Dockerfile, build stage): run with the venv's own interpreter after `pip install .`.

    /opt/node-health/bin/python scripts/slim_venv.py

What goes, and why it may (docs/image.md, Slimming):
- `kubernetes/aio`, the client's asyncio copy (~70 MB), and the aiohttp stack only it imports: the agent uses the
  synchronous client through its ApiClient (agent/kube/client.py);
- the source of the client's generated API and model modules (~55 MB), kept as bytecode beside where it was, so
  the same imports work;
- pip and setuptools, not needed at run time;
- the `tzdata` wheel (python-dateutil's fallback time zone database): the image has Debian's /usr/share/zoneinfo,
  and the agent only ever formats UTC;
- the test suites some packages ship inside their import package (`regex/tests`, `websocket/tests`...), which
  nothing imports.

The layout of the `kubernetes` package is the client's own and may change in any release, so pyproject.toml pins
the range this was proven against (`kubernetes>=37,<38`), and tests/deploy/test_slimming.py proves it again on the
installed client: slimmed the same way (slim_kubernetes below), with aiohttp blocked, the agent reconciles a Node
on the Kubernetes API double. Raising the upper bound means running that test with the new client. The import
check at the end stops the build when something the agent imports went.
"""

from __future__ import annotations

import compileall
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

# Imported only by kubernetes.aio (and each other): uninstalled with it.
AIOHTTP_STACK = (
    "aiohttp",
    "aiohttp-retry",
    "aiosignal",
    "aiohappyeyeballs",
    "frozenlist",
    "multidict",
    "propcache",
    "yarl",
)
# The generated modules whose source is replaced by bytecode.
GENERATED = ("client/api", "client/models")
# What the agent and its Kubernetes client import; every probe is imported through all_probes().
IMPORT_CHECK = ("agent.cli", "agent.daemon", "agent.kube", "kubernetes.client", "kubernetes.config", "kubernetes.watch")


def slim_kubernetes(package: Path) -> list[str]:
    """Remove kubernetes/aio and keep only bytecode of the generated modules, in the package directory given;
    returns what was done, one line each. A part the client no longer has is reported, not an error (the import
    check and the slimming test decide whether the result works)."""
    done = []
    aio = package / "aio"
    if aio.is_dir():
        shutil.rmtree(aio)
        done.append(f"removed {aio}")
    else:
        done.append(f"no {aio} (nothing to remove)")
    for relative in GENERATED:
        directory = package / relative
        if not directory.is_dir():
            done.append(f"no {directory} (nothing to compile)")
            continue
        if not compileall.compile_dir(str(directory), quiet=1, legacy=True, workers=0):
            raise SystemExit(f"compileall failed in {directory}")
        removed = 0
        for path in sorted(directory.rglob("*"), reverse=True):
            if path.name == "__pycache__" and path.is_dir():
                shutil.rmtree(path)
            elif path.suffix == ".py" and path.with_suffix(".pyc").is_file():
                path.unlink()
                removed += 1
        done.append(f"{directory}: {removed} modules kept as bytecode only")
    return done


def remove_bundled_tests(site_packages: Path) -> list[str]:
    """Remove `<package>/tests` directories of the installed packages (the agent's own packages have none)."""
    done = []
    for tests in sorted(site_packages.glob("*/tests")):
        if tests.is_dir() and (tests.parent / "__init__.py").is_file():
            shutil.rmtree(tests)
            done.append(f"removed {tests}")
    return done


def pip_uninstall(*names: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "uninstall", "--yes", "--quiet", "--disable-pip-version-check", *names],
        check=True,
    )


def import_check() -> None:
    """In a fresh interpreter: this one must not have imported anything before the slimming."""
    code = f"import {', '.join(IMPORT_CHECK)}, probes; probes.all_probes()"
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")  # the installed package, not the sources


def main() -> int:
    spec = importlib.util.find_spec("kubernetes")  # located, not imported
    if spec is None or spec.origin is None:
        raise SystemExit("the kubernetes client is not installed in this environment")
    package = Path(spec.origin).parent
    print(f"kubernetes at {package}")
    for line in slim_kubernetes(package):
        print(line)
    pip_uninstall(*AIOHTTP_STACK, "tzdata")
    for line in remove_bundled_tests(package.parent):
        print(line)
    import_check()
    pip_uninstall("pip", "setuptools")
    return 0


if __name__ == "__main__":
    sys.exit(main())
