"""probes/runtime/paths.py: where the host's filesystems are, and host paths joined under them without `..`
climbing out; the `host:` section's keys are this model."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from agent.config import parse_config
from probes.host.config import HostConfig
from probes.runtime.host import Host
from probes.runtime.paths import HostPaths, join_under, normalize_host_path


def test_defaults_are_the_hosts_own_paths() -> None:
    paths = HostPaths()
    assert (paths.proc, paths.sys, paths.dev, paths.root) == ("/proc", "/sys", "/dev", "/")
    assert paths.proc_path(1, "ns", "net") == Path("/proc/1/ns/net")
    assert paths.sys_path("class", "net") == Path("/sys/class/net")
    assert paths.dev_path("kmsg") == Path("/dev/kmsg")
    assert paths.root_path("/etc/resolv.conf") == Path("/etc/resolv.conf")


def test_host_paths_join_under_the_configured_root() -> None:
    paths = HostPaths(proc="/host/proc", root="/host")
    assert paths.root_path("/mnt/share") == Path("/host/mnt/share")
    assert paths.root_path("mnt/share") == Path("/host/mnt/share")
    assert paths.root_path("/") == Path("/host")
    assert paths.proc_path() == Path("/host/proc")
    assert paths.proc_path(42, "root") == Path("/host/proc/42/root")


@pytest.mark.parametrize(
    "written",
    ["/../../etc/shadow", "../etc/shadow", "/mnt/../../../etc/shadow", "//etc/./x/../shadow", "/etc/shadow"],
)
def test_dot_dot_never_climbs_out_of_the_root(tmp_path: Path, written: str) -> None:
    root = tmp_path / "host"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "shadow").write_text("inside")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "shadow").write_text("outside")
    joined = HostPaths(root=str(root)).root_path(written)
    assert joined == root / "etc" / "shadow"
    assert joined.read_text() == "inside"


def test_a_part_that_is_absolute_or_climbs_stays_below_its_base() -> None:
    paths = HostPaths(proc="/host/proc", dev="/host/dev")
    assert paths.proc_path(7, "root", "/etc/hosts") == Path("/host/proc/7/root/etc/hosts")
    assert paths.proc_path("..", "..", "etc") == Path("/host/proc/etc")
    assert paths.dev_path("/../kmsg") == Path("/host/dev/kmsg")
    assert join_under("/proc/7/root", "/data/../../../etc/passwd") == Path("/proc/7/root/etc/passwd")


def test_normalize_host_path() -> None:
    assert normalize_host_path("") == "/"
    assert normalize_host_path("data//ckpt/./x/..") == "/data/ckpt"
    assert normalize_host_path("/../..") == "/"


def test_host_path_is_the_inverse_of_root_path() -> None:
    paths = HostPaths(root="/host/")
    assert paths.host_path(paths.root_path("/etc/chrony.conf")) == "/etc/chrony.conf"
    assert paths.host_path("/host") == "/"
    assert paths.host_path("/hostile/etc") == "/hostile/etc"  # not below the root: left as it is
    assert HostPaths().host_path("/etc/ntp.conf") == "/etc/ntp.conf"


def test_the_host_section_is_host_paths_and_builds_the_host() -> None:
    config = parse_config({"host": {"root": "/host", "proc": "/host/proc", "shm": {"path": "/dev/shm"}}})
    section = config.section(HostConfig)
    assert isinstance(section, HostPaths)
    host = Host.from_config(section)
    assert type(host.paths) is HostPaths
    assert (host.proc, host.sys, host.dev, host.root) == (Path("/host/proc"), Path("/sys"), Path("/dev"), Path("/host"))
    assert host.root_path("/etc/hosts") == Path("/host/etc/hosts")


def test_keyword_overrides_replace_single_paths() -> None:
    host = Host(HostPaths(root="/host"), dev=Path("/tmp/dev"))
    assert (host.paths.root, host.paths.dev, host.paths.proc) == ("/host", "/tmp/dev", "/proc")
    assert host.dev_path("davinci0") == Path("/tmp/dev/davinci0")


def test_host_paths_are_strict_like_every_section() -> None:
    with pytest.raises(ValidationError):
        HostPaths(procfs="/proc")  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        HostPaths(root=5)  # type: ignore[arg-type]


def test_resolve_under_follows_links_as_the_host_would_and_never_leaves_the_root(tmp_path: Path) -> None:
    from probes.runtime.paths import resolve_under

    root = tmp_path / "host"
    (root / "mnt" / "disk" / "sub").mkdir(parents=True)
    (root / "data").symlink_to("/mnt/disk")  # absolute: the host's /mnt/disk
    (root / "mnt" / "disk" / "up").symlink_to("../../../../..")  # climbs past the root: stops at it
    (root / "rel").symlink_to("data/sub")
    (root / "loop1").symlink_to("loop2")
    (root / "loop2").symlink_to("loop1")
    top = str(root)
    assert resolve_under(top, "/data") == "/mnt/disk"
    assert resolve_under(top, "/data/sub") == "/mnt/disk/sub"
    assert resolve_under(top, "/rel") == "/mnt/disk/sub"
    assert resolve_under(top, "/data/up/mnt") == "/mnt"
    assert resolve_under(top, "/data/missing/../x") == "/mnt/disk/x"  # the rest kept as written, normalised
    assert resolve_under(top, "/mnt/disk/../../data/./sub") == "/mnt/disk/sub"
    assert resolve_under(top, "/") == "/"
    with pytest.raises(OSError) as loop:
        resolve_under(top, "/loop1")
    assert loop.value.errno == 40  # ELOOP, as the kernel says past 40 links
