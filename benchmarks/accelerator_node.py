"""A fake 16-NPU + 8-GPU node for the footprint and CPU-quota benchmarks, built on tests/support/fake_node.py.

- npu: `npu-smi info` lists 16 chips (8 cards x 2 dies, an A3 node), its rows built from the captured A3 output
  in tests/fixtures (every chip idle, nothing running); /dev has davinci0..15 and davinci_manager; FakeNode's
  holder, a process outside any pod, gives davinci0 the number of a pseudo-terminal it holds open.
- gpu: the fake NVML library (tests/support/fake_nvml, compiled with gcc) serves 8 healthy 80 GiB GPUs; the
  agent loads it through gpu.nvml_library; /dev has nvidia0..7.
- pcie: a /sys with the 24 accelerator functions, each below its own root port, with AER counters and links.
- the kubelet's PodResources API (`ledger=True`): the fake kubelet of tests/support/fake_kubelet.py with the 16
  chips and 8 GPUs offered and FakeNode's allocations (chip 1, GPU 0); `ledger=False`: no socket configured.
- the rest (storage, network, time, kernel log, the Kubernetes API double) as FakeNode sets them up.

The agent's config takes from the shipped `deploy/configmap.yaml` what applies off a cluster: `logging` and the
`kubernetes` section (a kubeconfig for the API double is added); the host paths, tool commands and network
targets are the fake node's. Probe intervals are the defaults unless an interval is given for every probe.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from support.fake_node import UNUSED_MAJOR, FakeNode, write_aer  # noqa: E402
from support.fake_nvml.build import build_fake_nvml, device_config  # noqa: E402

from probes import all_probes  # noqa: E402

A3_FIXTURE = REPO / "tests" / "fixtures" / "npu-smi" / "a3-910_93-2card-4chip-1proc-info-25.2.0.txt"
NPU_CARDS, DIES_PER_CARD, GPUS = 8, 2, 8
NPU_CHIPS = NPU_CARDS * DIES_PER_CARD
# An idle A3 die shows ~3 GiB of HBM in use by firmware (the fixture's idle chips: 2876..3133 MiB).
IDLE_HBM_MIB = 3133


def npu_bus_id(chip: int) -> str:
    return f"0000:{0x10 + 8 * chip:02X}:00.0"


def gpu_bus_id(gpu: int) -> str:
    return f"0000:{0x90 + 8 * gpu:02X}:00.0"


def _template_rows(fixture_lines: list[str]) -> tuple[str, str]:
    """The fixture's first chip: its name row and its Chip/Phy-ID row."""
    for index, line in enumerate(fixture_lines):
        if re.match(r"^\| 0 +Ascend", line):
            return line, fixture_lines[index + 1]
    raise ValueError(f"{A3_FIXTURE.name}: no chip rows")


def a3_info_table(cards: int = NPU_CARDS, dies: int = DIES_PER_CARD) -> str:
    """`npu-smi info` of an A3 node with cards x dies chips, the rows laid out exactly as the fixture's."""
    lines = A3_FIXTURE.read_text().splitlines()
    name_row, chip_row = _template_rows(lines)
    header_end = next(i for i, line in enumerate(lines) if line.startswith("+====")) + 1
    out = lines[:header_end]
    phy = 0
    for card in range(cards):
        for die in range(dies):
            name = f"| {card:<6}" + name_row[8:]
            if die:  # the second die of a card reports no power of its own, as in the fixture
                name = name.replace("162.8", "-    ")
            bus = npu_bus_id(phy)
            chip = f"| {die:<6}{phy:<20}| {bus}  " + chip_row[44:]
            chip = re.sub(r"\d+ / 65536", f"{IDLE_HBM_MIB} / 65536", chip)
            out += [name, chip, "+" + "=" * 27 + "+" + "=" * 15 + "+" + "=" * 52 + "+" if die else "+" + "-" * 96 + "+"]
            phy += 1
    process_start = next(i for i, line in enumerate(lines) if "Process id" in line)
    out += lines[process_start - 1 : process_start + 2]
    for card in range(cards):
        out.append(f"| {f'No running processes found in NPU {card}':<95}|")
        out.append(lines[process_start + 1])
    return "\n".join(out) + "\n"


def a3_mapping_table(cards: int = NPU_CARDS, dies: int = DIES_PER_CARD) -> str:
    """`npu-smi info -m` for the same chips, in the column layout of the captured 910A output."""
    rows = [f"{'NPU ID':<31}{'Chip ID':<31}{'Chip Logic ID':<31}Chip Name"]
    rows += [f"{c:<31}{d:<31}{c * dies + d:<31}Ascend 910" for c in range(cards) for d in range(dies)]
    return "\n".join(rows) + "\n"


def write_npu_smi_spec(directory: Path) -> Path:
    """The fake npu-smi's spec (tests/support/fake_npu_smi.py): `info` and `info -m` of the 16 chips."""
    responses = {}
    for args, text in (("info", a3_info_table()), ("info -m", a3_mapping_table())):
        path = directory / f"npu-smi-{args.replace(' ', '')}.txt"
        path.write_text(text)
        responses[args] = {"stdout_file": str(path)}
    spec = directory / "npu-smi.json"
    spec.write_text(json.dumps({"responses": responses}))
    return spec


def build_dev(dev: Path) -> None:
    """davinci0 (/dev/full's number), davinci1..15 and davinci_manager (a major no driver has), nvidia0..7."""
    dev.mkdir(parents=True, exist_ok=True)
    os.mknod(dev / "davinci0", 0o666 | stat.S_IFCHR, os.stat("/dev/full").st_rdev)
    for chip in range(1, NPU_CHIPS):
        os.mknod(dev / f"davinci{chip}", 0o666 | stat.S_IFCHR, os.makedev(UNUSED_MAJOR, chip))
    os.mknod(dev / "davinci_manager", 0o666 | stat.S_IFCHR, os.makedev(UNUSED_MAJOR, 100))
    for gpu in range(GPUS):
        os.mknod(dev / f"nvidia{gpu}", 0o666 | stat.S_IFCHR, os.makedev(UNUSED_MAJOR + 1, gpu))


def _pci_function(path: Path, vendor: str, device: str, pci_class: str) -> None:
    path.mkdir(parents=True)
    for name, value in (("vendor", vendor), ("device", device), ("class", pci_class)):
        (path / name).write_text(value + "\n")
    for name, value in (("link_width", "16"), ("link_speed", "16.0 GT/s PCIe")):
        (path / f"current_{name}").write_text(value + "\n")
        (path / f"max_{name}").write_text(value + "\n")
    write_aer(path, {}, {}, {})


def build_sysfs(root: Path) -> None:
    """<root>/devices/pci0000:00/<port>/<function> for every NPU and GPU, and bus/pci/devices links."""
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    functions = [(npu_bus_id(c), "0x19e5", "0xd803", "0x120000") for c in range(NPU_CHIPS)]
    functions += [(gpu_bus_id(g), "0x10de", "0x2330", "0x030200") for g in range(GPUS)]
    for slot, (bdf, vendor, device, pci_class) in enumerate(functions, start=1):
        port_bdf = f"0000:00:{slot:02x}.0"
        port = root / "devices" / "pci0000:00" / port_bdf
        _pci_function(port, vendor, "0xa120" if vendor == "0x19e5" else "0x1a36", "0x060400")
        function = port / bdf.lower()
        _pci_function(function, vendor, device, pci_class)
        for path in (port, function):
            (links / path.name).symlink_to(os.path.relpath(path, links))


def nvml_config() -> str:
    """8 healthy 80 GiB GPUs with the bus ids of the fake /sys."""
    gpus = [
        {"name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-fake-{g:04d}", "bus": "0000" + gpu_bus_id(g), "minor": g}
        for g in range(GPUS)
    ]
    return device_config(*gpus)


def shipped_config() -> dict[str, Any]:
    """The agent's config as deploy/configmap.yaml ships it."""
    configmap = yaml.safe_load((REPO / "deploy" / "configmap.yaml").read_text())
    return dict(yaml.safe_load(configmap["data"]["config.yaml"]))


def probe_names() -> list[str]:
    return sorted(all_probes())


class AcceleratorNode(FakeNode):
    """FakeNode with 16 NPUs and 8 NVML GPUs, the shipped config's logging and kubernetes sections, and either
    every probe's default interval (`interval=None`) or one interval for all."""

    def __init__(
        self,
        workdir: Path,
        fixtures: Path,
        interval: float | None = None,
        kube: bool = True,
        cgroup_procs: Path | None = None,
        ledger: bool = True,
    ) -> None:
        super().__init__(
            workdir, fixtures, node_name="fake-a3-node", interval=interval or 1.0, kube=kube, ledger=ledger
        )
        self.default_intervals = interval is None
        self.cgroup_procs = cgroup_procs  # the agent is moved into this cgroup as soon as it starts

    def start_agent(self) -> None:
        super().start_agent()
        if self.cgroup_procs is not None and self.agent is not None:
            self.cgroup_procs.write_text(str(self.agent.pid))

    def start_kubelet(self, chips: int, gpus: list[str]) -> Any:
        return super().start_kubelet(NPU_CHIPS, [f"GPU-fake-{g:04d}" for g in range(GPUS)])

    def prepare(self) -> dict[str, Any]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = super().prepare()
        work = self.workdir
        shutil.rmtree(work / "dev")
        build_dev(work / "dev")
        shutil.rmtree(work / "sys")
        build_sysfs(work / "sys")
        write_npu_smi_spec(work)  # replaces FakeNode's 8-chip spec, same path
        library = build_fake_nvml(work / "nvml")
        (work / "fake-nvml.conf").write_text(nvml_config())
        os.environ["FAKE_NVML_CONFIG"] = str(work / "fake-nvml.conf")  # the agent inherits it (start_agent)
        shipped = shipped_config()
        config["logging"] = shipped["logging"]
        config.pop("health", None)  # the defaults, as shipped
        config["gpu"]["nvml_library"] = str(library)
        config["pcie"] = {"vendors": ["0x19e5", "0x10de"]}
        if self.kube:
            config["kubernetes"] = {
                **shipped["kubernetes"],
                "kubeconfig": config["kubernetes"]["kubeconfig"],
                "budget_namespace": "node-health",
                "pod_resources_socket": config["kubernetes"]["pod_resources_socket"],
            }
        if self.default_intervals:
            config.pop("probes", None)
        else:
            config["probes"] = {name: {"interval_seconds": self.interval} for name in probe_names()}
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        return config
