"""nvidia-smi parsers on every captured fixture (expectations written from reading each file), malformed input,
and the gpu probe's nvidia-smi fallback end to end with a fake `nvidia-smi` executable printing fixtures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.system import REPO, require_fixtures

from agent.config import parse_config
from agent.scheduler import execute
from probes.base import ProbeParseError
from probes.gpu.gpu import GpuProbe
from probes.gpu.nvidia_smi import (
    SmiParseError,
    inforom_corrupted_buses,
    parse_csv,
    parse_gpu_sections,
    parse_list,
    parse_query,
    parse_table,
    short_bus_id,
)
from probes.runtime.host import Host

MIB = 1024 * 1024


def fixture(name: str) -> str:
    return (require_fixtures() / "nvidia-smi" / name).read_text()


def tool_output(text: str) -> str:
    """A fixture without what SOURCES.md says its author added: prompt/command/comment lines, `[...]`
    elisions, and `<= ...` annotations after a value."""
    kept = []
    for line in text.splitlines():
        if line.startswith(("$ ", "#", "nvidia-smi ", "[...]")):
            continue
        kept.append(line.split("<=", 1)[0].rstrip())
    return "\n".join(kept) + "\n"


FULL_Q = "a100-sxm4-40gb-8gpu-q-full-460.32.03-healthy.txt"
REMAP_PENDING_Q = "a100-sxm4-80gb-q-excerpt-xid63-remapped-rows-PENDING-510.73.08.txt"
ECC_EXCERPT = "q-excerpt-ecc-errors-SRAM-uncorrectable.txt"
RETIRED_EXCERPT = "q-excerpt-retired-pages-PENDING-BLACKLIST-yes.txt"
H100_CSV = "h100-query-gpu-name-busid-vbios-csv-excerpt.txt"
RECOVERY_CSV = "query-gpu-index-recovery-action-csv-noheader-RESET-DCGM-issue263.txt"
TABLE = "v100-sxm2-8gpu-table-infoROM-corrupted-warning-460.32.03.txt"
LIST_UNKNOWN_ERROR = "nvidia-smi-L-one-gpu-unknown-error-sonar-issue72.txt"

A100_UUIDS = [
    "GPU-b01e9f90-c60c-4ad1-2052-154833662357",
    "GPU-fccd4a78-556b-7b41-320b-f2a10438c176",
    "GPU-0b64e86a-a39a-9261-7e62-798d98e599af",
    "GPU-e58a4615-3aae-089b-9161-2c78eb0bf227",
    "GPU-bf404e05-68b6-34c1-386f-94eda8a08cd7",
    "GPU-083904c0-9140-4a80-ae74-4c2682d585b3",
    "GPU-2d82fc40-f4a8-9df4-effd-d6f6f22c88d8",
    "GPU-1291f09c-b6e3-8fb1-6879-89b8b8a9dbc6",
]
A100_BUSES = [f"0000000{d}:00:00.0" for d in "1234BCDE"]


# --- -q --------------------------------------------------------------------------------------------


def test_full_q_a100_eight_healthy_gpus() -> None:
    query = parse_query(fixture(FULL_Q))
    assert (query.driver_version, query.attached_gpus) == ("460.32.03", 8)
    assert query.failures == [] and query.warnings == []
    assert [g.uuid for g in query.gpus] == A100_UUIDS
    assert [g.bus_id for g in query.gpus] == A100_BUSES
    assert [g.minor for g in query.gpus] == list(range(8))
    assert [g.temperature_celsius for g in query.gpus] == [41, 40, 40, 41, 39, 38, 39, 40]
    assert [g.power_watts for g in query.gpus] == [55.63, 56.96, 56.35, 56.14, 57.46, 55.03, 55.41, 55.47]
    for gpu in query.gpus:
        assert gpu.name == "A100-SXM4-40GB"
        assert (gpu.ecc_corrected_volatile, gpu.ecc_uncorrected_volatile) == (0, 0)
        assert (gpu.ecc_corrected_aggregate, gpu.ecc_uncorrected_aggregate) == (0, 0)
        # Retired Pages print N/A on A100 (row remapping replaced page retirement).
        assert (gpu.retired_pages_sbe, gpu.retired_pages_dbe, gpu.retired_pages_pending) == (None, None, None)
        assert (gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable) == (0, 0)
        assert (gpu.remap_pending, gpu.remap_failed) == (False, False)
        assert gpu.clock_event_reasons == 0x1  # only `Idle : Active`
        assert gpu.memory_total_bytes == gpu.memory_free_bytes == 40536 * MIB
        assert gpu.memory_used_bytes == 0
        assert gpu.processes == []  # `Processes : None`
        assert gpu.recovery_action is None  # not in 460's -q
        assert gpu.inforom_corrupted is False


def test_q_excerpt_a100_80gb_remap_pending() -> None:
    query = parse_query(fixture(REMAP_PENDING_Q))  # `[...]` elisions are tolerated as empty sections
    assert (query.driver_version, query.attached_gpus) == ("510.73.08", 8)
    assert len(query.gpus) == 1  # the author cut the other seven
    gpu = query.gpus[0]
    assert (gpu.name, gpu.bus_id, gpu.minor) == ("NVIDIA A100-SXM4-80GB", "00000000:10:1C.0", None)
    assert (gpu.ecc_corrected_volatile, gpu.ecc_uncorrected_volatile) == (177, 0)
    assert (gpu.ecc_corrected_aggregate, gpu.ecc_uncorrected_aggregate) == (177, 0)
    assert gpu.retired_pages_pending is None
    assert (gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable) == (1, 0)
    assert (gpu.remap_pending, gpu.remap_failed) == (True, False)
    assert gpu.processes is None and gpu.memory_free_bytes is None


def test_q_excerpt_ecc_sram_uncorrectable() -> None:
    gpu = parse_gpu_sections(fixture(ECC_EXCERPT))
    assert (gpu.ecc_corrected_volatile, gpu.ecc_uncorrected_volatile) == (0, 1)
    assert (gpu.ecc_corrected_aggregate, gpu.ecc_uncorrected_aggregate) == (0, 5)


def test_q_excerpt_retired_pages_pending_lower_case_section() -> None:
    gpu = parse_gpu_sections(fixture(RETIRED_EXCERPT))
    assert (gpu.retired_pages_sbe, gpu.retired_pages_dbe, gpu.retired_pages_pending) == (2, 0, True)


# Layouts no fixture shows, typed from NVIDIA's documented -q format: pre-Ampere ECC tables, the 535+
# `Clocks Event Reasons` name with the SRAM split, `GPU Power Readings`, and a process list.
PRE_AMPERE_AND_NEWER_LAYOUTS = """\
GPU 00000000:3B:00.0
    Product Name                          : Tesla V100-SXM2-32GB
    Minor Number                          : 3
    Clocks Event Reasons
        Idle                              : Not Active
        SW Power Cap                      : Active
        HW Slowdown                       : Active
            HW Thermal Slowdown           : Active
            HW Power Brake Slowdown       : Not Active
        SW Thermal Slowdown               : Not Active
    FB Memory Usage
        Total                             : 32768 MiB
        Reserved                          : 512 MiB
        Used                              : 20514 MiB
        Free                              : 11742 MiB
    ECC Errors
        Volatile
            Single Bit
                Device Memory             : 3
                Register File             : 0
                Total                     : 3
            Double Bit
                Device Memory             : 1
                Total                     : 1
        Aggregate
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 1
            SRAM Uncorrectable SEC-DED    : 2
            DRAM Correctable              : 4
            DRAM Uncorrectable            : 0
            SRAM Threshold Exceeded       : Yes
    Retired Pages                         : N/A
    Remapped Rows                         : N/A
    GPU Power Readings
        Power Draw                        : 250.10 W
    Processes
        GPU instance ID                   : N/A
        Compute instance ID               : N/A
        Process ID                        : 4242
            Type                          : C
            Name                          : python
            Used GPU Memory               : 20000 MiB
        GPU instance ID                   : N/A
        Compute instance ID               : N/A
        Process ID                        : 4343
            Type                          : G
            Name                          : Xorg
            Used GPU Memory               : 4 MiB
"""


def test_q_other_layout_families() -> None:
    gpu = parse_query(PRE_AMPERE_AND_NEWER_LAYOUTS).gpus[0]
    assert (gpu.minor, gpu.bus_id) == (3, "00000000:3B:00.0")
    assert gpu.clock_event_reasons == 0x4 | 0x8 | 0x40
    assert (gpu.memory_used_bytes, gpu.memory_free_bytes) == (20514 * MIB, 11742 * MIB)
    assert (gpu.ecc_corrected_volatile, gpu.ecc_uncorrected_volatile) == (3, 1)
    assert (gpu.ecc_corrected_aggregate, gpu.ecc_uncorrected_aggregate) == (4, 3)
    assert gpu.sram_threshold_exceeded is True
    assert (gpu.retired_pages_sbe, gpu.remapped_rows_correctable, gpu.remap_pending) == (None, None, None)
    assert gpu.power_watts == 250.10
    assert [(p.pid, p.kind, p.used_bytes) for p in gpu.processes or []] == [
        (4242, "compute", 20000 * MIB),
        (4343, "graphics", 4 * MIB),
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("GPU 00000000:3B:00.0\n    FB Memory Usage\n        Total : many MiB\n", "not a number"),
        ("GPU 00000000:3B:00.0\n    Clocks Event Reasons\n        Idle : Sometimes\n", "Active"),
        ("GPU 00000000:3B:00.0\n    Remapped Rows\n        Pending : Perhaps\n", "Yes nor No"),
        ("GPU 00000000:3B:00.0\n    Minor Number : x\n", "not an integer"),
        ("GPU 00000000:3B:00.0\n    Processes : lots\n", "Processes"),
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", "no `GPU"),
    ],
)
def test_q_malformed(text: str, error: str) -> None:
    with pytest.raises(SmiParseError, match=error):
        parse_query(text)
    assert issubclass(SmiParseError, ProbeParseError)


def test_dcgmi_outputs_are_not_nvidia_smi_q() -> None:
    for name in (
        "dcgmi-health-c-j-Healthy-despite-reset-DCGM-issue263.txt",
        "dcgmi-dmon-e230-xid120-DCGM-issue263.txt",
    ):
        with pytest.raises(SmiParseError):
            parse_query(fixture(name))


# --- CSV, -L, table --------------------------------------------------------------------------------


def test_csv_with_header_h100() -> None:
    rows = parse_csv(tool_output(fixture(H100_CSV)))
    assert rows == [
        {"name": "NVIDIA H100 80GB HBM3", "pci.bus_id": "00000000:04:00.0", "vbios_version": "96.00.89.00.01"},
        {"name": "NVIDIA H100 80GB HBM3", "pci.bus_id": "00000000:8B:00.0", "vbios_version": "96.00.89.00.01"},
    ]
    with pytest.raises(SmiParseError, match="columns"):  # the prompt line taken as the header
        parse_csv(fixture(H100_CSV))


def test_csv_noheader_recovery_action_gpu1_reset() -> None:
    rows = parse_csv(tool_output(fixture(RECOVERY_CSV)), ["index", "gpu_recovery_action"])
    assert [(row["index"], row["gpu_recovery_action"]) for row in rows] == [
        (str(i), "Reset" if i == 1 else "None") for i in range(8)
    ]
    with pytest.raises(SmiParseError, match="columns"):  # the author's comment and annotation
        parse_csv(fixture(RECOVERY_CSV), ["index", "gpu_recovery_action"])
    assert parse_csv("0, [N/A]\n", ["index", "gpu_recovery_action"]) == [{"index": "0", "gpu_recovery_action": None}]


def test_list_with_unknown_error_gpu() -> None:
    listed, failures = parse_list(fixture(LIST_UNKNOWN_ERROR))
    assert [(g.index, g.name, g.uuid) for g in listed] == [
        (1, "NVIDIA GeForce RTX 2080 Ti", "GPU-f0f3ae96-fe93-f5c8-4295-bf657e5a25da"),
        (2, "NVIDIA GeForce RTX 2080 Ti", "GPU-99c4f278-11da-052d-ac5c-3490b58ade04"),
        (3, "NVIDIA GeForce RTX 2080 Ti", "GPU-3c748ed6-c6b6-6ef0-ad7d-fe109cff16bc"),
    ]
    assert [(f.bus_id, f.error) for f in failures] == [("0000:18:00.0", "Unknown Error")]
    with pytest.raises(SmiParseError):
        parse_list("something else entirely\n")


def test_table_v100_with_inforom_warning() -> None:
    table = parse_table(fixture(TABLE))
    assert table.driver_version == "460.32.03"
    assert [g.index for g in table.gpus] == list(range(8))
    assert [g.bus_id for g in table.gpus] == [f"0000000{i}:00:00.0" for i in range(1, 9)]
    assert {g.name for g in table.gpus} == {"Tesla V100-SXM2..."}
    assert [g.temperature_celsius for g in table.gpus] == [40, 40, 43, 39, 38, 42, 42, 41]
    assert [g.power_watts for g in table.gpus] == [43, 43, 44, 41, 40, 42, 42, 42]
    assert {(g.memory_used_mib, g.memory_total_mib, g.volatile_uncorrected_ecc) for g in table.gpus} == {(0, 32510, 0)}
    assert table.no_processes
    assert table.warnings == ["infoROM is corrupted at gpu 0008:00:00.0"]
    assert inforom_corrupted_buses(table.warnings) == {short_bus_id(table.gpus[7].bus_id)}
    with pytest.raises(SmiParseError):
        parse_table("| NVIDIA-SMI 460.32.03    Driver Version: 460.32.03 |\n")


# --- the fallback end to end -----------------------------------------------------------------------


def fake_smi(tmp_path: Path, responses: dict[str, tuple[str, int, float]]) -> str:
    """An executable `nvidia-smi`: the first response whose key prefixes its arguments → (stdout, rc, delay)."""
    script = tmp_path / "nvidia-smi"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys, time\n"
        f"responses = json.loads({json.dumps(json.dumps(responses))})\n"
        "args = ' '.join(sys.argv[1:])\n"
        "for prefix, (text, rc, delay) in responses.items():\n"
        "    if args.startswith(prefix):\n"
        "        time.sleep(delay)\n"
        "        sys.stdout.write(text)\n"
        "        sys.exit(rc)\n"
        "print(f'Invalid combination of input arguments: {args}', file=sys.stderr)\n"
        "sys.exit(2)\n"
    )
    script.chmod(0o755)
    return str(script)


def run_fallback(tmp_path: Path, responses: dict[str, tuple[str, int, float]], **gpu: Any) -> tuple[str, list[Any]]:
    dev = tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    settings = {"smi_command": [fake_smi(tmp_path, responses)], "nvml_library": str(tmp_path / "no-libnvidia-ml.so.1")}
    config = parse_config({"gpu": {**settings, **gpu}})
    result, findings, samples = execute(GpuProbe(), Host(dev=dev), config, 20.0)
    return result, [*findings, *samples]


def by_key(output: list[Any]) -> dict[tuple[str, str], Any]:
    return {(f.check, f.subject): f for f in output if hasattr(f, "check")}


RECOVERY_QUERY = "--query-gpu=index,pci.bus_id,gpu_recovery_action"
INDEX_QUERY = "--query-gpu=index,pci.bus_id "


def test_fallback_full_q_with_recovery_query(tmp_path: Path) -> None:
    rows = "".join(f"{i}, {bus}, {'Reset' if i == 1 else 'None'}\n" for i, bus in enumerate(A100_BUSES))
    result, output = run_fallback(tmp_path, {"-q": (fixture(FULL_Q), 0, 0), RECOVERY_QUERY: (rows, 0, 0)})
    assert result == "ok"
    findings = by_key(output)
    reset = findings["gpu.health", "gpu1"]
    assert (reset.status.value, reset.reason, reset.device) == ("fail", "GpuRecoveryRequired", 1)
    for index in (0, *range(2, 8)):
        assert findings["gpu.health", f"gpu{index}"].status.value == "ok"
    for index in range(8):
        assert findings["gpu.throttle", f"gpu{index}"].status.value == "ok"
        memory = findings["gpu.memory", f"gpu{index}"]
        assert (memory.status.value, memory.observed["hbm_free_mib"], memory.device) == ("ok", 40536, index)
        assert findings["gpu.holders", f"gpu{index}"].status.value == "ok"
    samples = {(s.name, s.labels.get("gpu")): s.value for s in output if hasattr(s, "value")}
    assert samples["nodehealth_gpu_power_watts", "0"] == 55.63
    assert samples["nodehealth_gpu_devices", None] == 8


def test_fallback_old_driver_without_recovery_field_and_reordered_indices(tmp_path: Path) -> None:
    rows = "".join(f"{7 - i}, {bus}\n" for i, bus in enumerate(A100_BUSES))
    invalid = 'Field "gpu_recovery_action" is not a valid field to query.\n'
    result, output = run_fallback(
        tmp_path, {"-q": (fixture(FULL_Q), 0, 0), RECOVERY_QUERY: (invalid, 2, 0), INDEX_QUERY: (rows, 0, 0)}
    )
    assert result == "ok"
    findings = by_key(output)
    health = findings["gpu.health", "gpu7"]  # the first -q block, index 7 per the CSV
    assert health.status.value == "ok"
    assert health.observed["bus_id"] == A100_BUSES[0]
    assert "recovery_action" in health.observed["not_supported"]


def test_fallback_remap_pending_excerpt(tmp_path: Path) -> None:
    rows = "0, 00000000:10:1C.0, None\n"
    result, output = run_fallback(tmp_path, {"-q": (fixture(REMAP_PENDING_Q), 0, 0), RECOVERY_QUERY: (rows, 0, 0)})
    assert result == "ok"
    health = by_key(output)["gpu.health", "gpu0"]
    assert (health.status.value, health.reason) == ("fail", "GpuRetirementPending")
    assert "row remap" in health.message


def test_fallback_q_fails_then_list_shows_the_unopenable_gpu(tmp_path: Path) -> None:
    text = fixture(LIST_UNKNOWN_ERROR)
    unable = "Unable to determine the device handle for gpu 0000:18:00.0: Unknown Error\n"
    result, output = run_fallback(tmp_path, {"-q": (unable, 15, 0), "-L": (text, 0, 0)})
    assert result == "ok"
    findings = by_key(output)
    missing = findings["gpu.health", "pci 0000:18:00.0"]
    assert (missing.status.value, missing.reason) == ("fail", "GpuMissing")
    assert "Unknown Error" in missing.message
    for index in (1, 2, 3):
        assert findings["gpu.health", f"gpu{index}"].status.value == "unknown"
        assert findings["gpu.memory", f"gpu{index}"].status.value == "unknown"


def test_fallback_malformed_q_is_a_parse_error(tmp_path: Path) -> None:
    garbage = "GPU 00000000:3B:00.0\n    FB Memory Usage\n        Total : lots MiB\n"
    result, output = run_fallback(tmp_path, {"-q": (garbage, 0, 0)})
    assert result == "error"
    assert {(f.check, f.status.value, f.reason) for f in output} == {
        (check, "unknown", "ParseError") for check in GpuProbe.checks
    }


def test_fallback_hung_nvidia_smi_with_expected_gpus(tmp_path: Path) -> None:
    result, output = run_fallback(tmp_path, {"-q": ("", 0, 30)}, smi_timeout_seconds=0.5, expected_gpus=8)
    assert result == "ok"
    findings = by_key(output)
    health = findings["gpu.health", ""]
    assert (health.status.value, health.reason) == ("fail", "GpuMissing")
    assert "did not answer within 0.5s" in health.message
    assert findings["gpu.throttle", ""].status.value == "unknown"


def test_fallback_missing_nvidia_smi_and_no_gpus_expected_skips(tmp_path: Path) -> None:
    config = parse_config(
        {"gpu": {"smi_command": [str(tmp_path / "absent")], "nvml_library": str(tmp_path / "absent.so")}}
    )
    (tmp_path / "dev").mkdir()
    result, findings, _ = execute(GpuProbe(), Host(dev=tmp_path / "dev"), config, 5.0)
    assert result == "skip"
    assert {f.message for f in findings} == {"no NVIDIA driver on this host"}


def test_cli_check_only_gpu_end_to_end(tmp_path: Path) -> None:
    rows = "".join(f"{i}, {bus}, {'Reset' if i == 1 else 'None'}\n" for i, bus in enumerate(A100_BUSES))
    smi = fake_smi(tmp_path, {"-q": (fixture(FULL_Q), 0, 0), RECOVERY_QUERY: (rows, 0, 0)})
    (tmp_path / "dev").mkdir()
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "host": {"dev": str(tmp_path / "dev")},
                "gpu": {"smi_command": [smi], "nvml_library": str(tmp_path / "absent.so")},
                "kubernetes": {"enabled": False, "pod_resources_socket": str(tmp_path / "no-kubelet.sock")},
            }
        )
    )
    argv = ["node-health", "check", "--json", "--only", "gpu", "--config", str(config)]
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from agent.cli import main; sys.argv = sys.argv[1:]; sys.exit(main())",
            *argv,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr  # not ready
    document = json.loads(proc.stdout)
    assert document["ready"] is False
    failing = [(f["check"], f["subject"], f["reason"]) for f in document["findings"] if f["status"] == "fail"]
    assert failing == [("gpu.health", "gpu1", "GpuRecoveryRequired")]
    # 8 GPUs x 4 checks, gpu.ledger's skip (no kubelet here), and gpu.nvlink and gpu.fabric skipped: no
    # /dev/nvidiaN in this fake host's dev and gpu.expected_gpus unset
    assert len(document["findings"]) == 35
    links = {(f["check"], f["reason"]) for f in document["findings"] if f["check"] in ("gpu.nvlink", "gpu.fabric")}
    assert links == {("gpu.nvlink", "NotApplicable"), ("gpu.fabric", "NotApplicable")}


def test_list_with_mig_devices_under_their_gpu() -> None:
    text = (
        "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)\n"
        "  MIG 1g.5gb      Device  0: (UUID: MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f)\n"
        "  MIG 1g.5gb      Device  1: (UUID: MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb)\n"
        "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-0b64e86a-a39a-9261-7e62-798d98e599af)\n"
    )
    listed, failures = parse_list(text)
    assert failures == []
    assert [(g.index, g.mig_uuids) for g in listed] == [
        (0, ("MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f", "MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb")),
        (1, ()),
    ]


# --- every fixture ---------------------------------------------------------------------------------

# The captured outputs, each read by a test above that names it; the list is the directory's content.
NVIDIA_SMI_FIXTURES = [
    FULL_Q,
    REMAP_PENDING_Q,
    ECC_EXCERPT,
    RETIRED_EXCERPT,
    H100_CSV,
    RECOVERY_CSV,
    TABLE,
    LIST_UNKNOWN_ERROR,
    "dcgmi-health-c-j-Healthy-despite-reset-DCGM-issue263.txt",
    "dcgmi-dmon-e230-xid120-DCGM-issue263.txt",
]


# NVLink and fabric outputs: the gpu.links probe's parsers read them (tests/probes/gpu/test_gpu_links.py).
LINK_FIXTURES = {
    "nvlink-s-i0-a100-sxm4-40gb-535.161.08.txt",
    "nvlink-e-i0-a100-sxm4-40gb-535.161.08.txt",
    "q-excerpt-fabric-Completed-Success.txt",
    "q-excerpt-fabric-NA-550.txt",
}


def test_every_fixture_is_listed() -> None:
    present = {p.name for p in require_fixtures().joinpath("nvidia-smi").iterdir() if p.name != "SOURCES.md"}
    assert present == set(NVIDIA_SMI_FIXTURES) | LINK_FIXTURES


@pytest.mark.parametrize("name", NVIDIA_SMI_FIXTURES)
def test_every_parser_on_every_fixture_answers_or_raises_its_own_error(name: str) -> None:
    """No parser crashes on any captured output: it parses it or raises SmiParseError (a ParseError finding)."""
    text = fixture(name)
    answered = 0
    for parse in (parse_query, parse_table, parse_list, parse_csv, parse_gpu_sections):
        try:
            parse(text)
            answered += 1
        except SmiParseError:
            continue
    assert answered >= 1 or name.startswith("dcgmi-")  # DCGM's outputs are no nvidia-smi output at all
