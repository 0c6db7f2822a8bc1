"""The reference that is generated from the declarations: reason codes per probe and per family.

`node-health probes --reasons` prints it as text. The docs carry it as Markdown between markers
(`<!-- generated:reasons:FAMILY -->` ... `<!-- /generated -->` on a family page, `<!-- generated:troubleshooting -->`
in docs/troubleshooting.md), so a reason declared in code is documented by construction; prose around the
markers is written by hand. `python -m agent.reference --write` refreshes the generated blocks, and a test
fails when they are out of date.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agent.reasons import AGENT_REASONS
from probes import all_families, all_probes
from probes.base import COMMON_REASONS, Probe, Reason
from probes.family import Family, family_of

REPO = Path(__file__).resolve().parent.parent
TROUBLESHOOTING = "docs/troubleshooting.md"
_BLOCK = re.compile(r"(<!-- generated:(?P<name>[a-z0-9_:.-]+) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.DOTALL)
_COMMON_CODES = {reason.code for reason in COMMON_REASONS}


@dataclass(frozen=True)
class ReasonUse:
    """One reason code as the docs show it: the probes (and checks) that emit it."""

    reason: Reason
    probes: tuple[str, ...]
    checks: tuple[str, ...]
    family: str  # family key, or "agent" for the agent's own reasons


def reason_uses(probe_classes: dict[str, type[Probe]] | None = None) -> list[ReasonUse]:
    """Every declared reason once per family, in declaration order; the agent's and the common ones first."""
    probe_classes = probe_classes if probe_classes is not None else all_probes()
    uses: dict[tuple[str, str], ReasonUse] = {}
    for reason in (*AGENT_REASONS, *COMMON_REASONS):
        uses[("agent", reason.code)] = ReasonUse(reason, ("any",), ("any",), "agent")
    for name, cls in probe_classes.items():
        family = family_of(cls)
        family_key = family.key if family is not None else name
        for reason in cls.reasons:
            if reason.code in _COMMON_CODES:
                continue
            key = (family_key, reason.code)
            previous = uses.get(key)
            if previous is None:
                uses[key] = ReasonUse(reason, (name,), cls.checks, family_key)
            else:
                uses[key] = ReasonUse(
                    previous.reason,
                    tuple(dict.fromkeys((*previous.probes, name))),
                    tuple(dict.fromkeys((*previous.checks, *cls.checks))),
                    family_key,
                )
    return list(uses.values())


def _statuses(reason: Reason) -> str:
    return " / ".join(status.value for status in reason.statuses)


def _where(use: ReasonUse) -> str:
    """The probes that may emit a reason: a probe of one check is named by that check; a probe of several
    (npu, gpu, pcie, host) by its name, the finding itself saying which of its checks."""
    if use.probes == ("any",):
        return "any"
    return ", ".join(f"`{probe}`" for probe in use.probes)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reasons_text(uses: Iterable[ReasonUse]) -> str:
    lines = []
    for use in uses:
        lines.append(f"{use.reason.code}  [{_statuses(use.reason)}]  {_where(use)}")
        lines.append(f"    means: {use.reason.meaning}")
        if use.reason.hint:
            lines.append(f"    fix:   {use.reason.hint}")
    return "\n".join(lines) + "\n"


def family_table(uses: Iterable[ReasonUse], family: str) -> str:
    rows = ["| Reason | Status | Probe | Meaning | Fix |", "|---|---|---|---|---|"]
    for use in uses:
        if use.family != family:
            continue
        anchor = anchor_of(use.reason.code)
        rows.append(
            f"| [`{use.reason.code}`](../troubleshooting.md#{anchor}) | {_statuses(use.reason)} | "
            f"{_where(use)} | {_cell(use.reason.meaning)} | {_cell(use.reason.hint)} |"
        )
    return "\n".join(rows) + "\n"


def anchor_of(code: str) -> str:
    """The anchor GitHub gives the heading `### Code` (a runbook_url points there)."""
    return code.lower()


def troubleshooting_body(uses: list[ReasonUse], families: dict[str, Family]) -> str:
    out: list[str] = []
    titles = {"agent": ("The agent itself", None), **{k: (f.title, f.doc) for k, f in families.items()}}
    order = ["agent", *families]
    seen: set[str] = set()
    for family in order:
        group = [use for use in uses if use.family == family]
        if not group:
            continue
        title, doc = titles[family]
        out.append(f"## {title}\n")
        if doc:
            out.append(f"Reference: [{doc.removeprefix('docs/')}]({doc.removeprefix('docs/')}).\n")
        for use in group:
            if use.reason.code in seen:
                # A code shared by two families (MountHung in storage and kernel rules) keeps one anchor.
                out.append(f"`{use.reason.code}` ({title}): see above.\n")
                continue
            seen.add(use.reason.code)
            out.append(f"### {use.reason.code}\n")
            out.append(f"- **Status:** {_statuses(use.reason)}; **reported by:** {_where(use)}")
            out.append(f"- **Means:** {use.reason.meaning}")
            if use.reason.hint:
                out.append(f"- **Fix:** {use.reason.hint}")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def generated_blocks() -> dict[str, str]:
    """Name of each generated block → its Markdown body."""
    uses = reason_uses()
    families = all_families()
    blocks = {f"reasons:{key}": family_table(uses, key) for key in families}
    blocks["reasons:agent"] = family_table(uses, "agent")
    blocks["troubleshooting"] = troubleshooting_body(uses, families)
    return blocks


def refresh(text: str, blocks: dict[str, str]) -> tuple[str, list[str]]:
    """Replace every generated block in `text`; returns the new text and the names of unknown blocks."""
    unknown: list[str] = []

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in blocks:
            unknown.append(name)
            return match.group(0)
        return match.group(1) + blocks[name] + match.group(4)

    return _BLOCK.sub(replace, text), unknown


def doc_pages(repo: Path = REPO) -> list[Path]:
    return sorted((repo / "docs").rglob("*.md"))


def sync(repo: Path = REPO, write: bool = False) -> list[str]:
    """Refresh the generated blocks of every docs page; returns the pages that were (or would be) changed
    and the problems found (unknown blocks, family pages without their reason table)."""
    blocks = generated_blocks()
    problems: list[str] = []
    for page in doc_pages(repo):
        text = page.read_text()
        new, unknown = refresh(text, blocks)
        problems.extend(f"{page.relative_to(repo)}: unknown generated block {name!r}" for name in unknown)
        if new != text:
            problems.append(f"{page.relative_to(repo)}: generated blocks are out of date")
            if write:
                page.write_text(new)
    for key, family in all_families().items():
        page = repo / family.doc
        if not page.is_file():
            problems.append(f"{family.doc}: the {key} family's docs page is missing")
        elif f"<!-- generated:reasons:{key} -->" not in page.read_text():
            problems.append(f"{family.doc}: no reason table (<!-- generated:reasons:{key} -->)")
    trouble = repo / TROUBLESHOOTING
    if not trouble.is_file() or "<!-- generated:troubleshooting -->" not in trouble.read_text():
        problems.append(f"{TROUBLESHOOTING}: no generated troubleshooting block")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.reference", description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite the generated blocks in docs/")
    args = parser.parse_args(argv)
    problems = sync(write=args.write)
    for problem in problems:
        print(problem, file=sys.stderr)
    if args.write:
        return 1 if any("out of date" not in p for p in problems) else 0
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
