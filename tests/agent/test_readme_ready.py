"""The README's `/ready in one screen` shows what the agent really prints: its text answer, rebuilt from the
finding it shows, is byte for byte the README's block."""

from __future__ import annotations

import re

from support.system import REPO

from agent.http.routes import ready_text
from agent.snapshot import Verdict
from probes.base import Finding, Status


def readme_answer() -> str:
    section = (REPO / "README.md").read_text().split("## `/ready` in one screen", 1)[1]
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", section, flags=re.S | re.M)
    plain = [body for language, body in blocks if not language]
    assert plain, "the README's /ready section has no text answer block"
    return plain[0]


def test_the_readme_text_answer_is_the_agents() -> None:
    shown = readme_answer()
    first, line = shown.splitlines()[:2]
    node = re.fullmatch(r"not ready on (\S+): 1 reason", first)
    assert node, first
    fields = re.fullmatch(r"(\w+) (\S+) (\S+) (\w+): (.*) -- fix: (.*)", line)
    assert fields, line
    status, check, subject, reason, message, hint = fields.groups()
    finding = Finding(check, subject, Status(status), reason, message, hint, device=1)
    assert ready_text(node.group(1), Verdict(False, (finding,), 0.5)).decode() == shown
