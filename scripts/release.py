#!/usr/bin/env python3
"""Release node-health: build the image for amd64 and arm64, push it as one multi-arch manifest, pin its digest.

    python3 scripts/release.py --registry registry.example.com/platform/node-health

docs/release.md is the procedure around it. In order, this script:
1. reads the version from agent/version.py (the one place it is set), and refuses to go on unless CHANGELOG.md
   has its section (`## [0.2.0] - 2025-06-30`) and the git tree is clean;
2. builds the Dockerfile once per architecture with podman (`--platform linux/<arch>`; arm64 on an x86_64 host
   runs under qemu-user-static through binfmt_misc), with the OCI labels org.opencontainers.image.version,
   .revision (the commit), .source (pyproject.toml's Source URL) and .created (the commit's time, so that a
   rebuild of the same commit is labelled the same), into one manifest list;
3. pushes it as `<registry>:<version>` and reads back its digest;
4. pins that digest where the manifests name the image: deploy/kustomization.yaml and
   deploy/uninstall/kustomization.yaml (newName, newTag, digest: the DaemonSet's and the uninstall Job's image
   becomes `<registry>:<version>@sha256:...`) and deploy/examples/cleanup-job.yaml;
5. commits that as "Release <version>" and tags it `v<version>` (annotated); pushing the commit and the tag is
   left to you (`git push --follow-tags`).

Exit status: 0 released; 2 a precondition failed (the message says which), 1 a command failed.
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
ARCHES = ("amd64", "arm64")
KUSTOMIZATION = REPO / "deploy" / "kustomization.yaml"
UNINSTALL = REPO / "deploy" / "uninstall" / "kustomization.yaml"
CLEANUP_JOB = REPO / "deploy" / "examples" / "cleanup-job.yaml"


class Refused(Exception):
    """A precondition of the release does not hold."""


def run(argv: list[str], capture: bool = False) -> str:
    print("+", " ".join(argv), flush=True)
    done = subprocess.run(argv, cwd=REPO, text=True, stdout=subprocess.PIPE if capture else None)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, argv)
    return done.stdout if capture else ""


def version() -> str:
    match = re.search(r'^__version__ = "([^"]+)"$', (REPO / "agent" / "version.py").read_text(), re.MULTILINE)
    if match is None:
        raise Refused("agent/version.py has no __version__ line")
    return match.group(1)


def check_changelog(release: str) -> None:
    heading = re.compile(rf"^## \[{re.escape(release)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", re.MULTILINE)
    if not heading.search((REPO / "CHANGELOG.md").read_text()):
        raise Refused(
            f"CHANGELOG.md has no section '## [{release}] - YYYY-MM-DD': rename [Unreleased] to it (docs/release.md)"
        )


def check_clean_tree() -> None:
    if run(["git", "status", "--porcelain"], capture=True).strip():
        raise Refused("the git tree has uncommitted changes: a release is built from a commit")


def labels(release: str) -> dict[str, str]:
    source = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]["Source"]
    revision = run(["git", "rev-parse", "HEAD"], capture=True).strip()
    epoch = int(run(["git", "show", "-s", "--format=%ct", "HEAD"], capture=True).strip())
    created = datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"VERSION": release, "REVISION": revision, "SOURCE": source, "CREATED": created}


def build(podman: list[str], manifest: str, arch: str, args: argparse.Namespace, build_args: dict[str, str]) -> None:
    argv = [*podman, "build", "--platform", f"linux/{arch}", "--manifest", manifest, *args.build_option]
    for name, value in build_args.items():
        argv += ["--build-arg", f"{name}={value}"]
        # Also as --label: the Dockerfile's LABEL layer may come from podman's layer cache (a build by hand or a
        # test image with VERSION=unknown), and a --label is set on the built image whatever the cache held.
        argv += ["--label", f"org.opencontainers.image.{name.lower()}={value}"]
    if arch in args.base:
        argv += ["--build-arg", f"BASE={args.base[arch]}"]
    run([*argv, "--file", str(REPO / "Dockerfile"), str(REPO)])


def push(podman: list[str], manifest: str, target: str, tls_verify: bool) -> str:
    with tempfile.TemporaryDirectory() as work:
        digest_file = Path(work) / "digest"
        run(
            [
                *podman,
                "manifest",
                "push",
                "--all",
                f"--tls-verify={str(tls_verify).lower()}",
                "--digestfile",
                str(digest_file),
                manifest,
                f"docker://{target}",
            ]
        )
        digest = digest_file.read_text().strip()
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise Refused(f"podman reported no manifest digest ({digest!r})")
    return digest


def pin(registry: str, release: str, digest: str) -> None:
    """The manifests name the released image: by tag for people, by digest for the kubelet."""
    entry = f"  - name: node-health\n    newName: {registry}\n    newTag: {release}\n    digest: {digest}\n"
    for kustomization in (KUSTOMIZATION, UNINSTALL):
        text, count = re.subn(r"(?m)^  - name: node-health\n(?:    \S.*\n)*", entry, kustomization.read_text())
        if count != 1:
            where = kustomization.relative_to(REPO)
            raise Refused(f"{where} has no `images:` entry `- name: node-health`")
        kustomization.write_text(text)
    # Applied with `kubectl apply -f`, not through the kustomization: the whole reference.
    text, count = re.subn(
        r"(?m)^(\s+image: )\S*node-health:\S+$", rf"\g<1>{registry}:{release}@{digest}", CLEANUP_JOB.read_text()
    )
    if count != 1:
        raise Refused("deploy/examples/cleanup-job.yaml has no single `image: ...node-health:...` line")
    CLEANUP_JOB.write_text(text)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registry", required=True, help="image repository, e.g. registry.example.com/x/node-health")
    parser.add_argument("--arch", default=",".join(ARCHES), help="architectures (default: amd64,arm64)")
    parser.add_argument(
        "--base", action="append", default=[], metavar="ARCH=IMAGE", help="a local base image for ARCH (docs/image.md)"
    )
    parser.add_argument("--podman-option", action="append", default=[], help="a global podman option, repeatable")
    parser.add_argument("--build-option", action="append", default=[], help="a podman build option, repeatable")
    parser.add_argument("--tls-verify", choices=("true", "false"), default="true", help="for a registry without TLS")
    parser.add_argument("--no-git", action="store_true", help="pin the digest but do not commit or tag")
    args = parser.parse_args(argv)
    args.base = dict(item.split("=", 1) for item in args.base)
    args.arch = [arch.strip() for arch in args.arch.split(",") if arch.strip()]
    unknown = sorted(set(args.arch) - set(ARCHES))
    if unknown:
        parser.error(f"--arch: unknown {unknown}; known {list(ARCHES)}")
    return args


def release(args: argparse.Namespace) -> str:
    current = version()
    check_changelog(current)
    check_clean_tree()
    build_args = labels(current)
    podman = ["podman", *args.podman_option]
    manifest = f"localhost/node-health-release:{current}"
    subprocess.run([*podman, "manifest", "rm", manifest], cwd=REPO, capture_output=True)  # an earlier attempt
    run([*podman, "manifest", "create", manifest])
    for arch in args.arch:
        build(podman, manifest, arch, args, build_args)
    digest = push(podman, manifest, f"{args.registry}:{current}", args.tls_verify == "true")
    pin(args.registry, current, digest)
    if not args.no_git:
        run(
            [
                "git",
                "commit",
                "--quiet",
                "-m",
                f"Release {current}",
                "--",
                *map(str, (KUSTOMIZATION, UNINSTALL, CLEANUP_JOB)),
            ]
        )
        run(["git", "tag", "--annotate", f"v{current}", "-m", f"node-health {current}: {args.registry}@{digest}"])
    print(f"released node-health {current}: {args.registry}:{current}@{digest} ({', '.join(args.arch)})")
    return digest


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        release(args)
    except Refused as exc:
        print(f"release: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:
        print(f"release: {' '.join(map(str, exc.cmd))} failed with exit status {exc.returncode}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
