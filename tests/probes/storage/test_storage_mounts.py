"""storage.mounts on real mounts: FUSE filesystems that answer, fail with ESTALE, or never answer; tmpfs."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from support.fusefs import fuse_mount
from support.system import fuse_capable, require_root, require_tool, wait_reaped

from agent.config import ConfigError, parse_config
from agent.scheduler import execute
from probes.base import PARSE_ERROR, Finding, ProbeContext, ProbeParseError, Sample, Status
from probes.runtime.children import ChildCalls
from probes.runtime.host import Host
from probes.storage.mounts import MountsProbe
from probes.storage.mounttable import mount_at, mount_containing, parse_mountinfo


def run_mounts(host: Host, mounts: list[dict], timeout: float = 1.0, probe: MountsProbe | None = None):
    config = parse_config({"storage": {"mounts": mounts, "mount_timeout_seconds": timeout}})
    output = (probe or MountsProbe()).run(ProbeContext(host, config, 10.0))
    findings = {f.subject: f for f in output if isinstance(f, Finding)}
    samples = [s for s in output if isinstance(s, Sample)]
    return findings, samples


def sample_value(samples: list[Sample], name: str, path: str) -> float | None:
    for sample in samples:
        if sample.name == name and sample.labels.get("path") == path:
            return sample.value
    return None


@pytest.mark.system
def test_healthy_fuse_mount_is_ok_with_latency(tmp_path: Path) -> None:
    fuse_capable()
    with fuse_mount(tmp_path) as mount:
        findings, samples = run_mounts(Host(), [{"path": str(mount.path), "fstype": "fuse*"}])
    finding = findings[str(mount.path)]
    assert finding.status == Status.OK, finding
    assert finding.observed["fstype"] == "fuse"
    assert sample_value(samples, "nodehealth_storage_mount_ok", str(mount.path)) == 1.0
    latency = sample_value(samples, "nodehealth_storage_mount_latency_seconds", str(mount.path))
    assert latency is not None and 0 < latency < 1.0


@pytest.mark.system
def test_missing_and_wrong_type_from_the_mount_table(tmp_path: Path) -> None:
    fuse_capable()
    not_mounted = tmp_path / "empty"
    not_mounted.mkdir()
    with fuse_mount(tmp_path) as mount:
        findings, samples = run_mounts(
            Host(),
            [
                {"path": str(not_mounted), "fstype": "nfs4"},
                {"path": str(mount.path), "fstype": "nfs*"},
                {"path": "/proc", "fstype": "proc", "source": "server:/export"},
            ],
        )
    assert findings[str(not_mounted)].reason == "MountMissing"
    assert findings[str(not_mounted)].status == Status.FAIL
    wrong = findings[str(mount.path)]
    assert (wrong.reason, wrong.status) == ("MountWrongType", Status.FAIL)
    assert "type fuse, expected nfs*" in wrong.message
    assert findings["/proc"].reason == "MountWrongType"
    assert "source proc, expected server:/export" in findings["/proc"].message
    assert sample_value(samples, "nodehealth_storage_mount_ok", str(not_mounted)) == 0.0


@pytest.mark.system
def test_estale_on_stat_is_mount_stale(tmp_path: Path) -> None:
    fuse_capable()
    with fuse_mount(tmp_path, "--getattr-errno", "ESTALE") as mount:
        findings, samples = run_mounts(Host(), [{"path": str(mount.path), "fstype": "fuse"}])
    finding = findings[str(mount.path)]
    assert (finding.status, finding.reason) == (Status.FAIL, "MountStale"), finding
    assert finding.observed["errno"] == 116
    assert "remount" in finding.hint
    assert sample_value(samples, "nodehealth_storage_mount_ok", str(mount.path)) == 0.0


@pytest.mark.system
def test_hung_mount_reported_within_deadline_and_never_piles_up_children(tmp_path: Path) -> None:
    fuse_capable()
    children = ChildCalls()
    host = Host(children=children)
    probe = MountsProbe()
    me = psutil.Process()
    before = {child.pid for child in me.children()}
    healthy_dir = tmp_path / "healthy"
    healthy_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "nh-test", str(healthy_dir)], check=True)
    try:
        with fuse_mount(tmp_path, "--hang-getattr") as mount:
            mounts = [{"path": str(mount.path), "fstype": "fuse"}, {"path": str(healthy_dir), "fstype": "tmpfs"}]
            deadline = 0.5
            for cycle in range(6):
                started = time.monotonic()
                findings, _ = run_mounts(host, mounts, timeout=deadline, probe=probe)
                elapsed = time.monotonic() - started
                hung = findings[str(mount.path)]
                assert (hung.status, hung.reason) == (Status.FAIL, "MountHung"), hung
                assert elapsed < deadline + 1.0, f"cycle {cycle} took {elapsed:.2f}s"
                # The healthy mount is checked side by side, not after the hung one.
                assert findings[str(healthy_dir)].status == Status.OK
                if cycle > 0:
                    assert "still stuck" in hung.message
                stuck = [key for key in children.in_flight() if key.startswith("mount:")]
                assert stuck == [f"mount:{mount.path}"]
                others = [c for c in me.children() if c.pid != mount.daemon_pid and c.pid not in before]
                assert len(others) <= 1, others
        # Killing the daemon aborts the connection: the stuck child ends and is reaped.
        assert wait_reaped(children) == {}
    finally:
        subprocess.run(["umount", "-l", str(healthy_dir)], check=False)


# --- the mount table parser --------------------------------------------------------------------------

PROC_RST_EXAMPLE = "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n"
FIELD_LAYOUTS = (
    # no optional fields; NFS; several optional fields; FUSE with subtype; escaped space in mount point and source
    "22 27 0:21 / /proc rw,relatime - proc proc rw\n"
    "120 27 0:53 / /mnt/share rw,relatime shared:60 - nfs4 10.0.0.5:/export rw,vers=4.2,hard,proto=tcp\n"
    "130 27 0:60 / /mnt/lustre rw shared:7 master:3 propagate_from:2 - lustre 10.0.0.9@o2ib:/fs rw,flock\n"
    "140 27 0:61 / /mnt/s3 rw,nosuid,nodev - fuse.s3fs s3fs rw,user_id=0,group_id=0\n"
    "150 27 0:62 / /mnt/my\\040share\\011x\\134y rw - cifs //srv/a\\040b rw\n"
)


def test_parse_mountinfo_layouts() -> None:
    (entry,) = parse_mountinfo(PROC_RST_EXAMPLE)
    assert (entry.mount_id, entry.parent_id, entry.major, entry.minor) == (36, 35, 98, 0)
    assert (entry.root, entry.mount_point, entry.options) == ("/mnt1", "/mnt2", "rw,noatime")
    assert entry.optional_fields == ("master:1",)
    assert (entry.fstype, entry.source, entry.super_options) == ("ext3", "/dev/root", "rw,errors=continue")
    entries = parse_mountinfo(FIELD_LAYOUTS)
    assert [(e.mount_point, e.fstype, e.source) for e in entries] == [
        ("/proc", "proc", "proc"),
        ("/mnt/share", "nfs4", "10.0.0.5:/export"),
        ("/mnt/lustre", "lustre", "10.0.0.9@o2ib:/fs"),
        ("/mnt/s3", "fuse.s3fs", "s3fs"),
        ("/mnt/my share\tx\\y", "cifs", "//srv/a b"),
    ]
    assert entries[2].optional_fields == ("shared:7", "master:3", "propagate_from:2")
    assert entries[1].optional_fields == ("shared:60",) and entries[0].optional_fields == ()
    assert mount_at(entries, "/mnt/share/") is entries[1]
    assert mount_at(entries, "/mnt") is None


def test_mount_containing_prefers_device_then_longest_prefix() -> None:
    entries = parse_mountinfo(
        "1 0 254:0 / / rw - ext4 /dev/vda rw\n"
        "2 1 0:53 / /mnt/share rw - nfs4 srv:/e rw\n"
        "3 2 0:54 / /mnt/share/sub rw - tmpfs tmpfs rw\n"
        "4 1 0:55 / /mnt/sharedisk rw - xfs /dev/sdb rw\n"
    )
    assert mount_containing(entries, "/mnt/share/sub/x/lock").fstype == "tmpfs"
    assert mount_containing(entries, "/mnt/share/x/lock").fstype == "nfs4"
    assert mount_containing(entries, "/mnt/sharedisk/x").fstype == "xfs"
    assert mount_containing(entries, "/root/.cache/x").fstype == "ext4"
    assert mount_containing(entries, "/mnt/share/sub/x", dev=os.makedev(0, 53)).fstype == "nfs4"


def test_parse_mountinfo_rejects_garbage() -> None:
    for garbage in (
        "",
        "22 27 0:21 / /proc rw,relatime proc proc rw\n",  # no separator
        "x 27 0:21 / /proc rw - proc proc rw\n",
        "22 27 021 / /proc rw - proc proc rw\n",
        "22 27 0:21 / /proc rw -\n",
    ):
        with pytest.raises(ProbeParseError):
            parse_mountinfo(garbage)


def test_parse_every_line_of_the_real_mount_tables() -> None:
    for source in ("/proc/self/mountinfo", "/proc/1/mountinfo"):
        text = Path(source).read_text()
        entries = parse_mountinfo(text)
        assert len(entries) == len(text.splitlines())
        assert mount_at(entries, "/") is not None
        assert all(e.mount_point.startswith("/") and e.fstype for e in entries)


def test_malformed_host_mount_table_makes_the_check_unknown(tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "mountinfo").write_text("this is not a mount table\n")
    config = parse_config({"storage": {"mounts": [{"path": "/mnt/share", "fstype": "nfs4"}]}})
    result, findings, _ = execute(MountsProbe(), Host(proc=tmp_path), config, 5.0)
    assert result == "error"
    assert [(f.check, f.status, f.reason) for f in findings] == [("storage.mounts", Status.UNKNOWN, PARSE_ERROR.code)]


@pytest.mark.system
def test_kernel_escapes_in_a_real_mount_point(tmp_path: Path) -> None:
    require_root()
    odd = tmp_path / "dir with space\tand\\backslash\nnewline"
    odd.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "nh test", str(odd)], check=True)
    try:
        raw = Path("/proc/1/mountinfo").read_text()
        assert "\\040" in raw and "\\011" in raw and "\\134" in raw and "\\012" in raw
        entry = mount_at(parse_mountinfo(raw), str(odd))
        assert entry is not None and (entry.fstype, entry.source) == ("tmpfs", "nh test")
        findings, _ = run_mounts(Host(), [{"path": str(odd), "fstype": "tmpfs", "source": "nh test"}])
        subject = str(odd).replace("\t", "\\x09").replace("\n", "\\x0a")  # findings show it escaped
        assert findings[subject].status == Status.OK, findings[subject]
    finally:
        subprocess.run(["umount", "-l", str(odd)], check=False)


@pytest.mark.system
def test_cli_check_reports_a_hung_mount_in_bounded_time(tmp_path: Path) -> None:
    fuse_capable()
    node_health = require_tool("node-health")
    config_file = tmp_path / "config.yaml"
    with fuse_mount(tmp_path, "--hang-getattr") as mount:
        config_file.write_text(
            json.dumps(
                {
                    "kubernetes": {"enabled": False},
                    "storage": {"mounts": [{"path": str(mount.path), "fstype": "fuse"}], "mount_timeout_seconds": 1},
                }
            )
        )
        started = time.monotonic()
        # Output to files, not pipes: the child stuck in the hung mount inherited the CLI's stdout, so a
        # pipe would not see EOF until the mount recovers.
        with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
            done = subprocess.run(
                [node_health, "check", "--json", "--config", str(config_file), "--only", "storage.mounts"],
                stdout=out,
                stderr=err,
                timeout=60,
            )
        elapsed = time.monotonic() - started
    assert done.returncode == 1, (tmp_path / "err").read_text()
    assert (tmp_path / "out").read_bytes(), (tmp_path / "err").read_text()  # 1 is also Python's uncaught exception
    document = json.loads((tmp_path / "out").read_text())
    (finding,) = [f for f in document["findings"] if f["check"] == "storage.mounts"]
    assert (finding["status"], finding["reason"], finding["subject"]) == ("fail", "MountHung", str(mount.path))
    assert document["ready"] is False
    assert elapsed < 30


def test_storage_config_rejects_duplicates_and_relative_globs() -> None:
    with pytest.raises(ConfigError, match=r"storage.*listed twice"):
        parse_config({"storage": {"mounts": [{"path": "/mnt/a"}, {"path": "/mnt/a/"}]}})
    with pytest.raises(ConfigError, match=r"storage.*listed twice"):
        parse_config({"storage": {"write_probes": [{"path": "/mnt/a"}, {"path": "/mnt/a", "uid": 5}]}})
    with pytest.raises(ConfigError, match="absolute"):
        parse_config({"storage": {"lock_globs": ["torch_extensions/*/*/lock"]}})
    with pytest.raises(ConfigError, match=r"container_lock_globs.*absolute"):
        parse_config({"storage": {"container_lock_globs": ["tmp/torch_extensions/*/*/lock"]}})
    design = parse_config(
        {
            "storage": {
                "mounts": [{"path": "/mnt/share", "fstype": "nfs4"}],
                "write_probes": [{"path": "/mnt/share/.node-health", "uid": 1000, "gid": 1000, "bytes": 65536}],
                "space": [{"path": "/", "warn_percent": 85, "fail_percent": 95}],
                "lock_globs": ["/root/.cache/torch_extensions/*/*/lock"],
                "stale_lock_age_seconds": 1800,
                "remove_stale_locks": False,
            }
        }
    )
    assert design.storage.write_probes[0].uid == 1000
