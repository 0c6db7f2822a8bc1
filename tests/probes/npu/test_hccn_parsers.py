"""hccn_tool parsers, faultCode.json grading and the HBM ECC parser on the sourced outputs of tests/fixtures
(hccn_tool/SOURCES.md, npu-smi/SOURCES.md): every variant, and output that is not understood."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from probes.base import ProbeParseError
from probes.npu.ecc import parse_ecc
from probes.npu.fault_codes import BUILTIN, FaultCodeError, load_table
from probes.npu.hccn_parse import (
    parse_gateway,
    parse_hccn_conf,
    parse_ip,
    parse_link,
    parse_link_stat,
    parse_net_health,
    parse_optical,
)
from probes.npu.link_window import LinkWindow

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def hccn(name: str) -> str:
    return (FIXTURES / "hccn_tool" / name).read_text()


def smi(name: str) -> str:
    return (FIXTURES / "npu-smi" / name).read_text()


def test_link_up_and_down() -> None:
    assert parse_link(hccn("link-up-doc.txt")) == "UP"
    assert parse_link(hccn("link-down-hccn_tool-go.txt")) == "DOWN"


@pytest.mark.parametrize("name", ["link_stat-device-doc.txt", "link_stat-devid-faultdiag.txt"])
def test_link_stat_both_prefixes(name: str) -> None:
    stat = parse_link_stat(hccn(name))
    assert (stat.up_count, stat.down_count) == (2, None)


def test_link_stat_flapping_variant() -> None:
    assert parse_link_stat(hccn("link_stat-flapping-DERIVED.txt")).up_count == 9


@pytest.mark.parametrize(
    ("name", "status"),
    [
        ("net_health-success-doc.txt", "Success"),
        ("net_health-fault-doc.txt", "Fault"),
        ("net_health-init-doc.txt", "Init"),
        ("net_health-socket-failed-faultdiag.txt", "Socket failed"),
    ],
)
def test_net_health(name: str, status: str) -> None:
    assert parse_net_health(hccn(name)) == status


def test_optical_not_present_with_loss_of_signal() -> None:
    optical = parse_optical(hccn("optical-not-present-rx-los-faultdiag.txt"))
    assert not optical.present and optical.rx_los and optical.rx_lol and not optical.tx_los
    assert optical.rx_power_mw == (1.0189, 0.0054, 0.9907, 1.0213)
    assert optical.tx_power_mw[0] == 4.4035
    assert optical.temperature_celsius == 47
    assert optical.thresholds == {
        "tx_low": 0.2818,
        "tx_high": 3.5481,
        "rx_low": 0.1445,
        "rx_high": 3.5481,
        "temp_high": 70,
    }


def test_optical_present_variants() -> None:
    los = parse_optical(hccn("optical-present-rx-los-DERIVED.txt"))
    assert los.present and los.rx_los
    healthy = parse_optical(hccn("optical-present-healthy-DERIVED.txt"))
    assert healthy.present and not (healthy.rx_los or healthy.rx_lol or healthy.tx_los or healthy.tx_lol)
    assert min(healthy.rx_power_mw) > healthy.thresholds["rx_low"]


def test_ip_configured_and_empty() -> None:
    configured = parse_ip(hccn("ip-configured-faultdiag.txt"))
    assert (configured.address, configured.netmask) == ("192.161.200.10", "255.255.255.0")
    empty = parse_ip(hccn("ip-empty-faultdiag.txt"))
    assert (empty.address, empty.netmask) == (None, None)


def test_gateway() -> None:
    assert parse_gateway(hccn("gateway-format-unverified.txt")) == "192.161.200.1"
    assert parse_gateway("") is None


@pytest.mark.parametrize(
    "parser", [parse_link, parse_link_stat, parse_net_health, parse_optical, parse_ip], ids=lambda f: f.__name__
)
def test_unparseable_output_is_a_parse_error(parser: object) -> None:
    with pytest.raises(ProbeParseError):
        parser(hccn("unparseable.txt"))  # type: ignore[operator]


def test_an_address_that_is_not_one_is_a_parse_error() -> None:
    with pytest.raises(ProbeParseError, match="ipaddr"):
        parse_ip("ipaddr:999.1.1.1\nnetmask:255.255.255.0\n")


def test_hccn_conf() -> None:
    text = "address_0=192.161.200.10\nnetmask_0=255.255.255.0\ngateway_0=192.161.200.1\n# x\nnetdetect_0=1.2.3.4\n"
    conf = parse_hccn_conf(text + "address_3=192.161.203.10\n")
    assert conf[0].address == "192.161.200.10" and conf[0].gateway == "192.161.200.1"
    assert conf[3].netmask is None


# --- link window -------------------------------------------------------------------------------------


def test_flaps_window_survives_a_restart_and_a_reset_is_not_a_burst(tmp_path: Path) -> None:
    path = tmp_path / "state" / "flaps.json"
    first = LinkWindow(path)
    assert first.observe({0: 2, 1: 5}, 1000.0, 600)[0].increase == 0
    assert first.observe({0: 4, 1: 5}, 1060.0, 600)[0].increase == 2
    again = LinkWindow(path)  # an agent restart: the baseline is read back
    seen = again.observe({0: 5, 1: 1}, 1120.0, 600)
    assert seen[0].increase == 3
    assert seen[1].reset and seen[1].increase == 0  # 5 → 1: a driver reload, not a burst
    assert again.observe({0: 5, 1: 2}, 2000.0, 600)[0].increase == 0  # the window moved past the flaps


def test_a_corrupt_or_unwritable_state_file_keeps_the_window_in_memory(tmp_path: Path) -> None:
    path = tmp_path / "flaps.json"
    path.write_text("{not json")
    window = LinkWindow(path)
    window.observe({0: 1}, 10.0, 600)
    assert window.error == ""  # read error, then rewritten
    assert json.loads(path.read_text())["chips"]["0"] == [[10.0, 1]]
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere")
    LinkWindow(link).observe({0: 1}, 10.0, 600)
    assert not link.is_symlink() and not (tmp_path / "elsewhere").exists()  # replaced, never followed
    (tmp_path / "file").write_text("")
    blocked = LinkWindow(tmp_path / "file" / "flaps.json")  # its directory cannot be made
    assert blocked.observe({0: 1}, 10.0, 600)[0].increase == 0
    assert blocked.observe({0: 4}, 20.0, 600)[0].increase == 3  # in memory
    assert "kept in memory" in blocked.error


# --- grading -----------------------------------------------------------------------------------------


def test_builtin_table_and_a_file(tmp_path: Path) -> None:
    builtin = load_table([str(tmp_path / "absent.json")])
    grade = builtin.grade("80e18402")
    assert (grade.level, grade.source) == ("SeparateNPU", BUILTIN["80E18402"][1])
    assert builtin.grade("DEADBEEF").level == "NotHandleFault"
    path = tmp_path / "faultCode.json"
    path.write_text(json.dumps({"SeparateNPUCodes": ["80CB8009"], "NotHandleFaultCodes": ["80E18402"]}))
    table = load_table([str(path)])
    assert table.grade("80CB8009").level == "SeparateNPU" and table.grade("80CB8009").source == str(path)
    assert table.grade("80E18402").level == "NotHandleFault"


@pytest.mark.parametrize("content", ["{oops", "[1, 2]", '{"SeparateNPUCodes": "80E18402"}', '{"Other": []}'])
def test_a_malformed_fault_code_file_names_the_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "faultCode.json"
    path.write_text(content)
    with pytest.raises(FaultCodeError, match=str(path)):
        load_table([str(path)])


# --- ecc ---------------------------------------------------------------------------------------------


def test_ecc_910a_and_950() -> None:
    zero = parse_ecc(smi("910a-t-ecc-i1-ddr-and-hbm-docexample-mindcluster.txt"))
    assert (zero.single_bit, zero.double_bit, zero.pending) == (0, 0, 0)
    assert parse_ecc(smi("950-docexample-t-ecc-i0.txt")).pending == 0
    derived = smi("950-docexample-t-ecc-i0.txt").replace(
        "HBM Double Bit Next-Isolated Pages Count : 0", "HBM Double Bit Next-Isolated Pages Count : 3"
    )
    assert parse_ecc(derived).pending == 3


def test_ecc_unparseable() -> None:
    with pytest.raises(ProbeParseError):
        parse_ecc(hccn("unparseable.txt").replace("@@@@", "x : y"))
