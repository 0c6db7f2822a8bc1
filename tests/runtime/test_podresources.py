"""The ledger model and reader (probes/runtime/podresources): device ids as the plugins write them, the reader's
answers parsed or refused, the committed stubs generated from the committed proto, the reader child's own cost
(it never imports the `probes` package), and the agent-facing `pod_devices` / `last_read`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.fake_kubelet import FakeKubelet
from support.system import REPO

from probes.runtime.podresources import caps, client
from probes.runtime.podresources.client import READER, ReaderProcess, last_read, ledger_source, read_once
from probes.runtime.podresources.ledger import (
    Allocation,
    LedgerError,
    ascend_real,
    ascend_ref,
    ledger_of,
    nvidia_ref,
    parse_ledger,
    pod_devices,
    pod_labels,
    pod_listed,
)

PACKAGE = REPO / "probes" / "runtime" / "podresources"


def test_device_ids_as_the_plugins_write_them() -> None:
    assert (nvidia_ref("GPU-abc::3").key, nvidia_ref("GPU-abc::3").shared) == ("GPU-abc", True)
    assert (nvidia_ref("GPU-abc").key, nvidia_ref("GPU-abc").shared) == ("GPU-abc", False)
    assert nvidia_ref("MIG-def").why_shared == "MIG devices of one GPU"
    assert (nvidia_ref("2").key, nvidia_ref("2").shared) == ("2", False)
    chip = ascend_ref("Ascend910-7")
    assert chip is not None and (chip.key, chip.shared) == ("7", False)
    vnpu = ascend_ref("Ascend910-2c-100-3")
    assert vnpu is not None and (vnpu.key, vnpu.shared, vnpu.why_shared) == ("3", True, "vNPU 2c (template)")
    assert ascend_ref("Ascend310P-1") is not None and ascend_ref("davinci-mini0") is None
    assert ascend_real(" Ascend910-3,Ascend910-4,,Ascend910-3 ") == ["Ascend910-3", "Ascend910-4"]


def test_answers_parse_into_allocations_and_what_is_offered() -> None:
    text = json.dumps(
        {
            "pods": [
                {
                    "namespace": "a",
                    "name": "p",
                    "containers": [{"name": "c", "devices": [{"resource": "r", "ids": ["1"]}]}],
                },
                {"namespace": "a", "name": "idle", "containers": [{"name": "c"}]},
                {
                    "namespace": "b",
                    "name": "q",
                    "containers": [{"name": "c", "claims": [{"driver": "gpu.x", "pool": "n", "device": "g0"}]}],
                },
            ],
            "allocatable": [{"resource": "r", "ids": ["1", "2"]}],
        }
    )
    ledger = parse_ledger(text)
    assert pod_devices(ledger, "a", "p") == [Allocation("a", "p", "c", "r", "1")]
    assert pod_devices(ledger, "a", "idle") == [] and pod_listed(ledger, "a", "idle")
    assert not pod_listed(ledger, "a", "nobody") and pod_devices(None, "a", "p") == []
    assert pod_devices(ledger, "b", "q") == [Allocation("b", "q", "c", "gpu.x", "gpu.x/n/g0")]
    assert ledger.allocatable == {"r": frozenset({"1", "2"})}
    assert pod_labels(pod_devices(ledger, "a", "p")) == {"pod": "p", "namespace": "a", "container": "c"}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "[]",
        '{"pods": 3}',
        '{"pods": [{"name": 3}]}',
        '{"pods": [{"containers": [{"devices": [{"ids": [1]}]}]}]}',
    ],
)
def test_what_is_not_a_ledger_is_refused(text: str) -> None:
    with pytest.raises(LedgerError):
        parse_ledger(text)


def test_the_committed_stubs_are_generated_from_the_committed_proto(tmp_path: Path) -> None:
    """The regeneration command of docs/development.md, into a scratch directory: the same files."""
    (tmp_path / "api.proto").write_text((PACKAGE / "api.proto").read_text())
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I",
        ".",
        "--python_out=.",
        "--pyi_out=.",
        "--grpclib_python_out=.",
        "api.proto",
    ]
    subprocess.run(command, cwd=tmp_path, check=True, timeout=60)
    for name in ("api_pb2.py", "api_pb2.pyi", "api_grpc.py"):
        assert (tmp_path / name).read_text() == (PACKAGE / name).read_text(), (
            f"{name}: regenerate it (docs/development.md)"
        )
    assert "docs/development.md" in (PACKAGE / "api.proto").read_text()
    assert (
        "grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpclib_python_out=. api.proto"
        in (REPO / "docs" / "development.md").read_text()
    )


@pytest.mark.system
def test_the_reader_child_never_imports_the_agent_or_pydantic(tmp_path: Path) -> None:
    with FakeKubelet() as kubelet:
        kubelet.allocate("a", "p", "c", "nvidia.com/gpu", "GPU-x")
        code = (
            "import runpy, sys\nsys.argv = sys.argv[1:]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "heavy = ('probes', 'agent', 'pydantic', 'grpc')\n"
            "print('\\n' + ','.join(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))"
        )
        done = subprocess.run(
            [sys.executable, "-E", "-s", "-c", code, str(READER), kubelet.socket, "2"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    answer, modules = done.stdout.split("\n", 1)
    modules = modules.strip()
    assert json.loads(answer)["pods"][0]["containers"][0]["devices"] == [
        {"resource": "nvidia.com/gpu", "ids": ["GPU-x"]}
    ]
    assert modules == "", f"the reader imported {modules}"


@pytest.mark.system
def test_last_read_is_what_the_agent_serves_pod_devices_from() -> None:
    with FakeKubelet() as kubelet:
        kubelet.allocate("team-a", "train-0", "worker", "huawei.com/Ascend910", "Ascend910-1", "Ascend910-2")
        assert last_read(kubelet.socket) is None
        started = time.monotonic()
        pending = ledger_source(kubelet.socket).start(2.0)
        read = pending.result()
        assert read.ok and last_read(kubelet.socket) is read
        assert started <= read.read_mono <= time.monotonic(), "its age is judged on the monotonic clock"
        devices = [a.device_id for a in pod_devices(read.ledger, "team-a", "train-0")]
        assert devices == ["Ascend910-1", "Ascend910-2"]
        assert read.observed()["ledger"] == "ok"


@pytest.mark.system
def test_one_reader_child_serves_the_reads_and_a_broken_one_is_replaced() -> None:
    """The child stays up between reads (a few ms each instead of an interpreter start); one that died is started
    anew at the next read, and a read it cannot answer in time kills it."""
    with FakeKubelet(rate=1000, burst=1000) as kubelet:
        source = ledger_source(kubelet.socket)
        for _ in range(3):
            read = source.start(2.0).result()
            assert read.ok
            time.sleep(1.05)  # past the reuse window: a read of its own
        assert (source.reads, source.reader_starts) == (3, 1)
        child = source._reader._proc
        assert child is not None
        child.kill()
        child.wait()
        time.sleep(1.05)
        assert source.start(2.0).result().ok and source.reader_starts == 2
    hung = FakeKubelet(mode="hang").start()
    try:
        reader = ReaderProcess()
        slow = read_once(hung.socket, 0.5, reader)
        assert (slow.state, slow.code) == ("unknown", "TIMEOUT")
        assert reader.starts == 1 and reader._proc is not None  # the child's own deadline answered: kept
        reader.close()
    finally:
        hung.close()


@pytest.mark.system
def test_collecting_waits_for_the_reader_childs_start_up_and_then_only_the_grace() -> None:
    """What a probe run takes at its end: a reader child still starting is the agent's own start-up, waited for
    (within its allowance); from when the request is with the child, a kubelet that does not answer gets only the
    grace, and the read is unknown for the run (PENDING) while it goes on."""
    with FakeKubelet(mode="hang") as hung:
        source = ledger_source(hung.socket)
        pending = source.start(1.0)
        read = pending.collect(time.monotonic() + 10.0, grace=0.01)  # far less than the child's start-up
        assert (read.state, read.code) == ("unknown", "PENDING"), read.why
        asked = source._asked_at
        assert asked is not None and source.reader_starts == 1  # given up only once the request was with the child
        assert source.last() is None  # the read goes on
        started = time.monotonic()
        again = source.start(1.0).collect(time.monotonic() + 10.0, grace=0.05)  # the read in flight, joined
        assert again.code == "PENDING" and time.monotonic() - started < 0.5
        assert source.reads == 1
        done = pending.result(time.monotonic() + 5.0)
        assert (done.state, done.code) == ("unknown", "TIMEOUT")  # the child's own deadline answered


def test_a_socket_that_is_not_one_and_a_missing_one(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert read_once(str(tmp_path / "file"), 1.0).code == "NOT_A_SOCKET"
    missing = read_once(str(tmp_path / "none.sock"), 1.0)
    assert (missing.state, missing.code) == ("skip", "MISSING")
    assert read_once("", 1.0).code == "DISABLED"


@pytest.mark.parametrize(
    ("document", "named"),
    [
        ({"pods": [{"namespace": "a", "name": f"p{i}"} for i in range(caps.MAX_PODS + 1)]}, "pods listed"),
        (
            {"pods": [{"containers": [{"devices": [{"ids": ["x"] * (caps.MAX_ALLOCATED_IDS + 1)}]}]}]},
            "device ids allocated",
        ),
        ({"pods": [], "allocatable": [{"ids": ["x"] * (caps.MAX_ALLOCATABLE_IDS + 1)}]}, "allocatable device ids"),
    ],
)
def test_the_agent_refuses_a_line_past_the_bounds_rather_than_judge_a_part(document: object, named: str) -> None:
    """The child refuses such answers (test_podresources_memory.py); the agent's parse checks again, and refuses the
    whole rather than cutting it to the part within the bounds."""
    with pytest.raises(LedgerError, match=named):
        ledger_of(document)


@pytest.mark.system
def test_each_answer_is_parsed_once_and_the_previous_read_goes_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """One json.loads per answer (it was parsed twice), and when the next answer is parsed the source no longer
    holds the previous ledger: at most one ledger at a time, plus the one being parsed."""
    parses: list[object] = []
    real_loads, real_ledger_of = client.json.loads, client.ledger_of

    def loads(text: bytes | bytearray | str) -> object:
        parses.append(type(text))
        return real_loads(text)

    with FakeKubelet(rate=1000, burst=1000) as kubelet:
        kubelet.allocate("a", "p", "c", "nvidia.com/gpu", "GPU-1")
        source = ledger_source(kubelet.socket)
        held_while_parsing: list[object] = []

        def ledger_of_spy(document: object) -> object:
            last = source.last()
            held_while_parsing.append(None if last is None else (last.ok, last.code, last.ledger))
            return real_ledger_of(document)

        monkeypatch.setattr(client.json, "loads", loads)
        monkeypatch.setattr(client, "ledger_of", ledger_of_spy)
        first = source.start(10.0).result()
        assert first.ok and len(parses) == 1
        time.sleep(client.MIN_SECONDS_BETWEEN_READS + 0.1)
        second = source.start(10.0).result()
        assert second.ok and second is not first and len(parses) == 2
        assert held_while_parsing[0] is None  # nothing read before the first
        assert held_while_parsing[1] == (False, "REPLACING", None), "the first read was still held"
        assert source.last() is second
