"""Where the counter windows live (interconnect.state_dir, default /var/lib/node-health, the host directory the
DaemonSet mounts): one file per probe under it, a bad value a config error naming the key, an unwritable
directory windows kept in memory (said on the findings, logged once), and the file never written through a
symlink. The windows' survival across a restart is proved in test_interconnect_ports.py and test_gpu_links.py."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from support.fake_gpu_links import Clock as GpuClock
from support.fake_gpu_links import Node, run
from support.fake_infiniband import InfinibandTree, node

from agent.config import ConfigError, parse_config
from probes.base import Finding, ProbeContext, Status
from probes.gpu.links import GpuLinksProbe
from probes.interconnect.config import NVLINK_STATE, PORTS_STATE, InterconnectConfig
from probes.interconnect.ports import InterconnectPortsProbe
from probes.runtime.host import Host


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def ctx(tree: InfinibandTree, state_dir: str) -> ProbeContext:
    return ProbeContext(Host(sys=tree.sys), parse_config({"interconnect": {"state_dir": state_dir}}), 5.0)


def port_findings(output: list[object]) -> dict[str, Finding]:
    return {item.subject: item for item in output if isinstance(item, Finding)}


def test_the_default_is_the_host_directory_the_daemonset_mounts() -> None:
    settings = InterconnectConfig()
    assert settings.state_dir == "/var/lib/node-health"
    assert settings.state_path(PORTS_STATE) == "/var/lib/node-health/interconnect-ports.json"
    assert settings.state_path(NVLINK_STATE) == "/var/lib/node-health/gpu-nvlink.json"
    assert InterconnectConfig(state_dir="").state_path(PORTS_STATE) == ""  # memory only


@pytest.mark.parametrize("value", ["var/lib/node-health", "./state", "state"])
def test_a_relative_state_dir_is_a_config_error_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=r"interconnect\.state_dir"):
        parse_config({"interconnect": {"state_dir": value}})


def test_both_probes_keep_their_windows_in_their_own_file_under_state_dir(tmp_path: Path) -> None:
    tree = node(tmp_path / "sys")
    state = tmp_path / "var-lib-node-health"
    InterconnectPortsProbe(Clock()).run(ctx(tree, str(state)))
    run(tmp_path, Node(), GpuLinksProbe(GpuClock()), state_dir=str(state))
    assert sorted(p.name for p in state.iterdir()) == [NVLINK_STATE, PORTS_STATE]
    ports = json.loads((state / PORTS_STATE).read_text())["counters"]
    nvlink = json.loads((state / NVLINK_STATE).read_text())["counters"]
    assert "mlx5_0/1 link_downed" in ports and not any(key.startswith("mlx5") for key in nvlink)
    assert any(key.endswith("/11 recovery_errors") for key in nvlink)
    assert oct((state / PORTS_STATE).stat().st_mode & 0o777) == "0o600"


def test_an_unwritable_state_dir_keeps_the_windows_in_memory_says_so_and_logs_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tree = node(tmp_path / "sys")
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the directory should be\n")
    clock = Clock()
    probe = InterconnectPortsProbe(clock)
    with caplog.at_level(logging.WARNING, logger="probes.interconnect.window"):
        probe.run(ctx(tree, str(blocked)))
        tree.set_counter("mlx5_4/1", "link_downed", 1)
        clock.now += 30
        out = port_findings(probe.run(ctx(tree, str(blocked))))
        clock.now += 30
        probe.run(ctx(tree, str(blocked)))
    # judged from memory within this agent's life: the increase still counts
    assert out["mlx5_4/1"].reason == "HcaPortFlapping" and out["mlx5_4/1"].status == Status.FAIL
    assert "cannot keep the counter baseline" in str(out["mlx5_0/1"].observed["state_error"])
    assert out["mlx5_0/1"].status == Status.OK  # an unwritable directory is no fault of the port
    warnings = [r for r in caplog.records if "cannot keep the counter baseline" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert blocked.read_text() == "a file where the directory should be\n"
    # the directory appears (the mount is fixed): the note goes away
    blocked.unlink()
    probe.run(ctx(tree, str(blocked)))
    assert "state_error" not in port_findings(probe.run(ctx(tree, str(blocked))))["mlx5_0/1"].observed


def test_the_state_file_is_never_written_through_a_symlink(tmp_path: Path) -> None:
    tree = node(tmp_path / "sys")
    state = tmp_path / "state"
    state.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    # a link at the temporary name the writer uses, and one at the file itself
    (state / f".{PORTS_STATE}.{os.getpid()}.tmp").symlink_to(victim)
    InterconnectPortsProbe(Clock()).run(ctx(tree, str(state)))
    assert victim.read_text() == "keep\n"
    assert not (state / PORTS_STATE).is_symlink() and json.loads((state / PORTS_STATE).read_text())["version"] == 1
    (state / PORTS_STATE).unlink()
    (state / PORTS_STATE).symlink_to(victim)
    InterconnectPortsProbe(Clock()).run(ctx(tree, str(state)))  # the link is read as a bad baseline, replaced
    assert victim.read_text() == "keep\n" and not (state / PORTS_STATE).is_symlink()
