"""A fake accelerator node for end-to-end tests of the agent: `node-health run --no-kube` in a subprocess, with
every probe family given something real to look at.

- npu: `npu-smi` is tests/support/fake_npu_smi.py answering from the captured 910B output in the fixtures; /dev is a
  temporary directory with mknod'ed davinci nodes; a child process outside any pod holds davinci0 (made with the
  number of a pseudo-terminal it holds open), so npu.holders reports NpuHeldOutOfBand (`hold="nvidia3"`: that GPU).
- gpu: NVML cannot load (a library path that does not exist), so the nvidia-smi fallback runs: the same fake
  tool answers `-q` with the captured A100 output and the CSV queries the way driver 460 does; nvidia0..7
  device nodes exist.
- pcie: a temporary /sys with a Huawei NPU function and its root port, AER counters and link files in the
  kernel's formats (the layout of tests/probes/pcie/test_pcie.py).
- interconnect and gpu.links: eight ACTIVE HCA ports under the same /sys (tests/support/fake_infiniband.py), and
  the fake nvidia-smi answering `nvlink -s`/`nvlink -e` with every GPU's 12 links active (no Fabric section in
  the 460 capture: not an NVSwitch system).
- storage: `/` as an expected mount, free space of the temp dir, a write probe, a stale torch FileBaton lock.
- network and time: a DNS server (dnslib), an HTTP egress target and an SNTP server, all on 127.0.0.1.
- kernel.log: the real /dev/kmsg when it can be read, else an empty file.
- kubernetes (`kube=True`): the agent reconciles its Node on the in-repo API double (tests/support/kube_double.py)
  through a kubeconfig; the taint budget is 0, so its taints are withheld (nodehealth_taint_suppressed).
  With `kube=False` it runs `--no-kube`. `dra="1.37"` (or another kube_dra release) makes the double serve
  resource.k8s.io, with the NVIDIA and MindCluster DRA drivers' ResourceSlices of this node's devices;
  `kube_settings` adds to the agent's `kubernetes:` config.
- the kubelet's PodResources API (`ledger=True`): tests/support/fake_kubelet.py on a unix socket, every chip and
  GPU offered, chip 1 allocated to pod team-a/train-0 (container worker) and GPU 0 to team-b/infer-0 (`LEDGER`).

`FakeNode` is a context manager; everything it starts is stopped on exit, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from support.cli import node_env
from support.fake_gpu_links import Node as LinkNode
from support.fake_infiniband import node as ib_node
from support.fake_kubelet import FakeKubelet
from support.kube_double import ApiDouble
from support.netservers import DnsTestServer, HttpTestServer, SntpTestServer, ZoneResolver
from support.processes import free_port

REPO = Path(__file__).resolve().parents[2]
FAKE_SMI = Path(__file__).resolve().parent / "fake_npu_smi.py"
FAKE_HCCN = Path(__file__).resolve().parent / "fake_hccn_tool.py"
NPU_CHIPS = 8

NPU_INFO_FIXTURE = "npu-smi/910b1-8card-healthy-1proc-info-24.1.0.txt"
GPU_QUERY_FIXTURE = "nvidia-smi/a100-sxm4-40gb-8gpu-q-full-460.32.03-healthy.txt"
NPU_CHIPS = 8
GPUS = 8
# Majors no driver registers here: the nodes exist for discovery, nobody can open them.
UNUSED_MAJOR = 239
# The ledger's allocations: (namespace, pod, container, resource, device index).
LEDGER = (
    ("team-a", "train-0", "worker", "huawei.com/Ascend910", 1),
    ("team-b", "infer-0", "main", "nvidia.com/gpu", 0),
)

DNS_NAME = "mirror.node-health.test"
EGRESS_NAME = "mirror"

# The PCI tree: NPU function 0000:01:00.0 below Huawei root port 0000:00:01.0 (cf. tests/probes/pcie/test_pcie.py).
NPU_PCI_CHAIN = ["pci0000:00", "0000:00:01.0", "0000:01:00.0"]
COR_NAMES = ["RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF"]
UNCOR_NAMES = ["Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF", "MalfTLP"]


def _aer_text(names: list[str], total_name: str, counts: dict[str, int]) -> str:
    """drivers/pci/pcie/aer.c aer_stats_dev_attr(): `%s %llu` per named bit, then the TOTAL_ line."""
    lines = [f"{name} {counts.get(name, 0)}" for name in names]
    return "\n".join([*lines, f"{total_name} {sum(counts.values())}"]) + "\n"


def write_aer(function: Path, fatal: dict[str, int], nonfatal: dict[str, int], correctable: dict[str, int]) -> None:
    (function / "aer_dev_fatal").write_text(_aer_text(UNCOR_NAMES, "TOTAL_ERR_FATAL", fatal))
    (function / "aer_dev_nonfatal").write_text(_aer_text(UNCOR_NAMES, "TOTAL_ERR_NONFATAL", nonfatal))
    (function / "aer_dev_correctable").write_text(_aer_text(COR_NAMES, "TOTAL_ERR_COR", correctable))


def build_sysfs(root: Path) -> Path:
    """<root>/devices/pci0000:00/... with bus/pci/devices/<bdf> relative symlinks; returns the NPU function."""
    (root / "bus" / "pci" / "devices").mkdir(parents=True)
    function = root
    for depth in range(2, len(NPU_PCI_CHAIN) + 1):
        chain = NPU_PCI_CHAIN[:depth]
        function = root / "devices" / Path(*chain)
        function.mkdir(parents=True)
        is_port = depth < len(NPU_PCI_CHAIN)
        (function / "vendor").write_text("0x19e5\n")
        (function / "device").write_text(("0xa120" if is_port else "0xd802") + "\n")
        (function / "class").write_text(("0x060400" if is_port else "0x120000") + "\n")
        (function / "current_link_width").write_text("16\n")
        (function / "max_link_width").write_text("16\n")
        (function / "current_link_speed").write_text("16.0 GT/s PCIe\n")
        (function / "max_link_speed").write_text("16.0 GT/s PCIe\n")
        write_aer(function, {}, {}, {"RxErr": 2} if not is_port else {})
        target = os.path.relpath(function, root / "bus" / "pci" / "devices")
        (root / "bus" / "pci" / "devices" / chain[-1]).symlink_to(target)
    return function


def build_dev(dev: Path) -> None:
    """davinci0..7, davinci_manager, nvidia0..7, with a major no driver registers: nobody can open them. The held
    one gets a real device number when its holder starts (FakeNode.start_holder)."""
    dev.mkdir()
    for chip in range(NPU_CHIPS):
        os.mknod(dev / f"davinci{chip}", 0o666 | stat.S_IFCHR, os.makedev(UNUSED_MAJOR, chip))
    os.mknod(dev / "davinci_manager", 0o666 | stat.S_IFCHR, os.makedev(UNUSED_MAJOR, 100))
    for gpu in range(GPUS):
        os.mknod(dev / f"nvidia{gpu}", 0o666 | stat.S_IFCHR, os.makedev(UNUSED_MAJOR + 1, gpu))


def publish_devices(api: ApiDouble, node: str, fixtures: Path, which: tuple[str, ...]) -> None:
    """The DRA drivers' ResourceSlices of the fake node's devices, as read from the same captured outputs its
    tools answer with: NVIDIA's (`gpu-<minor>`, uuid, pciBusID) and MindCluster's (`ascend910-<phyID>`, physicId)."""
    from probes.gpu.nvidia_smi import parse_query
    from probes.npu.details import resolve_ids
    from probes.npu.info_table import parse_info
    from probes.runtime.inventory import normalize_bus_id
    from support.kube_dra import add_resource_slice

    if "gpu" in which:
        gpus = parse_query((fixtures / GPU_QUERY_FIXTURE).read_text()).gpus
        devices = [
            {
                "name": f"gpu-{gpu.minor}",
                "attributes": {
                    "uuid": {"string": gpu.uuid},
                    "resource.kubernetes.io/pciBusID": {"string": normalize_bus_id(gpu.bus_id)},
                },
            }
            for gpu in gpus
        ]
        add_resource_slice(api, f"{node}-gpu.nvidia.com-x7k2p", node, "gpu.nvidia.com", devices)
    if "npu" in which:
        chips = resolve_ids(parse_info((fixtures / NPU_INFO_FIXTURE).read_text()).chips, None)
        devices = [
            {"name": f"ascend910-{chip.device_number}", "attributes": {"physicId": {"int": chip.device_number}}}
            for chip in chips
        ]
        add_resource_slice(api, f"{node}-npu.huawei.com-q4m8d", node, "npu.huawei.com", devices)


def npu_smi_spec(fixtures: Path, log: Path) -> dict[str, Any]:
    """`info` from the fixture; `-t health` and `-t ecc` of each chip (npu.grade, npu.ecc) healthy, from the
    project's sourced outputs."""
    own = REPO / "tests" / "fixtures" / "npu-smi"
    health = {"stdout_file": str(own / "910a-t-health-OK-i0-c0-faultdiag.txt")}
    ecc = {"stdout_file": str(own / "910a-t-ecc-i1-ddr-and-hbm-docexample-mindcluster.txt")}
    details = {
        f"info -t {kind} -i {n} -c 0": answer
        for n in range(NPU_CHIPS)
        for kind, answer in (("health", health), ("ecc", ecc))
    }
    return {
        "responses": {"info": {"stdout_file": str(fixtures / NPU_INFO_FIXTURE)}, **details},
        # Anything else (`info -m`, ...) gets npu-smi's usage error: the probe falls back to table order.
        "log": str(log),
    }


def nvidia_smi_spec(fixtures: Path) -> dict[str, Any]:
    """`-q` from the fixture; the CSV queries answered as driver 460 does (no gpu_recovery_action field)."""
    query = fixtures / GPU_QUERY_FIXTURE
    bus_ids = re.findall(r"^GPU ([0-9A-Fa-f]+:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$", query.read_text(), re.M)
    csv = "".join(f"{index}, {bus_id}\n" for index, bus_id in enumerate(bus_ids))
    return {
        "responses": {
            "-q": {"stdout_file": str(query)},
            "--query-gpu=index,pci.bus_id,gpu_recovery_action --format=csv,noheader": {
                "stdout": 'Field "gpu_recovery_action" is not a valid field to query.\n\n',
                "rc": 2,
            },
            "--query-gpu=index,pci.bus_id --format=csv,noheader": {"stdout": csv},
            # Every GPU's 12 NVLinks active, no errors (the sourced A100 outputs, tests/support/fake_gpu_links.py).
            "nvlink -s": {"stdout": LinkNode().status()},
            "nvlink -e": {"stdout": LinkNode().errors()},
        },
        "default": {"stderr": "Invalid combination of input arguments.\n", "rc": 2},
    }


def gpu_uuids(query: Path) -> list[str]:
    """The UUIDs of the GPUs a `nvidia-smi -q` capture lists, in order."""
    return re.findall(r"^\s*GPU UUID\s*:\s*(GPU-[0-9a-f-]+)\s*$", query.read_text(), re.M)


def kmsg_readable() -> bool:
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    os.close(fd)
    return True


class FakeNode:
    """Prepare the tree and config, start the servers, the holder and the agent; stop them all on exit."""

    def __init__(
        self,
        workdir: Path,
        fixtures: Path,
        node_name: str = "fake-node-1",
        interval: float = 1.0,
        kube: bool = True,
        ledger: bool = True,
        hold: str = "davinci0",
        dra: str | None = None,
        publish: tuple[str, ...] = ("gpu", "npu"),
        kube_settings: dict[str, Any] | None = None,
    ) -> None:
        self.workdir = workdir
        self.kube = kube
        self.ledger = ledger
        self.kubelet: FakeKubelet | None = None
        self.hold = hold  # the device node a process outside any pod holds open
        self.dra = dra  # the Kubernetes release whose resource.k8s.io the double serves (kube_dra.RELEASES)
        self.publish = publish  # the DRA drivers' slices of this node, with dra
        self.kube_settings = kube_settings or {}
        self.api: ApiDouble | None = None
        self.fixtures = fixtures
        self.node_name = node_name
        self.interval = interval
        self.port = free_port()
        self.metrics_port = free_port()  # /metrics and /status also answer on `port` (http.status_on_main_port)
        self.config_path = workdir / "node-health.yaml"
        self.log_path = workdir / "agent.log"
        self.kernel_log = kmsg_readable()
        self._started: list[Any] = []
        self._holder: subprocess.Popen[bytes] | None = None
        self.agent: subprocess.Popen[bytes] | None = None

    # --- set-up ----------------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        work = self.workdir
        build_dev(work / "dev")
        self.npu_function = build_sysfs(work / "sys")
        ib_node(work / "sys", 8)  # eight HCAs, one ACTIVE 400 Gb/s port each

        npu_spec, gpu_spec = work / "npu-smi.json", work / "nvidia-smi.json"
        npu_spec.write_text(json.dumps(npu_smi_spec(self.fixtures, work / "npu-smi.calls")))
        # hccn_tool (npu.roce): every chip's port healthy, from tests/fixtures/hccn_tool.
        from support.fake_hccn_tool import HEALTHY

        hccn_spec = work / "hccn-tool.json"
        hccn_spec.write_text(json.dumps({"chips": {}, "default": HEALTHY}))
        gpu_spec.write_text(json.dumps(nvidia_smi_spec(self.fixtures)))

        # A torch FileBaton left behind by a killed job: the file's existence is the lock.
        lock = work / "cache" / "torch_extensions" / "py311_cpu" / "fused_adam" / "lock"
        lock.parent.mkdir(parents=True)
        lock.write_text("")
        old = time.time() - 7200
        os.utime(lock, (old, old))
        (work / "write-probe").mkdir()

        dns = DnsTestServer(ZoneResolver({DNS_NAME: "127.0.0.1"}))
        self._started.append(dns)
        egress = HttpTestServer({"/": 200})
        self._started.append(egress)
        sntp = SntpTestServer(skew=0.0)
        self._started.append(sntp)

        schedule = {"interval_seconds": self.interval, "jitter_fraction": 0.0}
        config: dict[str, Any] = {
            "node_name": self.node_name,
            "http": {"address": "127.0.0.1", "port": self.port, "metrics_port": self.metrics_port},
            "logging": {"level": "warning"},
            "health": {"fail_threshold": 1, "recovery_threshold": 1},
            "probes": {
                name: {**schedule, "timeout_seconds": 8.0}
                for name in (
                    "npu",
                    "npu.roce",
                    "npu.grade",
                    "npu.ecc",
                    "gpu",
                    "pcie",
                    "host",
                    "kernel.log",
                    "network.dns",
                    "network.egress",
                    "network.links",
                    "network.ports",
                    "storage.locks",
                    "storage.mounts",
                    "storage.space",
                    "storage.write",
                    "time",
                    "interconnect.ports",
                    "gpu.links",
                )
            },
            "host": {"dev": str(work / "dev"), "sys": str(work / "sys")},
            "npu": {
                "smi_command": [sys.executable, str(FAKE_SMI), str(npu_spec)],
                "hccn_command": [sys.executable, str(FAKE_HCCN), str(hccn_spec)],
                "state_dir": str(work / "state"),
                "hccn_conf": str(work / "no-hccn.conf"),
                "fault_code_files": [str(work / "no-faultCode.json")],
            },
            "gpu": {
                "nvml_library": str(work / "no-such-libnvidia-ml.so.1"),
                "smi_command": [sys.executable, str(FAKE_SMI), str(gpu_spec)],
            },
            "pcie": {"vendors": ["0x19e5"]},
            "interconnect": {
                "state_dir": str(work / "state"),
            },
            "storage": {
                "mounts": [{"path": "/", "fstype": "*"}],
                "space": [{"path": str(work)}],
                "write_probes": [{"path": str(work / "write-probe"), "bytes": 4096}],
                "lock_globs": [str(work / "cache" / "torch_extensions" / "*" / "*" / "lock")],
                "stale_lock_age_seconds": 600,
            },
            "network": {
                "dns": {"names": [DNS_NAME], "nameservers": [dns.address], "cluster_names": []},
                "egress": [
                    {"name": EGRESS_NAME, "host": "127.0.0.1", "port": egress.port, "tls": False, "http_path": "/"}
                ],
            },
            "time": {"ntp_servers": [sntp.address]},
            "kernel_log": {"path": "/dev/kmsg" if self.kernel_log else str(self._empty_kmsg())},
            "kubernetes": {"enabled": False},
        }
        if self.ledger:
            self.kubelet = self.start_kubelet(NPU_CHIPS, gpu_uuids(self.fixtures / GPU_QUERY_FIXTURE))
            config["kubernetes"]["pod_resources_socket"] = self.kubelet.socket
        else:
            config["kubernetes"]["pod_resources_socket"] = ""
        if self.kube:
            self.api = ApiDouble().start()
            self._started.append(_Stoppable(self.api))
            self.api.add_node(self.node_name, labels={"node.kubernetes.io/instance-type": "fake-910b"})
            capacity = {"huawei.com/Ascend910": str(NPU_CHIPS), "nvidia.com/gpu": str(GPUS)}
            self.api.mutate("nodes", "", self.node_name, lambda n: n["status"].update({"capacity": capacity}))
            self.api.add_node("fake-node-2")
            if self.dra is not None:
                self.api.serve_dra(self.dra)
                publish_devices(self.api, self.node_name, self.fixtures, self.publish)
            kubeconfig = self.api.write_kubeconfig(work / "kubeconfig", token="fake")
            config["kubernetes"] = {
                **config["kubernetes"],
                "enabled": True,
                "kubeconfig": str(kubeconfig),
                "max_unhealthy": "0",
                "budget_namespace": "node-health",
                "poll_seconds": 0.5,
                **self.kube_settings,
            }
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        return config

    def start_kubelet(self, chips: int, gpus: list[str]) -> FakeKubelet:
        """The fake kubelet with every device offered and LEDGER's allocations."""
        kubelet = FakeKubelet().start()
        self._started.append(kubelet)
        kubelet.offer("huawei.com/Ascend910", *(f"Ascend910-{chip}" for chip in range(chips)))
        kubelet.offer("nvidia.com/gpu", *gpus)
        for namespace, pod, container, resource, index in LEDGER:
            device = f"Ascend910-{index}" if resource.startswith("huawei.com/") else gpus[index]
            kubelet.allocate(namespace, pod, container, resource, device)
        return kubelet

    def _empty_kmsg(self) -> Path:
        """Where /dev/kmsg cannot be read (no CAP_SYSLOG): an empty file, read the same way, matching nothing."""
        path = self.workdir / "kmsg"
        path.write_text("")
        return path

    def start_holder(self) -> None:
        """A process outside any pod that holds the held device node (davinci0 by default) open.

        It opens a pseudo-terminal and keeps its slave open; the held node becomes a character device with the
        slave's number. That number is this holder's alone (a /dev/full copy would also be held by every other
        fake node on the host), so the device is free again exactly when this process exits."""
        code = (
            "import os,time; m,s=os.openpty(); r=os.fstat(s).st_rdev; "
            "print(os.major(r), os.minor(r), flush=True); time.sleep(600)"
        )
        self._holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        assert self._holder.stdout is not None
        line = self._holder.stdout.readline().split()
        if len(line) != 2:
            raise RuntimeError(f"the {self.hold} holder did not start")
        node = self.workdir / "dev" / self.hold
        node.unlink()
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(int(line[0]), int(line[1])))

    def stop_holder(self) -> None:
        """The out-of-band holder exits: the device is free again."""
        if self._holder is not None and self._holder.poll() is None:
            self._holder.kill()
            self._holder.wait(timeout=10)

    def start_agent(self) -> None:
        env = node_env()
        with self.log_path.open("ab") as log:
            self.agent = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "agent.cli",
                    "run",
                    *([] if self.kube else ["--no-kube"]),
                    "--config",
                    str(self.config_path),
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its probe children go with it
            )

    def wait_ready_to_serve(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.agent is not None and self.agent.poll() is not None:
                raise RuntimeError(f"the agent exited ({self.agent.returncode}): {self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(self.url("/healthz"), timeout=2).close()
                return
            time.sleep(0.2)
        raise RuntimeError(f"the agent did not serve within {timeout:g}s: {self.log_path.read_text()[-2000:]}")

    def wait_all_probes_ran(self, timeout: float = 30.0) -> None:
        """Until every enabled probe has finished a run, so /metrics carries every family's samples."""
        deadline = time.monotonic() + timeout
        pending: list[str] = []
        while time.monotonic() < deadline:
            pending = [p["name"] for p in self.status()["probes"] if not p.get("last_run")]
            if not pending:
                return
            time.sleep(0.2)
        raise RuntimeError(f"probes without a finished run after {timeout:g}s: {pending}")

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 120.0) -> Any:
        """check()'s first true answer, polled; an AssertionError naming `what`, with the agent's log, after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = check()
            if result:
                return result
            time.sleep(0.3)
        raise AssertionError(f"{what} within {timeout:g}s; agent log: {self.log_path.read_text()[-3000:]}")

    # --- use ---------------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return f"http://{self.address}{path}"

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=5) as response:
            return str(response.read().decode())

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url("/status"), timeout=5) as response:
            return dict(json.loads(response.read()))

    def raise_fatal_aer(self) -> None:
        """The kernel counts an uncorrectable fatal error on the NPU function."""
        write_aer(self.npu_function, {"CmpltTO": 1}, {}, {"RxErr": 2})

    # --- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> FakeNode:
        try:
            self.prepare()
            self.start_holder()
            self.start_agent()
            self.wait_ready_to_serve()
            self.wait_all_probes_ran()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def stop_agent(self) -> None:
        """As the container runtime stops it: SIGTERM to the agent and its children, SIGKILL after 10 s."""
        if self.agent is not None and self.agent.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.agent.pid, signal.SIGTERM)
            try:
                self.agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.agent.pid, signal.SIGKILL)
                self.agent.wait(timeout=10)

    def close(self) -> None:
        self.stop_agent()
        if self._holder is not None and self._holder.poll() is None:
            self._holder.kill()
            self._holder.wait(timeout=10)
        for server in reversed(self._started):
            with contextlib.suppress(Exception):
                server.close()
        self._started.clear()


class _Stoppable:
    """close() for the API double, whose method is stop()."""

    def __init__(self, api: ApiDouble) -> None:
        self.api = api

    def close(self) -> None:
        self.api.stop()


def main() -> int:
    """Run a fake node by hand: `cd tests && python -m support.fake_node DIR` (Ctrl-C stops it)."""
    from support.system import FIXTURES

    workdir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/node-health-fake-node")
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave through the context manager's close()
    with FakeNode(workdir, FIXTURES) as node:
        print(f"agent on {node.url('/metrics')}, config {node.config_path}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while node.agent is not None and node.agent.poll() is None:
                time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
