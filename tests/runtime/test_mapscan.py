"""probes/runtime/mapscan.py: device nodes a process has mapped, matched by device number. A /proc-like tree the
test writes (maps text as the kernel prints it, map_files links to a mknod'ed node and a regular file, as the
kernel's are), a file name posing as a mapping, truncated maps, no capability for map_files; then a real process
that mapped a node and closed its fd, through the forked scanners."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
from support.pod_cgroups import mapping
from support.system import require_root

from probes.runtime import mapscan
from probes.runtime.host import Host
from probes.runtime.mapscan import MappedDevices
from probes.runtime.procfs import device_rdevs, scan_open_files

ZERO = os.makedev(1, 5)


def _stat_mode(dir_fd: int, entry: str) -> tuple[int, int]:
    st = os.stat(entry, dir_fd=dir_fd)
    return st.st_mode, st.st_rdev


def _key(path: Path) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} {st.st_ino}"


def _process(proc: Path, pid: int, lines: list[str], links: dict[str, Path]) -> None:
    base = proc / str(pid)
    (base / "map_files").mkdir(parents=True)
    (base / "maps").write_text("".join(line + "\n" for line in lines))
    for span, target in links.items():
        (base / "map_files" / span).symlink_to(target)


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    """A device node with /dev/zero's number mknod'ed outside any dev dir, and a library-like regular file."""
    require_root()
    (tmp_path / "elsewhere").mkdir()
    node = tmp_path / "elsewhere" / "npu"
    os.mknod(node, 0o600 | stat.S_IFCHR, ZERO)
    library = tmp_path / "libascend.so"
    library.write_bytes(b"\x7fELF")
    return node, library


@pytest.mark.system
def test_a_mapped_node_is_found_by_its_device_number_wherever_it_lives(
    tmp_path: Path, files: tuple[Path, Path]
) -> None:
    node, library = files
    lines = [
        "55d0c0000000-55d0c0001000 r--p 00000000 00:00 0 ",
        f"7f0000000000-7f0000001000 r-xp 00000000 {_key(library)}                    {library}",
        "7f0000001000-7f0000002000 rw-p 00000000 00:00 0                          [heap]",
        f"7f0000002000-7f0000003000 rw-p 00000000 {_key(node)}                    /dev/davinci0",
    ]
    _process(tmp_path / "proc", 42, lines, {"7f0000000000-7f0000001000": library, "7f0000002000-7f0000003000": node})
    devices = MappedDevices({ZERO}, _stat_mode)
    assert devices.find(str(tmp_path / "proc"), 42) == [("/dev/davinci0", ZERO)]
    # The answer for each mapped file is kept: a second process mapping the same files is matched without a look
    # at its map_files (it has none here).
    _process(tmp_path / "proc", 43, lines, {})
    assert devices.find(str(tmp_path / "proc"), 43) == [("/dev/davinci0", ZERO)]
    assert MappedDevices({os.makedev(1, 7)}, _stat_mode).find(str(tmp_path / "proc"), 42) == []


@pytest.mark.system
def test_a_file_name_that_poses_as_a_mapping_neither_hides_nor_makes_one(
    tmp_path: Path, files: tuple[Path, Path]
) -> None:
    node, library = files
    posing = f"{library} 00000000 {_key(node)} /dev/davinci0"  # a tenant's file name: spaces and all
    lines = [
        f"7f0000000000-7f0000001000 r-xp 00000000 {_key(library)}                    {posing}",
        f"7f0000002000-7f0000003000 rw-p 00000000 {_key(node)}                    /dev/davinci0",
    ]
    _process(tmp_path / "proc", 42, lines, {"7f0000000000-7f0000001000": library, "7f0000002000-7f0000003000": node})
    assert MappedDevices({ZERO}, _stat_mode).find(str(tmp_path / "proc"), 42) == [("/dev/davinci0", ZERO)]
    # The name alone, with no mapping of the node: nothing is made of it.
    _process(tmp_path / "proc", 44, lines[:1], {"7f0000000000-7f0000001000": library})
    assert MappedDevices({ZERO}, _stat_mode).find(str(tmp_path / "proc"), 44) == []


@pytest.mark.system
def test_maps_longer_than_the_limit_are_counted_and_map_files_refused_is_counted(
    tmp_path: Path, files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    node, library = files
    line = f"7f0000000000-7f0000001000 r-xp 00000000 {_key(library)}                    {library}"
    _process(tmp_path / "proc", 42, [line] * 50, {"7f0000000000-7f0000001000": library})
    monkeypatch.setattr(mapscan, "MAPS_LIMIT", 1000)
    short = MappedDevices({ZERO}, _stat_mode)
    assert short.find(str(tmp_path / "proc"), 42) == []
    assert short.counters["maps_truncated"] == 1
    monkeypatch.undo()

    def refused(_dir_fd: int, _entry: str) -> tuple[int, int]:
        raise PermissionError(errno.EPERM, "Operation not permitted")  # no CAP_SYS_ADMIN for map_files

    lines = [f"7f0000002000-7f0000003000 rw-p 00000000 {_key(node)}                    /dev/davinci0"]
    _process(tmp_path / "proc", 43, lines, {"7f0000002000-7f0000003000": node})
    blind = MappedDevices({ZERO}, refused)
    assert blind.find(str(tmp_path / "proc"), 43) == []
    assert blind.find(str(tmp_path / "proc"), 43) == []  # no further try: the capability is missing for all
    assert blind.counters["maps_denied"] == 2


@pytest.mark.system
def test_the_scan_finds_a_process_that_mapped_a_node_and_closed_its_fd(tmp_path: Path) -> None:
    require_root()
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "davinci0", 0o600 | stat.S_IFCHR, ZERO)
    rdevs = device_rdevs(dev, ["davinci0"])
    with mapping(dev / "davinci0") as child:
        with_maps = scan_open_files(Host(dev=dev), rdevs=rdevs, timeout=20, mappings=True)
        fds_only = scan_open_files(Host(dev=dev), rdevs=rdevs, timeout=20)
    (found,) = [m for m in with_maps.matches if m.pid == child.pid]
    assert (found.via, found.fd, found.key, found.target) == ("mmap", -1, ("rdev", ZERO), str(dev / "davinci0"))
    assert child.pid in with_maps.texts  # the scanner described it, as it does an fd holder
    assert all(m.pid != child.pid for m in fds_only.matches)
