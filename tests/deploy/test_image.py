"""The container image: built from the Dockerfile with podman (runc, cgroupfs) on a debian:bookworm-slim made
here with debootstrap when it cannot be pulled, then run as the DaemonSet runs it — privileged, in the host's PID
namespace, the host's / read-only at /host, a read-only root filesystem — where `node-health check` names a
process this test started outside the container holding a mknod'ed device node. Also: the image's tools, size
and contents, `/ready` from the image answering deploy/examples/preflight.sh, and the runtime dependencies
resolving as binary wheels for aarch64 (Kunpeng hosts).

Cached between runs under $NODE_HEALTH_CI_CACHE (default /var/cache/node-health-ci): the base rootfs tarball
(tests/support/podman.py), and the built image (`podman save`), keyed by a hash of the whole build context; podman's
layer cache reuses the dependency layers while the Dockerfile and pyproject.toml stay the same.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.podman import CACHE, build_volumes, ensure_base_image, image_exists, podman, ulimits
from support.processes import free_port
from support.system import REPO, require, require_root, require_tool

from agent.version import __version__

pytestmark = [pytest.mark.system, pytest.mark.timeout(1800)]

IMAGE_REPOSITORY = "localhost/node-health"
# What the build context holds (.dockerignore lets in exactly these) plus the Dockerfile itself.
CONTEXT = ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "agent", "probes", "scripts/slim_venv.py")
SIZE_TARGET_BYTES = 200_000_000  # as `podman images` counts MB
IMAGE_DOC = REPO / "docs" / "image.md"
PREFLIGHT = REPO / "deploy" / "examples" / "preflight.sh"
FULL = (1, 7)  # /dev/full's device number: a real character device that opens anywhere


# --- the image -------------------------------------------------------------------------------------------------


def context_files() -> list[Path]:
    files: list[Path] = []
    for name in CONTEXT:
        path = REPO / name
        if path.is_dir():
            files.extend(
                sorted(
                    p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
                )
            )
        else:
            files.append(path)
    return files


def context_key() -> str:
    digest = hashlib.sha256()
    for path in context_files():
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


def build_image(tag: str) -> None:
    with tempfile.TemporaryDirectory() as work:
        podman(
            "build",
            "--pull=never",
            "--network=host",
            *ulimits(),
            *build_volumes(Path(work)),
            "--tag",
            tag,
            "--file",
            str(REPO / "Dockerfile"),
            str(REPO),
            timeout=1500,
        )


def forget_other_builds(tag: str, archive: Path) -> None:
    for old in CACHE.glob("node-health-image-*.tar"):
        if old != archive:
            old.unlink()
    listed = podman("images", "--format", "{{.Repository}}:{{.Tag}}", "--filter", f"reference={IMAGE_REPOSITORY}")
    for reference in listed.stdout.split():
        if reference.startswith(f"{IMAGE_REPOSITORY}:ci-") and reference != tag:
            podman("rmi", reference, check=False)


def ensure_image() -> str:
    key = context_key()
    tag = f"{IMAGE_REPOSITORY}:ci-{key}"
    archive = CACHE / f"node-health-image-{key}.tar"
    if not image_exists(tag):
        if archive.exists():
            podman("load", "--quiet", "--input", str(archive), timeout=600)
        else:
            build_image(tag)
            partial = archive.with_name(archive.name + ".partial")
            partial.unlink(missing_ok=True)
            podman("save", "--quiet", "--output", str(partial), tag, timeout=600)
            partial.replace(archive)
    forget_other_builds(tag, archive)
    return tag


@pytest.fixture(scope="module")
def image() -> str:
    require_root()
    require_tool("podman")
    require_tool("runc")
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time on this machine
        ensure_base_image()
        return ensure_image()


def in_image(image: str, entrypoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    return podman("run", "--rm", *ulimits(), "--network=none", "--entrypoint", entrypoint, image, *args)


# --- what is in the image --------------------------------------------------------------------------------------


def test_dockerignore_lets_in_what_the_build_copies() -> None:
    allowed = {line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines() if line[:1] == "!"}
    assert allowed == set(CONTEXT) - {"Dockerfile", ".dockerignore"}


def test_tools_in_the_image_answer_their_version(image: str) -> None:
    assert podman("run", "--rm", *ulimits(), "--network=none", image, "--version").stdout == (
        f"node-health {__version__}\n"
    )
    assert in_image(image, "py-spy", "--version").stdout.startswith("py-spy 0.")
    assert in_image(image, "nsenter", "--version").stdout.startswith("nsenter from util-linux ")


@pytest.mark.parametrize("command", ["fleet", "cleanup", "diagnose"])
def test_the_operators_commands_run_in_the_image(image: str, command: str) -> None:
    """README and docs/cli.md: `kubectl -n node-health exec ds/node-health -- node-health fleet` needs no source
    checkout: the image's `node-health` has the operator's commands."""
    result = in_image(image, "node-health", command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: node-health {command}"), result.stdout


def test_image_runs_debian_python_without_compilers_or_pip(image: str) -> None:
    probe = (
        "readlink -f /opt/node-health/bin/python; dpkg-query -W -f '${Package} ${Version}\\n' python3; "
        "for tool in gcc cc c++ make pip pip3; do command -v $tool; done; "
        "/opt/node-health/bin/python -c 'import pip' 2>/dev/null && echo importable-pip; true"
    )
    lines = in_image(image, "sh", "-c", probe).stdout.splitlines()
    assert lines[0].startswith("/usr/bin/python3.")
    assert lines[1].startswith("python3 3.")
    assert lines[2:] == [], f"build tools in the final stage: {lines[2:]}"


def test_image_size_is_within_the_target_and_documented(image: str) -> None:
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout)
    assert size <= SIZE_TARGET_BYTES, f"{size / 1e6:.0f} MB"
    documented = [
        int(word)
        for line in IMAGE_DOC.read_text().splitlines()
        if line.startswith("Size: ")
        for word in line.replace("MB", " MB").split()
        if word.isdigit()
    ]
    assert documented, "docs/image.md has a line `Size: N MB ...`"
    assert abs(documented[0] * 1e6 - size) <= 0.1 * size, (
        f"docs/image.md says {documented[0]} MB, it is {size / 1e6:.0f}"
    )


# --- running as the DaemonSet runs it --------------------------------------------------------------------------


@contextlib.contextmanager
def holding(path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process outside any container keeping `path` open until the block ends."""
    code = "import os, sys, time; os.open(sys.argv[1], os.O_RDONLY); print('ready', flush=True); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        yield child
    finally:
        child.kill()
        child.wait()


def daemonset_like(config: Path) -> list[str]:
    """`podman run` options that give the container what deploy/daemonset.yaml gives the agent."""
    return [
        *ulimits(),
        "--privileged",
        "--pid=host",
        "--read-only",
        "--tmpfs=/tmp",
        "--env=NODE_NAME=image-test",
        "--volume=/:/host:ro,rslave",
        f"--volume={config}:/etc/node-health/config.yaml:ro",
    ]


def test_check_in_the_image_names_a_holder_outside_the_container(image: str, tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "davinci0", stat.S_IFCHR | 0o600, os.makedev(*FULL))
    # As the shipped config: npu-smi is the host's, run with nsenter; with a davinci node under host.dev the holder
    # scan runs even where the host has no npu-smi.
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "host": {"root": "/host", "proc": "/proc", "dev": f"/host{dev}"},
                "npu": {"smi_command": ["nsenter", "-t", "1", "-m", "--", "npu-smi"], "smi_timeout_seconds": 2},
            }
        )
    )
    with holding(dev / "davinci0") as holder:
        done = podman(
            "run",
            "--rm",
            *daemonset_like(config),
            "--network=none",
            image,
            *("check", "--json", "--config", "/etc/node-health/config.yaml", "--only", "npu.holders"),
            check=False,
        )
    assert done.returncode == 1, done.stderr
    document = json.loads(done.stdout)
    assert document["node"] == "image-test" and document["ready"] is False
    findings = {(f["check"], f["subject"]): f for f in document["findings"]}
    held = findings[("npu.holders", "npu0")]
    assert (held["status"], held["reason"]) == ("fail", "NpuHeldOutOfBand"), held
    ours = [h for h in held["observed"]["holders"] if h["pid"] == holder.pid]
    assert ours, f"PID {holder.pid} not among {held['observed']['holders']}"
    assert "davinci0" in json.dumps(ours[0]) and ours[0]["kind"] != "pod", ours[0]


def image_probe_names(image: str) -> list[str]:
    defaults = yaml.safe_load(podman("run", "--rm", *ulimits(), "--network=none", image, "config", "--defaults").stdout)
    return list(defaults["probes"])


def test_agent_in_the_image_answers_the_preflight_and_stops_on_sigterm(image: str, tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "http": {"address": "127.0.0.1", "port": port},
                "host": {"root": "/host"},
                "probes": {name: {"enabled": name == "storage.space"} for name in image_probe_names(image)},
                "storage": {"space": [{"path": "/"}]},
            }
        )
    )
    # Host networking here only so that the test reaches the port; the DaemonSet uses the pod's network.
    name = f"node-health-test-{os.getpid()}"
    agent_argv = ("run", "--no-kube", "--config", "/etc/node-health/config.yaml")
    podman("run", "--detach", "--name", name, *daemonset_like(config), "--network=host", image, *agent_argv)
    try:
        outcome = wait_for_preflight(port)
        assert outcome.returncode == 0, (outcome.stdout, outcome.stderr, podman("logs", name, check=False).stderr)
        # The script waits out the agent's warm-up itself (a "warming up" line first, then the answer).
        assert outcome.stdout.splitlines()[-2:] == [
            f"node-health pre-flight: http://127.0.0.1:{port}/ready answered 200",
            "ready on image-test",
        ]
        started = time.monotonic()
        podman("stop", "--time", "10", name)
        assert time.monotonic() - started < 10, "the agent (PID 1 in its container) did not stop on SIGTERM"
        state = json.loads(podman("inspect", "--format", "{{json .State}}", name).stdout)
        assert state["ExitCode"] == 0, state
    finally:
        podman("rm", "--force", name, check=False)


def wait_for_preflight(port: int) -> subprocess.CompletedProcess[str]:
    """The pre-flight until the agent's first verdict is in (it answers 503 WarmingUp until then)."""
    env = {"PATH": os.environ["PATH"], "NODE_HEALTH_URL": f"http://127.0.0.1:{port}"}
    deadline = time.monotonic() + 60
    while True:
        outcome = subprocess.run(
            [require_tool("dash"), str(PREFLIGHT)], env=env, capture_output=True, text=True, timeout=60
        )
        if outcome.returncode == 0 or time.monotonic() > deadline:
            return outcome
        time.sleep(0.5)


# --- aarch64 ---------------------------------------------------------------------------------------------------


def runtime_requirements() -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: the installed metadata says the same
        import importlib.metadata

        return [r for r in importlib.metadata.requires("node-health") or [] if "extra ==" not in r]
    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])


def test_runtime_dependencies_resolve_as_aarch64_wheels(tmp_path: Path) -> None:
    requirements = runtime_requirements()
    # Debian bookworm's python3 is 3.11; manylinux2014 (glibc 2.17) wheels run on any Kunpeng distribution.
    target = ["--platform", "manylinux2014_aarch64", "--python-version", "3.11", "--implementation", "cp"]
    download = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    done = subprocess.run(
        [*download, "--dest", str(tmp_path), "--only-binary=:all:", *target, *requirements],
        capture_output=True,
        text=True,
        timeout=900,
    )
    offline = ("Failed to establish a new connection", "Temporary failure in name resolution", "Network is unreachable")
    require(not any(text in done.stderr for text in offline), "the package index (network)")
    assert done.returncode == 0, done.stderr[-4000:]
    wheels = [p.name for p in tmp_path.glob("*.whl")]
    downloaded = {project_name(name.split("-")[0]) for name in wheels}
    for requirement in requirements:
        match = re.match(r"[A-Za-z0-9._-]+", requirement)
        assert match is not None, requirement
        assert project_name(match.group(0)) in downloaded, (requirement, wheels)
    platform_wheels = [name for name in wheels if not name.endswith("-any.whl")]
    assert platform_wheels and all("aarch64" in name for name in platform_wheels), platform_wheels
    assert any(name.startswith("py_spy-") for name in platform_wheels), "py-spy is a native binary"


def project_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
