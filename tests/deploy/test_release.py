"""scripts/release.py, run as docs/release.md says, in a copy of this checkout against a real registry (Debian's
docker-registry, the CNCF distribution server, on 127.0.0.1): it refuses without the CHANGELOG section or with
uncommitted changes; then it builds amd64 and arm64 (arm64 under qemu-user-static through binfmt_misc), pushes one
manifest list by version, and pins its digest in deploy/kustomization.yaml and the cleanup Job, commits and tags.
Checked from the registry with skopeo: both platforms, the OCI labels of each; the arm64 image, pulled by digest,
runs (`node-health --version` under qemu); `kubectl kustomize` renders the DaemonSet with
`<registry>:<version>@<digest>`.

Slow (a cold arm64 build under emulation takes minutes); podman's layer cache and the base tarballs under
$NODE_HEALTH_CI_CACHE keep later runs short.
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml
from support.podman import BASE_IMAGE, CACHE, build_volumes, ensure_base_image, podman, ulimits
from support.processes import answers_200, free_port, serving
from support.system import REPO, require, require_root, require_tool

from agent.version import __version__

pytestmark = [pytest.mark.system, pytest.mark.timeout(3600)]

ARM64_BASE = "localhost/node-health-base:bookworm-slim-arm64"
PODMAN_OPTIONS = ["--runtime", "runc", "--cgroup-manager", "cgroupfs"]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A registry of its own on 127.0.0.1 (plain HTTP), as `host:port`."""
    binary = require_tool("docker-registry")
    work = tmp_path_factory.mktemp("registry")
    address = f"127.0.0.1:{free_port()}"
    config = {
        "version": 0.1,
        "storage": {"filesystem": {"rootdirectory": str(work / "data")}},
        "http": {"addr": address},
    }
    (work / "config.yml").write_text(yaml.safe_dump(config))
    argv = [binary, "serve", str(work / "config.yml")]
    with serving(argv, lambda: answers_200(f"http://{address}/v2/"), work / "log", "the registry"):
        yield address


def git(checkout: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """This checkout's files (tracked, and untracked ones git does not ignore) as a fresh repository with one
    commit: the release commits and tags there, never here."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.split(b"\0")
    copy = tmp_path / "node-health"
    for name in filter(None, (entry.decode() for entry in listed)):
        source = REPO / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    git(copy, "init", "--quiet")
    git(copy, "-c", "user.name=t", "-c", "user.email=t@example.com", "add", "-A")
    git(copy, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "--quiet", "-m", "before the release")
    git(copy, "config", "user.name", "Release Test")
    git(copy, "config", "user.email", "release@example.com")
    return copy


def release(checkout: Path, *args: str, timeout: float = 3000) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(checkout / "scripts" / "release.py"), *args],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def date_the_changelog(checkout: Path) -> None:
    """Step 1 of docs/release.md: the [Unreleased] section becomes the release's."""
    changelog = checkout / "CHANGELOG.md"
    today = datetime.date.today().isoformat()
    changelog.write_text(changelog.read_text().replace("## [Unreleased]", f"## [{__version__}] - {today}", 1))
    git(checkout, "commit", "--quiet", "-am", f"CHANGELOG: {__version__}")


def test_release_refuses_without_its_changelog_section_or_with_changes(checkout: Path) -> None:
    refused = release(checkout, "--registry", "127.0.0.1:1/node-health")
    assert refused.returncode == 2, refused.stderr
    assert f"CHANGELOG.md has no section '## [{__version__}] - YYYY-MM-DD'" in refused.stderr
    date_the_changelog(checkout)
    (checkout / "README.md").write_text("changed\n")
    refused = release(checkout, "--registry", "127.0.0.1:1/node-health")
    assert refused.returncode == 2 and "uncommitted changes" in refused.stderr, refused.stderr


def binfmt_runs_arm64() -> bool:
    entry = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    return entry.is_file() and entry.read_text().startswith("enabled")


def skopeo(*args: str) -> Any:
    done = subprocess.run([require_tool("skopeo"), *args], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_release_builds_both_architectures_pushes_and_pins_the_digest(
    checkout: Path, registry: str, tmp_path: Path
) -> None:
    require_root()
    require_tool("podman")
    require(binfmt_runs_arm64(), "binfmt_misc running aarch64 binaries (qemu-user-static, update-binfmts)")
    CACHE.mkdir(parents=True, exist_ok=True)
    ensure_base_image()
    ensure_base_image(ARM64_BASE, "arm64")
    date_the_changelog(checkout)
    repository = f"{registry}/node-health"
    work = tmp_path / "build"
    work.mkdir()
    build_options = ["--pull=never", "--network=host", *ulimits(), *build_volumes(work)]
    done = release(
        checkout,
        "--registry",
        repository,
        "--tls-verify",
        "false",
        "--base",
        f"amd64={BASE_IMAGE}",
        "--base",
        f"arm64={ARM64_BASE}",
        *(f"--podman-option={option}" for option in PODMAN_OPTIONS),
        *(f"--build-option={option}" for option in build_options),
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    kustomization = yaml.safe_load((checkout / "deploy" / "kustomization.yaml").read_text())
    (entry,) = [image for image in kustomization["images"] if image["name"] == "node-health"]
    digest = entry["digest"]
    assert entry == {"name": "node-health", "newName": repository, "newTag": __version__, "digest": digest}
    assert f"released node-health {__version__}: {repository}:{__version__}@{digest} (amd64, arm64)" in done.stdout

    # The registry holds one manifest list, by version and by digest, with both platforms.
    index = skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{repository}@{digest}")
    assert skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{repository}:{__version__}") == index
    platforms = sorted((m["platform"]["os"], m["platform"]["architecture"]) for m in index["manifests"])
    assert platforms == [("linux", "amd64"), ("linux", "arm64")]
    revision = git(checkout, "rev-parse", "HEAD~1")  # the release commit's parent: what was built
    source = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]["urls"]["Source"]
    for arch in ("amd64", "arm64"):
        inspected = skopeo("inspect", "--tls-verify=false", "--override-arch", arch, f"docker://{repository}@{digest}")
        assert inspected["Architecture"] == arch
        labels = inspected["Labels"]
        assert labels["org.opencontainers.image.version"] == __version__
        assert labels["org.opencontainers.image.revision"] == revision
        assert labels["org.opencontainers.image.source"] == source
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", labels["org.opencontainers.image.created"])

    # The arm64 image, pulled by digest, runs (emulated here).
    reference = f"{repository}@{digest}"
    podman("pull", "--quiet", "--tls-verify=false", "--arch", "arm64", reference, timeout=600)
    ran = podman(
        "run", "--rm", *ulimits(), "--arch", "arm64", "--network=none", "--entrypoint", "sh", reference,
        "-c", "node-health --version; python3 -c 'import platform; print(platform.machine())'",
    )  # fmt: skip
    assert ran.stdout.split("\n")[:2] == [f"node-health {__version__}", "aarch64"], ran.stdout

    # The manifests name it by digest; the release is committed and tagged.
    rendered = subprocess.run(
        [require_tool("kubectl"), "kustomize", str(checkout / "deploy")], capture_output=True, text=True, timeout=120
    )
    assert rendered.returncode == 0, rendered.stderr
    (daemonset,) = [d for d in yaml.safe_load_all(rendered.stdout) if d and d["kind"] == "DaemonSet"]
    images = {c["image"] for c in daemonset["spec"]["template"]["spec"]["containers"]}
    assert images == {f"{repository}:{__version__}@{digest}"}
    cleanup = (checkout / "deploy" / "examples" / "cleanup-job.yaml").read_text()
    assert f"image: {repository}:{__version__}@{digest}\n" in cleanup
    uninstall = subprocess.run(
        [require_tool("kubectl"), "kustomize", str(checkout / "deploy" / "uninstall")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert uninstall.returncode == 0, uninstall.stderr
    (job,) = [d for d in yaml.safe_load_all(uninstall.stdout) if d and d["kind"] == "Job"]
    assert {c["image"] for c in job["spec"]["template"]["spec"]["containers"]} == {
        f"{repository}:{__version__}@{digest}"
    }
    assert git(checkout, "log", "-1", "--format=%s") == f"Release {__version__}"
    assert git(checkout, "status", "--porcelain") == ""
    assert git(checkout, "rev-parse", f"v{__version__}^{{commit}}") == git(checkout, "rev-parse", "HEAD")
    assert digest in git(checkout, "tag", "-l", "--format=%(contents)", f"v{__version__}")
