"""npu-smi parsers on every captured output in fixtures/npu-smi, with expectations read off each file."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.system import FIXTURES, require_fixtures

from probes.base import ProbeParseError
from probes.npu.completeness import CardCount, parse_card_list, read_table, shortfall, table_cut
from probes.npu.details import (
    ChipMapping,
    parse_health,
    parse_key_values,
    parse_mapping,
    parse_proc_mem,
    resolve_ids,
)
from probes.npu.info_table import NpuInfo, NpuSmiParseError, parse_info
from probes.npu.smi import classify_failure
from probes.runtime.commands import CommandResult

NPU_FIXTURES = FIXTURES / "npu-smi"


def fixture(name: str) -> str:
    return (require_fixtures() / "npu-smi" / name).read_text()


def info(name: str) -> NpuInfo:
    return parse_info(fixture(name))


def summary(parsed: NpuInfo) -> list[tuple]:
    return [(c.card_id, c.chip_index, c.logical_id, c.physical_id, c.name, c.health) for c in parsed.chips]


# --- npu-smi info: one test per file -----------------------------------------------------------------


def test_310_atlas800_20_2_0_oldest_80_column_layout() -> None:
    parsed = info("310-atlas800-3000-4chip-info-20.2.0.txt")
    assert parsed.version == "20.2.0"
    assert summary(parsed) == [(215, i, i, None, "310", "OK") for i in range(4)]
    assert [c.temperature_celsius for c in parsed.chips] == [56, 57, 57, 55]
    assert [c.bus_id for c in parsed.chips] == ["0000:DA:00.0", "0000:DC:00.0", "0000:DD:00.0", "0000:DB:00.0"]
    assert all(c.power_watts == 12.8 and c.aicore_percent == 0 for c in parsed.chips)
    assert all((c.memory_used_mib, c.memory_total_mib) == (2703, 8192) for c in parsed.chips)
    assert all(c.hbm_total_mib is None and c.hugepages_total is None for c in parsed.chips)
    assert not parsed.has_process_table and all(c.processes is None for c in parsed.chips)
    assert parsed.chips[0].device_memory() == ("ddr", 2703, 8192)


def test_310_atlas800_21_0_4_device_column_is_the_logical_id() -> None:
    parsed = info("310-atlas800-3000-4chip-info-21.0.4.txt")
    assert parsed.version == "21.0.4.B030"
    assert summary(parsed) == [(6, i, 3 + i, None, "310", "OK") for i in range(4)]
    assert [c.temperature_celsius for c in parsed.chips] == [73, 74, 70, 65]
    assert all((c.hugepages_used, c.hugepages_total) == (0, 970) for c in parsed.chips)
    assert [c.memory_used_mib for c in parsed.chips] == [2703, 2867, 2867, 2867]


def test_310b4_devkit_alarm_no_process_table() -> None:
    parsed = info("310b4-devkit-ALARM-noproc-info-23.0.0.txt")
    assert summary(parsed) == [(0, 0, 0, None, "310B4", "Alarm")]
    chip = parsed.chips[0]
    assert chip.bus_id is None  # printed as NA
    assert (chip.power_watts, chip.temperature_celsius) == (0.0, 65)
    assert (chip.hugepages_used, chip.hugepages_total) == (15, 15)
    assert (chip.memory_used_mib, chip.memory_total_mib) == (3628, 15609)
    assert chip.processes is None


def test_310p3_duo_card_id_1792_is_not_an_index() -> None:
    parsed = info("310p3-duo-1card-2chip-cardid1792-info-24.1.rc2.txt")
    assert summary(parsed) == [(1792, 0, 0, None, "310P3", "OK"), (1792, 1, 1, None, "310P3", "OK")]
    assert [c.power_watts for c in parsed.chips] == [None, None]  # NA on 310P
    assert [(c.memory_used_mib, c.memory_total_mib) for c in parsed.chips] == [(1821, 44280), (1041, 43693)]
    assert [c.bus_id for c in parsed.chips] == ["0000:07:00.0", "0000:07:00.0"]
    assert [c.processes for c in parsed.chips] == [(), ()]  # "No running processes found in NPU 1792"


def test_310p3_duo_busy_pairs_without_space_before_slash() -> None:
    parsed = info("310p3-duo-2card-4chip-busy-mindie-procs-hugepages-info-24.1.0.1.txt")
    assert summary(parsed) == [
        (1, 0, 0, None, "310P3", "OK"),
        (1, 1, 1, None, "310P3", "OK"),
        (2, 0, 2, None, "310P3", "OK"),
        (2, 1, 3, None, "310P3", "OK"),
    ]
    assert [(c.memory_used_mib, c.memory_total_mib) for c in parsed.chips] == [
        (16302, 44280),
        (15543, 43693),
        (35563, 44280),
        (35204, 43693),
    ]
    assert [c.hugepages_used for c in parsed.chips] == [7210, 7210, 17057, 16823]
    assert [[(p.pid, p.name, p.memory_mib) for p in c.processes or ()] for c in parsed.chips] == [
        [(3277562, "mindie_llm_back", 14513)],
        [(3277565, "mindie_llm_back", 14513)],
        [(3034986, "mindie_llm_back", 34207)],
        [(3034989, "mindie_llm_back", 33740)],
    ]


def test_910a_ddr_and_hbm_columns() -> None:
    parsed = info("910a-atlas800-9010-8card-healthy-info-22.0.3.1.txt")
    assert summary(parsed) == [(card, 0, None, None, "910A", "OK") for card in range(8)]
    assert [c.power_watts for c in parsed.chips] == [67.2, 63.3, 64.8, 191.7, 66.4, 62.7, 64.5, 191.4]
    assert [c.memory_used_mib for c in parsed.chips] == [1867, 1867, 1868, 1866, 1867, 1865, 1865, 1866]
    assert all(c.memory_total_mib == 15077 and (c.hbm_used_mib, c.hbm_total_mib) == (0, 32768) for c in parsed.chips)
    assert parsed.chips[3].bus_id == "0000:3E:00.0"
    assert parsed.chips[0].device_memory() == ("hbm", 0, 32768)
    assert not parsed.has_process_table


def test_910b1_in_container_process_without_name() -> None:
    parsed = info("910b1-8card-healthy-1proc-info-24.1.0.txt")
    assert parsed.version == "24.1.0"
    assert summary(parsed) == [(card, 0, None, None, "910B1", "OK") for card in range(8)]
    assert [c.hbm_used_mib for c in parsed.chips] == [3437, 3378, 3376, 3377, 3377, 3376, 3377, 3380]
    assert all(c.hbm_total_mib == 65536 and (c.memory_used_mib, c.memory_total_mib) == (0, 0) for c in parsed.chips)
    assert [(p.pid, p.name, p.memory_mib) for p in parsed.chips[0].processes or ()] == [(641248, "", 113)]
    assert all(c.processes == () for c in parsed.chips[1:])
    assert parsed.chips[0].device_memory() == ("hbm", 3437, 65536)


def test_910b2c_trailing_spaces_and_process_block_closed_by_dashes() -> None:
    parsed = info("910b2c-2card-1proc-info-23.0.2.1-trailing-spaces.txt")
    assert summary(parsed) == [(0, 0, None, None, "910B2C", "OK"), (1, 0, None, None, "910B2C", "OK")]
    assert [c.hbm_used_mib for c in parsed.chips] == [20701, 20687]
    assert [c.power_watts for c in parsed.chips] == [88.6, 99.6]
    assert [(p.pid, p.name, p.memory_mib) for p in parsed.chips[0].processes or ()] == [(124528, "python3.8", 17400)]
    assert parsed.chips[1].processes == ()


def test_910b3_26_1_wide_layout_with_process_id_in_container() -> None:
    parsed = info("910b3-8card-1proc-info-26.1.0-WIDE-layout-testfixture.txt")
    assert parsed.version == "26.1.0"
    assert summary(parsed) == [(card, 0, None, None, "910B3", "OK") for card in range(8)]
    assert [c.hbm_used_mib for c in parsed.chips] == [8676, 3403, 3403, 3407, 3403, 3402, 3402, 3403]
    assert [c.power_watts for c in parsed.chips][:2] == [100.0, 94.8]
    process = (parsed.chips[0].processes or ())[0]
    assert (process.pid, process.name, process.memory_mib, process.container_pid) == (485946, "pytest", 5175, None)


def test_910b3_truncated_output_without_process_section() -> None:
    parsed = info("910b3-8card-healthy-info-24.1.rc1-noproc-section.txt")
    assert parsed.version == "24.1.rc1.b030"
    assert len(parsed.chips) == 8
    assert [c.hbm_used_mib for c in parsed.chips] == [3318, 3314, 3314, 3314, 3314, 3314, 3314, 3315]
    assert [c.power_watts for c in parsed.chips][-2:] == [103.8, 98.2]
    assert not parsed.has_process_table and all(c.processes is None for c in parsed.chips)


def test_910b3_container_view_with_irregular_alignment() -> None:
    parsed = info("910b3-container-only-card3-visible-info-25.2.3-IRREGULAR-ALIGNMENT.txt")
    assert summary(parsed) == [(3, 0, None, None, "910B3", "OK")]
    chip = parsed.chips[0]
    assert (chip.power_watts, chip.temperature_celsius, chip.hbm_used_mib, chip.hbm_total_mib) == (
        92.8,
        36,
        3198,
        65536,
    )
    assert chip.processes == ()
    # Inside a container logical ids start at 0; -m is not available here, so table order decides.
    assert resolve_ids(parsed.chips, None)[0].logical_id == 0


def test_950_layout_npu_id_in_its_own_cell_and_no_chip_column() -> None:
    parsed = info("950-docexample-info-1card.txt")
    assert parsed.version == "x.x.x"
    assert not parsed.has_chip_column
    assert summary(parsed) == [(0, 0, None, None, "xxx", "OK")]
    chip = parsed.chips[0]
    assert (chip.power_watts, chip.temperature_celsius, chip.aicore_percent) == (204.4, 56, 0)
    assert (chip.hbm_used_mib, chip.hbm_total_mib, chip.bus_id) == (4439, 86016, "0000:91:00.0")
    assert chip.processes == ()


def test_a3_two_dies_per_card_with_phy_id() -> None:
    parsed = info("a3-910_93-2card-4chip-1proc-info-25.2.0.txt")
    assert summary(parsed) == [
        (0, 0, None, 0, "Ascend910", "OK"),
        (0, 1, None, 1, "Ascend910", "OK"),
        (1, 0, None, 2, "Ascend910", "OK"),
        (1, 1, None, 3, "Ascend910", "OK"),
    ]
    assert [c.power_watts for c in parsed.chips] == [162.8, None, 167.1, None]  # die 1 prints "-"
    assert [c.hbm_used_mib for c in parsed.chips] == [3133, 2876, 3116, 10568]  # "10568/ 65536"
    assert [c.processes for c in parsed.chips][:3] == [(), (), ()]
    assert [(p.pid, p.name, p.memory_mib) for p in parsed.chips[3].processes or ()] == [(990711, "python", 7746)]
    resolved = resolve_ids(parsed.chips, None)
    assert [(c.logical_id, c.device_number) for c in resolved] == [(0, 0), (1, 1), (2, 2), (3, 3)]


@pytest.mark.parametrize(
    "name",
    [
        "310-atlas800-3000-4chip-m-mapping-20.2.0.txt",
        "910a-t-board-card-level-i0-faultdiag.txt",
        "910a-t-health-ALARM-errorcodes-heartbeat-lost-i0-c0-faultdiag.txt",
        "910a-lspci-grep-acce-d801-faultdiag.txt",
        "910b3-8card-topo-24.1.rc1.txt",
        "driver-version-info-23.0.7-faultdiag.txt",
        "error-dcmi-init-failed-8005-in-container-vllm-ascend-issue2698.txt",
        "910a-t-board-invalid-card-id-error-faultdiag.txt",
    ],
)
def test_info_parser_rejects_other_outputs_with_its_own_error(name: str) -> None:
    with pytest.raises(NpuSmiParseError):
        parse_info(fixture(name))


def test_eight_processes_mark_the_chip_truncated() -> None:
    text = fixture("a3-910_93-2card-4chip-1proc-info-25.2.0.txt")
    row = "| 1       1                 | 990711        | python                   | 7746                    |"
    rows = "\n".join(row.replace("990711", str(990711 + i)) for i in range(8))
    parsed = parse_info(text.replace(row, rows))
    assert len(parsed.chips[3].processes or ()) == 8 and parsed.chips[3].processes_truncated
    assert not parsed.chips[2].processes_truncated


def test_health_words_and_name_with_spaces_are_read_from_the_cell() -> None:
    text = fixture("910b1-8card-healthy-1proc-info-24.1.0.txt")
    text = text.replace("| 1     910B1               | OK     ", "| 1     Ascend 910B1        | Warning")
    parsed = parse_info(text)
    assert (parsed.chips[1].name, parsed.chips[1].health) == ("Ascend 910B1", "Warning")


# --- npu-smi info -m -------------------------------------------------------------------------------


def test_mapping_310_irregular_spacing() -> None:
    rows = parse_mapping(fixture("310-atlas800-3000-4chip-m-mapping-20.2.0.txt"))
    assert rows == tuple(ChipMapping(215, i, i, None, "MiniD") for i in range(4))


def test_mapping_skips_the_mcu_row() -> None:
    rows = parse_mapping(fixture("310-atlas800-3000-4chip-m-mapping-with-mcu-21.0.4.txt"))
    assert rows == tuple(ChipMapping(6, i, i, None, "MiniD") for i in range(4))


@pytest.mark.parametrize(
    "name",
    [
        "910a-8card-m-mapping-faultdiag.txt",  # TAB-indented
        "910a-atlas800-9010-8card-m-mapping-22.0.3.1.txt",
        "910a-atlas800-9010-8card-m-mapping-24.1.RC2.txt",
    ],
)
def test_mapping_910a_chip_name_with_a_space(name: str) -> None:
    assert parse_mapping(fixture(name)) == tuple(ChipMapping(card, 0, card, None, "Ascend 910A") for card in range(8))


def test_mapping_950_slot_and_phy_id_columns() -> None:
    assert parse_mapping(fixture("950-docexample-m-mapping.txt")) == (ChipMapping(0, 0, None, 0, "xxx"),)


def test_mapping_fills_logical_ids_of_the_910a_table() -> None:
    table = info("910a-atlas800-9010-8card-healthy-info-22.0.3.1.txt")
    mapping = parse_mapping(fixture("910a-atlas800-9010-8card-m-mapping-22.0.3.1.txt"))
    assert [c.logical_id for c in resolve_ids(table.chips, mapping)] == list(range(8))


def test_mapping_rejects_a_table() -> None:
    with pytest.raises(NpuSmiParseError):
        parse_mapping(fixture("910b1-8card-healthy-1proc-info-24.1.0.txt"))


# --- -t outputs ------------------------------------------------------------------------------------


def test_health_alarm_hex_codes_and_multi_line_information() -> None:
    detail = parse_health(fixture("910a-t-health-ALARM-errorcodes-heartbeat-lost-i0-c0-faultdiag.txt"))
    assert detail.health == "Alarm"
    assert detail.error_codes == ("A4025021", "8C03A000", "8C084E00")
    assert detail.error_information == (
        "ascend_monitor adda heart beat lost error",
        "node type=process-manager, sensor type=General Software, event state=The process start failed or exit "
        "abnormally",
        "node type=adda, sensor type=Heartbeat Sensor, event state=Heartbeat Lost.",
    )


def test_health_ok_without_final_newline() -> None:
    detail = parse_health(fixture("910a-t-health-OK-i0-c0-faultdiag.txt"))
    assert (detail.health, detail.error_codes, detail.error_information) == ("OK", (), ())


def test_health_950_card_level() -> None:
    detail = parse_health(fixture("950-docexample-t-health-i0.txt"))
    assert (detail.health, detail.error_codes, detail.error_information) == ("OK", (), ())


def test_health_rejects_non_hex_codes() -> None:
    with pytest.raises(NpuSmiParseError):
        parse_health("\tHealth Status : Alarm\n\tError Code : A4025021 zz\n")


def test_proc_mem_950() -> None:
    processes = parse_proc_mem(fixture("950-docexample-t-proc-mem-i0.txt"))
    assert [(p.pid, p.name, p.memory_mib) for p in processes] == [(395864, "power_test", 5118)]


def test_proc_mem_empty_device_and_empty_name() -> None:
    assert parse_proc_mem("\tNo process in device.\n") == ()
    text = "\tProcess id:12     Process name:                  Process memory(MB):5\n"
    assert [(p.pid, p.name, p.memory_mib) for p in parse_proc_mem(text)] == [(12, "", 5)]


def test_proc_mem_rejects_unsupported_message() -> None:
    with pytest.raises(NpuSmiParseError):
        parse_proc_mem("This device does not support querying proc-mem.\n")


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [
        ("910a-t-board-card-level-i0-faultdiag.txt", "PCIe Bus Info", "0000:61:00.0"),
        ("910a-t-board-chip-level-i0-c0-faultdiag.txt", "VDie ID", "42C711D4 20B03704 4A10C8D4 14CC040A D2102003"),
        ("910a-t-ecc-i1-ddr-and-hbm-docexample-mindcluster.txt", "HBM Double Bit Isolated Pages Count", "0"),
        ("910b-l-list-8card-25.5.1-yunion-telegraf.txt", "Total Count", "8"),
        ("910b-t-board-card-level-i0-d802-25.5.1-yunion-telegraf.txt", "PCI Device ID", "0xD802"),
        ("910b-t-power-i0-25.5.1-yunion-telegraf.txt", "NPU Real-time Power(W)", "103.5"),
        ("910b-t-temp-i0-with-mcu-25.5.1-yunion-telegraf.txt", "Chip Name", "MCU"),
        ("950-docexample-l-list.txt", "Product Name", "A5 PCIe Card"),
        ("950-docexample-t-board-i0.txt", "PCI Device ID", "0xD806"),
        ("950-docexample-t-ecc-i0.txt", "HBM Double Bit Next-Isolated Pages Count", "0"),
        ("950-docexample-t-memory-i0.txt", "HBM Capacity(MB)", "131072"),
        ("950-docexample-t-current-fault-event-i0.txt", "Fault Event Count", "1"),
        ("910a-t-usages-i0-faultdiag.txt", "HBM Capacity(MB)", "31129"),
        ("910b-t-usages-i0-25.5.1-yunion-telegraf.txt", "HBM Usage Rate(%)", "5"),
        ("950-docexample-t-usages-i0.txt", "Ctrlcpu Usage Rate(%)", "40"),
    ],
)
def test_other_key_value_outputs(name: str, key: str, value: str) -> None:
    assert dict(parse_key_values(fixture(name)))[key] == value


# --- failures --------------------------------------------------------------------------------------


def result(stdout: str = "", stderr: str = "", rc: int | None = 1, **flags: bool) -> CommandResult:
    return CommandResult(("npu-smi", "info"), rc, stdout, stderr, 0.1, **flags)


def test_failure_8005_from_the_real_capture() -> None:
    failure = classify_failure(result(fixture("error-dcmi-init-failed-8005-in-container-vllm-ascend-issue2698.txt")))
    assert failure is not None and failure.kind == "dcmi_init_failed" and failure.ret == -8005
    assert "dcmi module initialize failed" in failure.message and "npu.holders" in failure.hint


def test_failure_8020_says_the_device_is_held() -> None:
    text = "dcmi model initialized failed, because the device is used. ret is -8020\n"
    failure = classify_failure(result(text))
    assert failure is not None and failure.kind == "device_busy" and failure.ret == -8020
    assert "held by another container or process" in failure.message


def test_failure_invalid_card_id() -> None:
    failure = classify_failure(result(fixture("910a-t-board-invalid-card-id-error-faultdiag.txt"), rc=0))
    assert failure is not None and failure.kind == "invalid_argument"


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [
        ({"rc": None, "timed_out": True}, "timeout"),
        ({"rc": None, "not_found": True}, "not_installed"),
        ({"rc": 127, "not_found": True, "stderr": "nsenter: failed to execute npu-smi: No such file"}, "not_installed"),
        ({"rc": None, "permission_denied": True}, "permission_denied"),
        ({"rc": 1, "stderr": "open /dev/davinci_manager failed: Permission denied"}, "permission_denied"),
        ({"rc": 1, "stdout": "get device count failed. ret is -8008"}, "dcmi_error"),
        ({"rc": 3, "stdout": ""}, "exit_status"),
    ],
)
def test_failure_kinds(kwargs: dict, kind: str) -> None:
    failure = classify_failure(result(**kwargs), timeout=2.0)
    assert failure is not None and failure.kind == kind and failure.message


def test_a_table_is_not_a_failure() -> None:
    assert classify_failure(result(fixture("950-docexample-info-1card.txt"), rc=0)) is None


# --- coverage of the fixture directory, and robustness -------------------------------------------


# --- is the table whole? ----------------------------------------------------------------------------


def test_card_list_counts_the_npus_and_their_chips() -> None:
    counted = parse_card_list(fixture("910b-l-list-8card-25.5.1-yunion-telegraf.txt"))
    assert (counted.total, counted.chips, counted.chip_total) == (8, dict.fromkeys(range(8), 1), 8)
    assert parse_card_list(fixture("950-docexample-l-list.txt")).total >= 1
    with pytest.raises(NpuSmiParseError, match="Total Count"):
        parse_card_list("NPU ID : 0\nChip Count : 1\n")


def test_a_table_is_cut_when_it_ends_in_a_row_and_whole_when_its_process_section_names_every_card() -> None:
    whole = fixture("910b1-8card-healthy-1proc-info-24.1.0.txt")
    assert table_cut(whole) == "" and table_cut(whole + "\nsome warning after the table\n") == ""
    assert "without its closing border" in table_cut("\n".join(whole.splitlines()[:-1]))
    parsed = parse_info(whole)
    assert parsed.process_cards == frozenset(range(8))
    assert shortfall(parsed, None, "-l not supported") == ""  # every card named: whole, the chip is missing
    assert shortfall(parsed, CardCount(8, dict.fromkeys(range(8), 1)), "") == ""
    assert "counts 9 NPUs" in shortfall(parsed, CardCount(9, {}), "")
    partial = info("910b2c-2card-1proc-info-23.0.2.1-trailing-spaces.txt")  # the process block names card 0 only
    assert partial.process_cards == frozenset({0})
    assert "names only some of them" in shortfall(partial, None, "timeout")
    assert "is absent" in shortfall(info("910b3-8card-healthy-info-24.1.rc1-noproc-section.txt"), None, "timeout")


PROCESS_TABLES = [
    "910b1-8card-healthy-1proc-info-24.1.0.txt",
    "a3-910_93-2card-4chip-1proc-info-25.2.0.txt",
    "310p3-duo-2card-4chip-busy-mindie-procs-hugepages-info-24.1.0.1.txt",
    "910b3-8card-1proc-info-26.1.0-WIDE-layout-testfixture.txt",
]


def _cuts(text: str) -> dict[str, tuple[str, set[int]]]:
    """The real table cut at each point of its process section: name → (cut text, cards whose processes are
    still known: named in a block closed before the cut)."""
    lines = text.rstrip("\n").splitlines()
    header = next(i for i, line in enumerate(lines) if "Process id" in line)
    first_block_end = next(i for i in range(header + 2, len(lines)) if lines[i].strip().startswith("+"))
    whole = parse_info(text)
    first_block = parse_info("\n".join(lines[: first_block_end + 1])).process_cards
    assert first_block and first_block != whole.process_cards
    return {
        "after the process header": ("\n".join(lines[: header + 1]), set()),
        "after the process header's border": ("\n".join(lines[: header + 2]), set()),
        "in the first process row": ("\n".join(lines[: header + 3])[:-9], set()),
        "after the first process row": ("\n".join(lines[: header + 3]), set()),
        "in the next block": ("\n".join(lines[: first_block_end + 2]), set(first_block)),
    }


@pytest.mark.parametrize("name", PROCESS_TABLES)
def test_a_table_cut_in_its_process_section_keeps_its_chips(name: str) -> None:
    """Cut after a complete, closed chip section: every chip's health and memory are read, and only the processes
    the cut took are unknown (None, which judges no HBM leak), said in `processes_cut`."""
    text = fixture(name)
    whole, why = read_table(text)
    assert whole is not None and why == "" and whole.processes_cut == ""
    for where, (cut, known) in _cuts(text).items():
        info, why = read_table(cut)
        assert info is not None and why == "", where
        assert [(c.card_id, c.chip_index, c.health, c.hbm_used_mib, c.memory_used_mib) for c in info.chips] == [
            (c.card_id, c.chip_index, c.health, c.hbm_used_mib, c.memory_used_mib) for c in whole.chips
        ], where
        unknown = sorted({c.card_id for c in whole.chips} - known)
        assert info.processes_cut.endswith(f"the processes of NPU {', '.join(map(str, unknown))} are unknown"), where
        for chip, full in zip(info.chips, whole.chips, strict=True):
            assert chip.processes == (full.processes if chip.card_id in known else None), (where, chip)


def test_a_table_cut_before_its_process_section_is_not_read() -> None:
    """Cut inside the chip section: the chips are not known whole, nothing is read (NpuTableTruncated); cut at a
    chip's border, the table reads as one of fewer chips, which `shortfall` tells from the node's chips."""
    lines = fixture("910b1-8card-healthy-1proc-info-24.1.0.txt").splitlines()
    header = next(i for i, line in enumerate(lines) if "Process id" in line)
    assert read_table("\n".join(lines[:8])) == (None, "the table ends in a row, without its closing border")
    assert read_table("\n".join(lines[:8])[:-5]) == (None, "the table ends in a cut line")
    info, why = read_table("\n".join(lines[:header]))  # the chip section closed, the process table not begun
    assert info is not None and len(info.chips) == 8 and not info.has_process_table and why == ""


def test_every_fixture_is_covered() -> None:
    """Every captured output has a test above that names it (and so reads it through `fixture`)."""
    present = {p.name for p in require_fixtures().joinpath("npu-smi").iterdir() if p.name != "SOURCES.md"}
    source = Path(__file__).read_text()
    assert {name for name in present if f'"{name}"' not in source} == set()


def _all_texts() -> list[str]:
    # Read at collection: a missing fixtures directory fails the run here instead of skipping tests.
    texts = [p.read_text() for p in sorted(require_fixtures().joinpath("npu-smi").iterdir()) if p.suffix == ".txt"]
    assert texts, f"no npu-smi fixtures in {NPU_FIXTURES}"
    return texts


TEXTS = _all_texts()
PARSERS = (
    parse_info,
    parse_mapping,
    parse_health,
    parse_proc_mem,
    parse_key_values,
    parse_card_list,
    table_cut,
    read_table,
)


@st.composite
def mutated(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(TEXTS))
    lines = text.splitlines()
    for _ in range(draw(st.integers(1, 4))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "swap", "char", "insert", "truncate", "cell"]))
        line = lines[i]
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, line)
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "truncate":
            lines[i] = line[: draw(st.integers(0, len(line)))]
        elif op == "cell":
            lines[i] = line.replace(
                draw(st.sampled_from(["OK", "0", "/", " ", "NA", "-"])), draw(st.text(max_size=3)), 1
            )
        else:
            at = draw(st.integers(0, len(line)))
            piece = draw(st.sampled_from(["|", "+", "/", "-", "NA", " ", ":", "x", "9" * 30, "\t", "1e999"]))
            lines[i] = line[:at] + piece + line[at + (1 if op == "char" else 0) :]
    return "\n".join(lines)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_outputs_raise_only_the_parsers_error(text: str) -> None:
    for parser in PARSERS:
        with contextlib.suppress(NpuSmiParseError):
            parser(text)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("+-=| /0123456789ABNOKPU:\n\tChipHealth"), max_size=400))
def test_random_text_raises_only_the_parsers_error(text: str) -> None:
    for parser in PARSERS:
        with contextlib.suppress(NpuSmiParseError):
            parser(text)


def test_the_parsers_error_is_a_probe_parse_error() -> None:
    # The scheduler turns ProbeParseError into unknown / ParseError; the parsers raise nothing else.
    assert issubclass(NpuSmiParseError, ProbeParseError)
