#!/usr/bin/env python3
"""Build (or find cached) a real Kubernetes control plane for the realkube test tier.

For each release asked for (a minor such as ``1.37``, or an exact ``v1.36.3``) this builds ``kube-apiserver`` and
``kube-controller-manager`` from the ``k8s.io/kubernetes`` module and ``etcd`` from ``go.etcd.io/etcd/server/v3``
at the version that release's go.mod requires, in a throwaway module whose ``replace`` lines pin every staging
module ``k8s.io/*`` to the same release. A minor resolves to the newest patch release the Go module proxy serves
(without a proxy answer: the newest one already cached).

Cache layout, under ``$NODE_HEALTH_CI_CACHE`` (default ``/var/cache/node-health-ci``)::

    control-plane/<version>/{etcd,kube-apiserver,kube-controller-manager,build.json}
    control-plane/.lock          one build at a time (flock)
    go/mod, go/build             GOMODCACHE and GOCACHE, kept between runs

``build.json`` is written last, so a directory without it is an unfinished build and is built again.

Usage: ``python3 scripts/control_plane.py [--print-dir] 1.37 1.36``; exit 0 with every release built, 1 when a
build failed, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

DEFAULT_CACHE = "/var/cache/node-health-ci"
DEFAULT_RELEASES = ("1.37", "1.36")
GO = os.environ.get("NODE_HEALTH_GO", "/usr/local/go/bin/go")
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager")
MARKER = "build.json"
_VERSION = re.compile(r"^v(\d+)\.(\d+)\.(\d+)$")
_STAGING = re.compile(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/src/")
_ETCD = re.compile(r"^\s*go\.etcd\.io/etcd/server/v3\s+(v\S+)")


def cache_root() -> Path:
    return Path(os.environ.get("NODE_HEALTH_CI_CACHE") or DEFAULT_CACHE)


def release_dir(version: str) -> Path:
    return cache_root() / "control-plane" / version


def _proxy() -> str:
    first = os.environ.get("GOPROXY", "https://proxy.golang.org").split(",")[0].split("|")[0]
    return first if first.startswith("http") else "https://proxy.golang.org"


def _fetch(path: str) -> str:
    with urllib.request.urlopen(f"{_proxy().rstrip('/')}/{path}", timeout=30) as answer:
        return str(answer.read().decode())


def _newest(versions: list[str], minor: str) -> str | None:
    major, _, mnr = minor.partition(".")
    matching = []
    for version in versions:
        found = _VERSION.match(version.strip())
        if found and found.group(1) == major and found.group(2) == mnr:
            matching.append((int(found.group(3)), version.strip()))
    return max(matching)[1] if matching else None


def cached_versions() -> list[str]:
    root = cache_root() / "control-plane"
    if not root.is_dir():
        return []
    return [p.name for p in root.iterdir() if (p / MARKER).is_file()]


def resolve(release: str) -> str:
    """An exact version for ``release``: itself when exact, else the proxy's newest patch, else the cache's."""
    if _VERSION.match(release):
        return release
    if not re.fullmatch(r"\d+\.\d+", release):
        raise ValueError(f"release {release!r} is neither a minor (1.37) nor a version (v1.37.2)")
    try:
        found = _newest(_fetch("k8s.io/kubernetes/@v/list").split(), release)
    except OSError:
        found = None
    found = found or _newest(cached_versions(), release)
    if found is None:
        raise LookupError(f"no k8s.io/kubernetes {release}.x on {_proxy()} and none cached")
    return found


def find(release: str) -> Path | None:
    """The cached directory holding every binary for ``release`` (newest cached patch of a minor), or None."""
    version = release if _VERSION.match(release) else _newest(cached_versions(), release)
    if version is None:
        return None
    where = release_dir(version)
    if (where / MARKER).is_file() and all((where / name).is_file() for name in BINARIES):
        return where
    return None


def _go_mod(version: str, kubernetes_mod: str) -> tuple[str, str]:
    staging = [m.group(1) for m in map(_STAGING.match, kubernetes_mod.splitlines()) if m]
    etcd = next((m.group(1) for m in map(_ETCD.match, kubernetes_mod.splitlines()) if m), None)
    if not staging or etcd is None:
        raise LookupError(f"k8s.io/kubernetes {version} go.mod names no staging modules or no etcd server")
    go_line = next((line for line in kubernetes_mod.splitlines() if line.startswith("go ")), "go 1.26.0")
    staging_version = "v0." + version.split(".", 1)[1]
    lines = ["module node-health.invalid/controlplane", "", go_line, "", "require ("]
    lines += [f"\tk8s.io/kubernetes {version}", f"\tgo.etcd.io/etcd/server/v3 {etcd}", ")", "", "replace ("]
    lines += [f"\t{module} => {module} {staging_version}" for module in staging]
    lines += [")", ""]
    return "\n".join(lines), etcd


def _ldflags(version: str) -> str:
    found = _VERSION.match(version)
    assert found is not None
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    values = {
        "gitVersion": version,
        "gitMajor": found.group(1),
        "gitMinor": found.group(2),
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": date,
    }
    flags = ["-s", "-w"]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X '{package}.{key}={value}'" for key, value in values.items()]
    return " ".join(flags)


def _environment() -> dict[str, str]:
    root = cache_root() / "go"
    env = dict(os.environ)
    env.update(
        GOMODCACHE=str(root / "mod"),
        GOCACHE=str(root / "build"),
        GOTOOLCHAIN="local",
        CGO_ENABLED="0",
        GOFLAGS="-buildvcs=false -mod=mod -p=" + os.environ.get("NODE_HEALTH_BUILD_JOBS", "2"),
        # A 1.36 apiserver built with the jsonv2 experiment on serves broken OpenAPI; off for every release.
        GOEXPERIMENT="nojsonv2",
    )
    return env


def _run(argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> None:
    with log.open("a") as out:
        out.write("$ " + " ".join(argv) + "\n")
        out.flush()
        done = subprocess.run(["nice", "-n", "10", *argv], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"{' '.join(argv)} failed (exit {done.returncode}):\n" + "\n".join(tail))


def build(version: str) -> Path:
    """Build ``version``'s three binaries into the cache unless they are there already; return the directory."""
    target = release_dir(version)
    ready = find(version)
    if ready is not None:
        return ready
    kubernetes_mod = _fetch(f"k8s.io/kubernetes/@v/{version}.mod")
    go_mod, etcd = _go_mod(version, kubernetes_mod)
    env = _environment()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"control-plane-{version}-") as scratch:
        work = Path(scratch)
        (work / "go.mod").write_text(go_mod)
        (work / "tools.go").write_text(
            "//go:build tools\n\npackage tools\n\nimport (\n"
            '\t_ "go.etcd.io/etcd/server/v3"\n\t_ "k8s.io/kubernetes/cmd/kube-apiserver"\n'
            '\t_ "k8s.io/kubernetes/cmd/kube-controller-manager"\n)\n'
        )
        log = work / "build.log"
        out = work / "bin"
        _run([GO, "mod", "tidy", "-e"], work, env, log)
        ldflags = _ldflags(version)
        packages = {
            "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
            "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
            "etcd": "go.etcd.io/etcd/server/v3",
        }
        for name, package in packages.items():
            _run([GO, "build", "-trimpath", "-ldflags", ldflags, "-o", str(out / name), package], work, env, log)
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        for name in BINARIES:
            shutil.copy2(out / name, target / name)
        shutil.copy2(work / "go.mod", target / "go.mod")
    record = {"version": version, "etcd": etcd, "go": _go_version(env), "seconds": round(time.monotonic() - started)}
    (target / MARKER).write_text(json.dumps(record, indent=1) + "\n")
    return target


def _go_version(env: dict[str, str]) -> str:
    done = subprocess.run([GO, "env", "GOVERSION"], env=env, capture_output=True, text=True, check=False)
    return done.stdout.strip()


def ensure(releases: list[str]) -> dict[str, Path]:
    """Every release built or found, one build at a time across processes."""
    lock_path = cache_root() / "control-plane" / ".lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    built: dict[str, Path] = {}
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for release in releases:
            built[release] = build(resolve(release))
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="*", default=list(DEFAULT_RELEASES), help="minors or exact versions")
    parser.add_argument("--print-dir", action="store_true", help="print each release's directory")
    args = parser.parse_args(argv)
    try:
        for release in args.releases:
            resolve(release) if _VERSION.match(release) else None
    except ValueError as error:
        print(f"control_plane: {error}", file=sys.stderr)
        return 2
    try:
        built = ensure(args.releases)
    except (RuntimeError, LookupError, OSError, ValueError) as error:
        print(f"control_plane: {error}", file=sys.stderr)
        return 1
    for release, where in built.items():
        record = json.loads((where / MARKER).read_text())
        print(f"{release}: {where}" if args.print_dir else f"{release}: {record['version']} ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
