"""podman as the tests run it, and the base image they build on: debian:bookworm-slim pulled, or made here with
debootstrap the way the official -slim images are (for another architecture too, through qemu-user-static), for
tests/deploy/test_image.py and tests/deploy/test_release.py.

Cached between runs under $NODE_HEALTH_CI_CACHE (default /var/cache/node-health-ci): the base rootfs tarball per
architecture.
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import shutil
import subprocess
import tempfile
from pathlib import Path

from support.system import require_tool

CACHE = Path(os.environ.get("NODE_HEALTH_CI_CACHE", "/var/cache/node-health-ci"))
BASE_IMAGE = "docker.io/library/debian:bookworm-slim"
DEBIAN_MIRROR = os.environ.get("NODE_HEALTH_DEBIAN_MIRROR", "http://deb.debian.org/debian")
SECURITY_MIRROR = os.environ.get("NODE_HEALTH_DEBIAN_SECURITY_MIRROR", "http://deb.debian.org/debian-security")
# Debian's architecture names, by the machine's.
DEBIAN_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


# --- podman ----------------------------------------------------------------------------------------------------


def podman(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    """podman with runc and cgroupfs: they work on cgroup v1 (hybrid) hosts such as CI's as well as on v2."""
    argv = [require_tool("podman"), "--runtime", "runc", "--cgroup-manager", "cgroupfs", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, f"{' '.join(argv)}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def ulimits() -> list[str]:
    """podman's default limits exceed this host's hard limits, which runc may not raise: stay at or below them."""
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1 << 20)
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 4096)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def image_exists(reference: str) -> bool:
    return podman("image", "exists", reference, check=False).returncode == 0


# --- the base image: pulled, or made here with debootstrap like the official -slim ----------------------------

DPKG_EXCLUDES = """\
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /var/cache/man/*
"""
APT_CONFIG = {
    "docker-clean": (
        'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb '
        '/var/cache/apt/*.bin || true"; };\n'
        'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb '
        '/var/cache/apt/*.bin || true"; };\n'
        'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n'
    ),
    "docker-no-languages": 'Acquire::Languages "none";\n',
    "docker-gzip-indexes": 'Acquire::GzipIndexes "true";\n',
    "docker-autoremove-suggests": 'APT::AutoRemove::SuggestsImportant "false";\n',
}
SOURCES = f"""\
Types: deb
URIs: {DEBIAN_MIRROR}
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: {SECURITY_MIRROR}
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def slim(root: Path) -> None:
    """What the official debian:*-slim images do to a minbase: no docs, man pages or locales (now or from later
    installs), apt caches and lists cleaned, the release's updates and security suites in the sources."""
    (root / "etc/dpkg/dpkg.cfg.d/docker").write_text(DPKG_EXCLUDES)
    for name, text in APT_CONFIG.items():
        (root / "etc/apt/apt.conf.d" / name).write_text(text)
    (root / "etc/apt/sources.list").unlink(missing_ok=True)
    (root / "etc/apt/sources.list.d/debian.sources").write_text(SOURCES)
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*", "var/log/*.log"):
        for path in root.glob(pattern):
            if path.is_file():
                path.unlink()
    for directory in ("usr/share/man", "usr/share/info", "usr/share/locale"):
        for path in (root / directory).iterdir():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    for path in sorted((root / "usr/share/doc").rglob("*"), reverse=True):
        if path.is_dir() and not path.is_symlink():
            with contextlib.suppress(OSError):  # not empty: it keeps a copyright file
                path.rmdir()
        elif path.name != "copyright":
            path.unlink()


def unmount_below(root: Path) -> None:
    """debootstrap mounts /proc and /sys in the target; a failed run may leave them: never delete through them."""
    with open("/proc/self/mountinfo") as mountinfo:
        targets = [line.split()[4] for line in mountinfo]
    for target in sorted((t for t in targets if t.startswith(f"{root}/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, timeout=60)


def make_base_tarball(tarball: Path, arch: str | None = None) -> None:
    """A -slim rootfs of Debian bookworm as a tarball; `arch` (Debian's name) other than the host's runs its
    second stage under qemu-user-static, through binfmt_misc."""
    debootstrap = require_tool("debootstrap")
    extra = [f"--arch={arch}"] if arch else []
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="rootfs-") as work:
        root = Path(work) / "rootfs"
        try:
            done = subprocess.run(
                [debootstrap, *extra, "--variant=minbase", "bookworm", str(root), DEBIAN_MIRROR],
                capture_output=True,
                text=True,
                timeout=1200,
            )
            assert done.returncode == 0, f"debootstrap failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        finally:
            unmount_below(root)
        slim(root)
        partial = tarball.with_name(tarball.name + ".partial")
        subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."], check=True, timeout=600)
        partial.replace(tarball)


def ensure_base_image(name: str = BASE_IMAGE, arch: str | None = None) -> str:
    """The base image under `name`: there already, pulled, or made with debootstrap and imported (for `arch`, a
    Debian architecture name, when it is not the host's: then the image says so, so a build for that platform
    takes it). Returns the name."""
    if image_exists(name):
        return name
    host = DEBIAN_ARCH.get(platform.machine(), platform.machine())
    arch = None if arch in (None, host) else arch
    tarball = CACHE / f"debian-bookworm-minbase-{arch or platform.machine()}.tar"
    if not tarball.exists():
        pull = ["pull", "--quiet", *(["--arch", arch] if arch else []), BASE_IMAGE]
        if podman(*pull, timeout=300, check=False).returncode == 0:
            if name != BASE_IMAGE:
                podman("tag", BASE_IMAGE, name)
            return name
        make_base_tarball(tarball, arch)
    podman("import", *(["--arch", arch] if arch else []), "--change", 'CMD ["bash"]', str(tarball), name)
    return name


def host_ca_bundle() -> Path | None:
    """The CA bundle this machine's pip trusts (a TLS-intercepting proxy's CA included), for pip in the build."""
    for candidate in (
        os.environ.get("PIP_CERT"),
        os.environ.get("SSL_CERT_FILE"),
        os.environ.get("REQUESTS_CA_BUNDLE"),
        "/etc/ssl/certs/ca-certificates.crt",
    ):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def build_volumes(work: Path) -> list[str]:
    """pip inside the build uses this machine's CA bundle and index (mounted for the RUN steps only, never part
    of the image), so the Dockerfile stays the one a registry build uses."""
    bundle = host_ca_bundle()
    settings = ["[global]"]
    volumes: list[str] = []
    if bundle is not None:
        settings.append("cert = /run/node-health-ci/ca.crt")
        volumes += ["--volume", f"{bundle}:/run/node-health-ci/ca.crt:ro"]
    if os.environ.get("PIP_INDEX_URL"):
        settings.append(f"index-url = {os.environ['PIP_INDEX_URL']}")
    (work / "pip.conf").write_text("\n".join(settings) + "\n")
    return [*volumes, "--volume", f"{work / 'pip.conf'}:/etc/pip.conf:ro"]
