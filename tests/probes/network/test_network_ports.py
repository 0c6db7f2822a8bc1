"""network.ports: real processes holding ports of the HCCL range, /proc/net parsers on the kernel's own files,
and net.ipv4.ip_local_reserved_ports from temporary proc trees in the kernel's formats."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.system import require, require_root, require_tool

from agent.config import ConfigError, parse_config
from probes.base import Finding, ProbeContext, ProbeParseError, Sample, Status
from probes.network.netns import read_host_net_sysctls
from probes.network.ports import PortsProbe
from probes.network.proc_net import (
    compress_ports,
    parse_port_ranges,
    parse_proc_net_sockets,
    ports_outside,
    sockets_in_range,
)
from probes.runtime.host import Host

POD_UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
POD_CGROUP = (
    "12:memory:/kubepods/burstable/pod0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0/"
    "8d6e4c1b2a3f4e5d6c7b8a9f0e1d2c3b4a5f6e7d8c9b0a1f2e3d4c5b6a7f8e9d\n"
    "11:pids:/kubepods/burstable/pod0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0/"
    "8d6e4c1b2a3f4e5d6c7b8a9f0e1d2c3b4a5f6e7d8c9b0a1f2e3d4c5b6a7f8e9d\n"
)

HOLDER = textwrap.dedent(
    """
    import socket, sys, time
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    port = tcp.getsockname()[1]
    udp = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    udp.bind(("::1", port))
    print(port, flush=True)
    sys.stdin.read()
    """
)


@dataclass
class Holder:
    proc: subprocess.Popen[str]
    port: int  # TCP on 127.0.0.1 and UDP on ::1


@pytest.fixture
def holder() -> Iterator[Holder]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield Holder(proc, port)
    finally:
        proc.kill()
        proc.wait(10)


def run_ports(ports: dict, host: Host) -> tuple[dict[str, Finding], list[Sample]]:
    config = parse_config({"network": {"ports": {"only_with_npus": False, **ports}}})
    out = PortsProbe().run(ProbeContext(host, config, 8))
    return {f.subject: f for f in out if isinstance(f, Finding)}, [s for s in out if isinstance(s, Sample)]


@pytest.mark.system
def test_process_holding_ports_outside_kubernetes(holder: Holder) -> None:
    base = max(1, holder.port - 3)
    findings, samples = run_ports({"base": base, "count": 16}, Host())
    finding = findings[f"{base}-{base + 15}"]
    assert (finding.status, finding.reason) == (Status.FAIL, "PortRangeOccupied")
    assert holder.proc.pid in finding.observed["pids"]
    mine = [h for h in finding.observed["holders"] if h["pid"] == holder.proc.pid]
    assert {(h["port"], h["protocol"]) for h in mine} == {(holder.port, "tcp"), (holder.port, "udp6")}
    assert all(h["in_pod"] is False for h in mine)
    assert f"PID {holder.proc.pid} (python" in finding.message and "outside Kubernetes" in finding.message
    # The hint carries the real PID and the command that stops a bare process.
    assert "kill " in finding.hint and str(holder.proc.pid) in finding.hint.split("kill ", 1)[1].split(";")[0]
    assert "PID" not in finding.hint.replace(str(holder.proc.pid), "")
    # Command lines are another tenant's: only the executable is named unless redact_cmdlines is false.
    assert "-c" not in finding.message and all("command" not in h for h in mine)
    assert finding.observed["in_pod"] is False
    in_use = next(s for s in samples if s.name == "nodehealth_network_hccl_ports_in_use")
    assert in_use.value >= 1


def proc_tree(tmp_path: Path, reserved: str, port_range: str = "32768\t60999\n") -> Path:
    """A proc tree whose pid 1 net tables are the real host's and whose sysctls are written by the test."""
    root = tmp_path / "proc"
    (root / "1").mkdir(parents=True)
    (root / "1" / "net").symlink_to("/proc/1/net")
    sysctl = root / "sys" / "net" / "ipv4"
    sysctl.mkdir(parents=True)
    (sysctl / "ip_local_reserved_ports").write_text(reserved)
    (sysctl / "ip_local_port_range").write_text(port_range)
    return root


@pytest.mark.system
def test_holder_in_a_pod_is_a_warning(holder: Holder, tmp_path: Path) -> None:
    root = proc_tree(tmp_path, "")
    pid_dir = root / str(holder.proc.pid)
    pid_dir.mkdir()
    for name in ("fd", "stat", "cmdline", "status"):
        (pid_dir / name).symlink_to(f"/proc/{holder.proc.pid}/{name}")
    (pid_dir / "cgroup").write_text(POD_CGROUP)
    base = max(1, holder.port - 3)
    findings, _ = run_ports({"base": base, "count": 16, "check_reserved": False}, Host(proc=root))
    finding = findings[f"{base}-{base + 15}"]
    ours = [h for h in finding.observed["holders"] if h["pid"] == holder.proc.pid]
    assert ours and all(h["in_pod"] for h in ours)
    assert POD_UID in ours[0]["owner"] and ours[0]["kind"] == "pod"
    if finding.observed["in_pod"]:  # only our holder uses the range (nothing else on this host does)
        assert (finding.status, finding.reason) == (Status.WARN, "PortRangeOccupied")
        assert "in use by 1 pod(s)" in finding.message and f"pod {POD_UID}" in finding.message
        assert f"PID {holder.proc.pid}" in finding.message
    assert "net.ipv4.ip_local_reserved_ports" not in findings


def test_the_range_does_not_apply_on_a_node_without_npus(tmp_path: Path) -> None:
    """HCCL is Ascend's collective library: a GPU node (no /dev/davinciN) skips the check by default."""
    dev = tmp_path / "dev"
    dev.mkdir()
    config = parse_config({})
    probe = PortsProbe()
    reason = probe.applicable(ProbeContext(Host(dev=dev), config, 8))
    assert reason is not None and "no Ascend NPU" in reason
    (dev / "davinci0").touch()  # a regular file is no device node: still not an NPU node
    assert probe.applicable(ProbeContext(Host(dev=dev), config, 8)) is not None
    forced = parse_config({"network": {"ports": {"only_with_npus": False}}})
    assert probe.applicable(ProbeContext(Host(dev=dev), forced, 8)) is None


@pytest.mark.system
def test_a_node_with_an_npu_device_node_checks_the_range(tmp_path: Path) -> None:
    require_root()
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "davinci0", 0o600 | stat.S_IFCHR, os.makedev(1, 7))
    assert PortsProbe().applicable(ProbeContext(Host(dev=dev), parse_config({}), 8)) is None


def test_free_range_is_ok(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    (root / "1" / "net").mkdir(parents=True)
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    for name in ("tcp", "udp"):
        (root / "1" / "net" / name).write_text(header)
    findings, samples = run_ports({"base": 60000, "count": 16, "check_reserved": False}, Host(proc=root))
    assert findings["60000-60015"].status is Status.OK
    assert next(s for s in samples if s.name == "nodehealth_network_hccl_ports_in_use").value == 0


@pytest.mark.parametrize(
    ("reserved", "port_range", "status", "not_reserved"),
    [
        ("60000-60015,61000\n", "32768\t60999\n", Status.OK, ""),
        ("59000-61000\n", "32768\t60999\n", Status.OK, ""),
        ("60000-60007\n", "32768\t60999\n", Status.WARN, "60008-60015"),
        ("\n", "32768\t60999\n", Status.WARN, "60000-60015"),
        ("60000,60002-60015\n", "32768\t60999\n", Status.WARN, "60001"),
        ("\n", "32768\t50000\n", Status.OK, ""),  # the range is outside the ephemeral range: nothing to reserve
        ("\n", "32768\t60007\n", Status.WARN, "60000-60007"),
    ],
)
def test_reserved_ports(tmp_path: Path, reserved: str, port_range: str, status: Status, not_reserved: str) -> None:
    root = proc_tree(tmp_path, reserved, port_range)
    findings, _ = run_ports({"base": 60000, "count": 16}, Host(proc=root))
    finding = findings["net.ipv4.ip_local_reserved_ports"]
    assert finding.status is status
    assert finding.observed["not_reserved"] == not_reserved
    if status is Status.WARN:
        assert finding.reason == "PortsNotReserved"
        assert not_reserved in finding.message and "ip_local_reserved_ports=60000-60015" in finding.hint


def test_parse_the_kernels_own_tables() -> None:
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    udp6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    udp6.bind(("::1", 0))
    try:
        inode_tcp, tcp_port = os.fstat(tcp.fileno()).st_ino, tcp.getsockname()[1]
        inode_udp6, udp6_port = os.fstat(udp6.fileno()).st_ino, udp6.getsockname()[1]
        entries = parse_proc_net_sockets(Path("/proc/self/net/tcp").read_text(), "tcp")
        entries6 = parse_proc_net_sockets(Path("/proc/self/net/udp6").read_text(), "udp6")
        for name in ("tcp6", "udp"):
            parse_proc_net_sockets(Path("/proc/self/net", name).read_text(), name)
    finally:
        tcp.close()
        udp6.close()
    (mine,) = [e for e in entries if e.inode == inode_tcp]
    assert (mine.local_address, mine.local_port, mine.state) == ("127.0.0.1", tcp_port, "LISTEN")
    assert mine.uid == os.getuid()
    (mine6,) = [e for e in entries6 if e.inode == inode_udp6]
    assert (mine6.local_address, mine6.local_port, mine6.state) == ("::1", udp6_port, "CLOSE")


# Rows as the kernel prints them (net/ipv4/tcp_ipv4.c get_tcp4_sock, net/ipv6/tcp_ipv6.c get_tcp6_sock).
TCP_TEXT = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    "   0: 0100007F:EA63 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 41234 1 "
    "0000000000000000 100 0 0 10 0\n"
    "   1: 0A00000A:EA61 0B00000A:01BB 01 00000000:00000000 02:000AFC3A 00000000  1000        0 41235 2 "
    "0000000000000000 20 4 30 10 -1\n"
    "   2: 0100007F:EA62 0100007F:1F90 06 00000000:00000000 03:00001770 00000000     0        0 0 3 "
    "0000000000000000\n"
)
TCP6_TEXT = (
    "  sl  local_address                         remote_address                        st tx_queue rx_queue tr "
    "tm->when retrnsmt   uid  timeout inode\n"
    "   0: 00000000000000000000000000000000:EA64 00000000000000000000000000000000:0000 0A 00000000:00000000 "
    "00:00000000 00000000     0        0 51234 1 0000000000000000 100 0 0 10 0\n"
    "   1: 0000000000000000FFFF00000100007F:EA70 0000000000000000FFFF00000100007F:0050 01 00000000:00000000 "
    "00:00000000 00000000     0        0 51235 1 0000000000000000 20 4 30 10 -1\n"
)


def test_parse_kernel_rows() -> None:
    rows = parse_proc_net_sockets(TCP_TEXT, "tcp")
    assert [(r.local_address, r.local_port, r.state, r.inode) for r in rows] == [
        ("127.0.0.1", 60003, "LISTEN", 41234),
        ("10.0.0.10", 60001, "ESTABLISHED", 41235),
        ("127.0.0.1", 60002, "TIME_WAIT", 0),
    ]
    assert (rows[1].remote_address, rows[1].remote_port, rows[1].uid) == ("10.0.0.11", 443, 1000)
    rows6 = parse_proc_net_sockets(TCP6_TEXT, "tcp6")
    assert [(r.local_address, r.local_port, r.state) for r in rows6] == [
        ("::", 60004, "LISTEN"),
        ("::ffff:127.0.0.1", 60016, "ESTABLISHED"),
    ]
    # Listeners and connections whose local port is in range count; TIME_WAIT (no owner) does not.
    in_range = sockets_in_range(rows + rows6, 60000, 60015)
    assert sorted(r.local_port for r in in_range) == [60001, 60003, 60004]


@pytest.mark.parametrize(
    "text",
    [
        "garbage\n",
        TCP_TEXT.replace("0100007F:EA63", "0100007F-EA63"),
        TCP_TEXT.replace(" 41234 1", " x 1"),
        TCP_TEXT.splitlines()[0] + "\n   0: 0100007F:EA63\n",
    ],
)
def test_parse_malformed_rows(text: str) -> None:
    with pytest.raises(ProbeParseError):
        parse_proc_net_sockets(text, "tcp")


def test_malformed_table_raises_parse_error_from_the_probe(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    (root / "1" / "net").mkdir(parents=True)
    (root / "1" / "net" / "tcp").write_text("this is not /proc/net/tcp\n")
    with pytest.raises(ProbeParseError):
        run_ports({"check_reserved": False}, Host(proc=root))


def test_port_ranges_and_formatting() -> None:
    assert parse_port_ranges("60000-60015,61000\n") == [(60000, 60015), (61000, 61000)]
    assert parse_port_ranges("\n") == []
    assert parse_port_ranges("32768\t60999\n") == [(32768, 60999)]
    with pytest.raises(ProbeParseError):
        parse_port_ranges("60000-x")
    with pytest.raises(ProbeParseError):
        parse_port_ranges("low\thigh\n")
    assert ports_outside([(60000, 60003), (60010, 60010)], 60000, 60011) == [
        60004,
        60005,
        60006,
        60007,
        60008,
        60009,
        60011,
    ]
    assert compress_ports([60005, 60000, 60001, 60002]) == "60000-60002,60005"
    assert compress_ports([]) == ""


def test_range_must_fit() -> None:
    with pytest.raises(ConfigError, match=r"network\.ports"):
        parse_config({"network": {"ports": {"base": 65530, "count": 16}}})


@pytest.mark.system
def test_reserved_ports_are_read_in_the_hosts_network_namespace(tmp_path: Path) -> None:
    """The agent's pod has its own network namespace; net.ipv4 sysctls are per namespace, so they are read
    by a child that entered the host's (here: a namespace the test creates, standing in for /proc/1/ns/net)."""
    require_root()
    require_tool("ip")
    name = f"nh-sysctl-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    require(made.returncode == 0, f"ip netns add: {made.stderr.strip()}")
    try:
        subprocess.run(
            ["ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv4.ip_local_reserved_ports=61000-61015"],
            check=True,
        )
        fake_proc = tmp_path / "proc"
        (fake_proc / "1" / "ns").mkdir(parents=True)
        (fake_proc / "1" / "ns" / "net").symlink_to(f"/run/netns/{name}")
        (fake_proc / "sys").symlink_to("/proc/sys")
        host = Host(proc=fake_proc)
        texts = read_host_net_sysctls(host, ("ip_local_reserved_ports",), 5.0)
        assert texts["ip_local_reserved_ports"].strip() == "61000-61015"
        ours = Path("/proc/sys/net/ipv4/ip_local_reserved_ports").read_text().strip()
        assert ours != "61000-61015", "the agent's own namespace must not have been read"
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
