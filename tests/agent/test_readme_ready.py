"""The README's `/ready in one screen` shows what the agent really prints: a real npu.holders finding (a real
process of a systemd service holding a mknod'ed /dev/davinci0 that the fake npu-smi lists, the probe's own code
judging it) rendered as /ready's text answer is byte for byte the README's block, once the two values this
machine picks are put back as the README shows them: the holder's PID (4711) and the process name (python3)."""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fake_npu_smi import FakeSmi, context, make_dev, npu_fixture, run_probe
from support.pod_cgroups import cgroup_hierarchy, holding, idle_devices
from support.system import REPO, require

from agent.http.answers import ready_text
from agent.snapshot import Verdict
from probes.base import Status
from probes.runtime.procfs import classify_cgroup

NODE, PID, COMM, SERVICE = "npu-node-07", "4711", "python3", "train.service"


def readme_answer() -> str:
    section = (REPO / "README.md").read_text().split("## `/ready` in one screen", 1)[1]
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", section, flags=re.S | re.M)
    plain = [body for language, body in blocks if not language]
    assert plain, "the README's /ready section has no text answer block"
    return plain[0]


@contextlib.contextmanager
def service_cgroup() -> Iterator[Path]:
    """A cgroup named like a systemd service (`.../system.slice/train.service`), removed after the block."""
    root = cgroup_hierarchy()
    require(root is not None, "a writable cgroup hierarchy (memory v1 or v2)")
    assert root is not None
    top = root / f"node-health-readme-{uuid.uuid4().hex[:8]}"
    path = top / "system.slice" / SERVICE
    try:
        path.mkdir(parents=True)
    except OSError as exc:
        require(False, f"creating a cgroup: {exc}")
    try:
        yield path
    finally:
        for directory in (path, path.parent, top):
            with contextlib.suppress(OSError):
                directory.rmdir()


@pytest.mark.system
def test_the_readme_text_answer_is_the_probes_finding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi = FakeSmi(tmp_path / "fake")
    monkeypatch.setenv("PATH", f"{smi.bin}{os.pathsep}{os.environ.get('PATH', '')}")
    free = idle_devices(2)
    dev = make_dev(tmp_path / "dev", {"davinci0": free[0], "davinci1": free[1]})
    with service_cgroup() as cgroup, holding(dev / "davinci0") as child:
        try:
            (cgroup / "cgroup.procs").write_text(str(child.pid))
        except OSError as exc:
            require(False, f"moving a process into a cgroup: {exc}")
        owner = classify_cgroup(Path(f"/proc/{child.pid}/cgroup").read_text())
        assert (owner.kind, owner.unit) == ("service", SERVICE)
        listing = npu_fixture("910b1-8card-healthy-1proc-info-24.1.0.txt").read_text()
        smi.answer({"info": {"stdout": listing.replace("| 641248        |", f"| {child.pid:<13} |")}})
        findings, _ = run_probe(context(tmp_path, proc=Path("/proc"), dev=dev))
        comm = Path(f"/proc/{child.pid}/comm").read_text().strip()
        child.kill()
        child.wait()
    held = findings[("npu.holders", "npu0")]
    assert (held.status, held.reason, held.device) == (Status.FAIL, "NpuHeldOutOfBand", 0)
    assert findings[("npu.holders", "npu1")].status == Status.OK
    answer = ready_text(NODE, Verdict(False, (held,), 0.5)).decode()
    shown = re.sub(rf"\b{child.pid}\b", PID, answer).replace(f"({comm})", f"({COMM})")
    assert shown == readme_answer()


def test_the_readme_example_is_one_the_agent_could_give() -> None:
    """Without root: the README's block has the text answer's form (its first line, one reason and its fix)."""
    first, *reason = readme_answer().splitlines()
    assert first == f"not ready on {NODE}: 1 reason"
    assert re.fullmatch(r"fail npu\.holders npu0 NpuHeldOutOfBand: .* -- fix: .*", " ".join(r.strip() for r in reason))
    assert f"PID {PID} ({COMM}) in service {SERVICE}" in reason[0]
