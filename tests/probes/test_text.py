"""The escaper of probes/text.py, and the places that apply it without a process or a server.

Properties over every general category of Unicode (hypothesis): what is not printable is escaped visibly and
can be read back, what is printable is kept; escaping twice changes nothing; growth is bounded; clip never
splits an escape; one_line never leaves a line break. Then the choke points: a Finding, an Event, a Sample's
labels, the Event queue of the Kubernetes agent and both log formats.
"""

from __future__ import annotations

import io
import json
import logging
import random
import re
import sys
import unicodedata
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent.kube.node.events import EventQueue
from agent.logs import CONTINUATION, JsonFormatter, TextFormatter, configure_logging
from probes.base import Event, Finding, Sample, Status
from probes.text import (
    ELLIPSIS,
    ESCAPE_GROWTH_MAX,
    ESCAPES_MAX,
    REPLACEMENT,
    clip,
    escape,
    escape_value,
    one_line,
    redact_userinfo,
)

# Written out, not taken from the code under test: the characters the issue names.
C0_C1 = [chr(c) for c in (*range(0x00, 0x20), *range(0x7F, 0xA0))]
BIDI = [chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C)]
ZERO_WIDTH = [chr(c) for c in (0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF)]
SEPARATORS = ["\u2028", "\u2029"]
NAMED = C0_C1 + BIDI + ZERO_WIDTH + SEPARATORS
FORBIDDEN = re.compile("[" + "".join(re.escape(char) for char in NAMED) + "]")

ESCAPE_FORM = re.compile(r"\\x([0-9a-f]{2})|\\u([0-9a-f]{4})|\\U([0-9a-f]{8})")
# The general categories Python's str.isprintable() refuses (space, U+0020, excepted).
UNPRINTABLE_CATEGORIES = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"}
ALL_CATEGORIES = sorted(
    {"Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po"}
    | {"Sm", "Sc", "Sk", "So"}
    | UNPRINTABLE_CATEGORIES
)

# No deadlines: the machine the tests share may be slow for a moment, which says nothing about the escaper.
RELAXED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

HOSTILE = "\x1b[31m\u202egpj.exe\u200b\n\u2028\ufeff\x85\udcff"


def read_back(text: str) -> str:
    """What `escape` wrote, decoded: the original, when it held no backslash of its own."""
    return ESCAPE_FORM.sub(lambda m: chr(int(next(g for g in m.groups() if g), 16)), text)


@pytest.mark.parametrize("char", NAMED, ids=lambda char: f"U+{ord(char):04X}")
def test_every_named_character_is_escaped_visibly(char: str) -> None:
    shown = escape(f"a{char}b")
    assert not FORBIDDEN.search(shown)
    code = ord(char)
    assert shown == (f"a\\x{code:02x}b" if code < 0x100 else f"a\\u{code:04x}b")


@pytest.mark.parametrize("category", ALL_CATEGORIES)
@settings(RELAXED, max_examples=50)
@given(data=st.data())
def test_each_category_is_escaped_or_kept(category: str, data: st.DataObject) -> None:
    char = data.draw(st.characters(categories=[category]))
    shown = escape(char)
    if category in UNPRINTABLE_CATEGORIES and char != " ":
        assert shown != char and ESCAPE_FORM.fullmatch(shown) and read_back(shown) == char
    else:
        assert shown is char
    assert unicodedata.category(char) == category


@RELAXED
@given(st.text(st.characters(exclude_characters="\\")))
@example(HOSTILE)
def test_escaped_text_is_printable_and_reads_back(text: str) -> None:
    shown = escape(text)
    assert shown.isprintable() and not FORBIDDEN.search(shown)
    if sum(not char.isprintable() for char in text) <= ESCAPES_MAX:
        assert read_back(shown) == text  # escaped, not deleted


@RELAXED
@given(st.text())
@example(HOSTILE * 20)
def test_escaping_twice_changes_nothing(text: str) -> None:
    once = escape(text)
    assert escape(once) == once


@RELAXED
@given(st.text(), st.text(st.sampled_from(["\U000e0041", "\x00", "\u202e", "x"]), max_size=400))
def test_growth_is_bounded(head: str, tail: str) -> None:
    text = head + tail
    assert len(escape(text)) <= len(text) + ESCAPE_GROWTH_MAX


def test_a_flood_of_hostile_characters_is_bounded_and_still_visible() -> None:
    flood = "name" + "\u200b" * 100_000 + "\U000e0041" * 1_000
    shown = escape(flood)
    assert len(shown) <= len(flood) + ESCAPE_GROWTH_MAX
    assert shown.startswith("name" + "\\u200b" * ESCAPES_MAX + REPLACEMENT)
    assert shown.count(REPLACEMENT) == len(flood) - 4 - ESCAPES_MAX and shown.isprintable()


@RELAXED
@given(st.text(), st.integers(min_value=0, max_value=80))
@example("abc\x1b[31mdef\u202e", 8)
@example("abc\U000e0041", 10)
def test_clip_never_splits_an_escape(text: str, limit: int) -> None:
    full = escape(text)
    cut = clip(full, limit)
    assert len(cut) <= max(limit, len(ELLIPSIS))
    if cut == full:
        return
    head = cut.removesuffix(ELLIPSIS)
    assert full.startswith(head)
    for match in ESCAPE_FORM.finditer(full):
        assert match.end() <= len(head) or match.start() >= len(head), (full, cut)


@RELAXED
@given(st.text())
@example("a\nb\r\nc\x0bd\x0ce\x1cf\x85g\u2028h\u2029i")
def test_one_line_never_splits_a_line(text: str) -> None:
    line = one_line(text)
    assert len(line.splitlines()) <= 1 and line.isprintable()
    assert one_line(text, 20, "...") == clip(line, 20, "...")


def test_escape_value_escapes_keys_and_nested_strings_and_keeps_clean_values() -> None:
    clean = {"pid": 1, "holders": [{"executable": "python3", "things": ("davinci0",)}], "ok": True}
    assert escape_value(clean) is clean
    hostile = {"holders": [{"executable": HOSTILE, "things": ("nvidia\u202e0", 3)}], "path\n": 1.5}
    escaped = escape_value(hostile)
    assert escaped == {
        "holders": [{"executable": escape(HOSTILE), "things": ("nvidia\\u202e0", 3)}],
        "path\\x0a": 1.5,
    }
    assert not FORBIDDEN.search(json.dumps(escaped, ensure_ascii=False))


# --- where messages are made ---------------------------------------------------------------------------


def test_a_finding_escapes_its_text_once_whatever_builds_it() -> None:
    finding = Finding(
        "npu.holders",
        f"npu0{HOSTILE}",
        Status.FAIL,
        "NpuHeldOutOfBand",
        f"held by PID 1 ({HOSTILE})",
        f"kill {HOSTILE}",
        {"holders": [{"executable": HOSTILE}]},
        event=Event("StaleLockRemoved", f"removed {HOSTILE}"),
    )
    document = json.dumps(finding.to_dict(), ensure_ascii=False)
    assert not FORBIDDEN.search(document) and escape(HOSTILE) in finding.message
    assert finding.subject == f"npu0{escape(HOSTILE)}" and finding.hint == f"kill {escape(HOSTILE)}"
    assert finding.event is not None and finding.event.message == f"removed {escape(HOSTILE)}"
    # observed keeps what was measured inside the agent; it leaves (to_dict: /status, check --json) escaped.
    assert finding.observed["holders"][0]["executable"] == HOSTILE
    assert finding.to_dict()["observed"] == {"holders": [{"executable": escape(HOSTILE)}]}
    # replace() runs the escaping again: nothing changes, the key stays the key.
    again = replace(finding, status=Status.WARN)
    assert (again.key, again.message, again.to_dict()["observed"]) == (
        finding.key,
        finding.message,
        finding.to_dict()["observed"],
    )


def test_sample_labels_are_escaped() -> None:
    sample = Sample("nodehealth_storage_free_bytes", "Free bytes.", 1.0, {"path": f"/data/{HOSTILE}"})
    assert sample.labels == {"path": f"/data/{escape(HOSTILE)}"}


def test_every_event_the_agent_queues_is_escaped() -> None:
    queue = EventQueue("node-a", lambda: 0.0, lambda: 0.0, random.Random(0), lambda _what: None, 1.0, 10.0)
    queue.add("NodeHealthAgent", f"something about {HOSTILE}", True)
    (queued,) = queue.pending()
    assert queued.message == f"something about {escape(HOSTILE)}"


def _record(message: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("agent.test", logging.WARNING, __file__, 1, message, args, info)


def _raised(message: str) -> BaseException:
    try:
        raise OSError(message)
    except OSError as exc:
        return exc


def test_the_text_log_is_one_escaped_line_per_record_and_marks_traceback_lines() -> None:
    formatter = TextFormatter()
    line = formatter.format(_record("did not remove %s", f"/cache/{HOSTILE}/lock"))
    assert "\n" not in line and not FORBIDDEN.search(line)
    assert line.endswith(f"WARNING agent.test: did not remove /cache/{escape(HOSTILE)}/lock")
    record = _record("probe failed", exc=_raised(f"bad {HOSTILE}"))
    logging.Formatter().format(record)  # another handler caches the traceback unescaped on the record
    first, *rest = formatter.format(record).split("\n")
    assert first.endswith("WARNING agent.test: probe failed")
    # The exception's own newline cannot start a line that passes for a record.
    assert rest[0] == f"{CONTINUATION}Traceback (most recent call last):" and all(
        line.startswith(CONTINUATION) for line in rest
    )
    assert rest[-2:] == [
        f"{CONTINUATION}OSError: bad \\x1b[31m\\u202egpj.exe\\u200b",
        f"{CONTINUATION}\\u2028\\ufeff\\x85\\udcff",
    ]
    assert not any(FORBIDDEN.search(line) for line in [first, *rest])


def test_the_json_log_escapes_message_and_traceback() -> None:
    formatter = JsonFormatter()
    entry = json.loads(formatter.format(_record("parse error: %s", f"npu-smi said {HOSTILE}")))
    assert entry["msg"] == f"parse error: npu-smi said {escape(HOSTILE)}"
    entry = json.loads(formatter.format(_record("x", exc=_raised(HOSTILE))))
    assert entry["exc"].startswith("Traceback (most recent call last):")
    assert not any(FORBIDDEN.search(line) for line in entry["exc"].split("\n"))
    assert "OSError: \\x1b[31m\\u202egpj.exe\\u200b" in entry["exc"]


def test_configure_logging_installs_the_escaping_formatters(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "_node_health", False)]
    saved_level = root.level
    for handler in ours:
        root.removeHandler(handler)
    try:
        for fmt, kind in (("json", JsonFormatter), ("text", TextFormatter)):
            stream = io.StringIO()
            monkeypatch.setattr(sys, "stderr", stream)
            configure_logging(fmt, "warning")
            (handler,) = [h for h in root.handlers if getattr(h, "_node_health", False)]
            root.removeHandler(handler)  # the next round installs its own on its own stream
            assert isinstance(handler.formatter, kind)
            handler.handle(_record("hostile: %s", HOSTILE))
            written = stream.getvalue()
            assert written.count("\n") == 1 and not FORBIDDEN.search(written.rstrip("\n")), written
    finally:
        root.setLevel(saved_level)
        for handler in ours:
            root.addHandler(handler)


SECRET_URL = "proxy http://svc:s3cr3t@proxy.example:3128 refused; also 'https://u:p@w@h/x'"


def test_userinfo_is_redacted_from_urls() -> None:
    assert redact_userinfo(SECRET_URL) == "proxy http://***@proxy.example:3128 refused; also 'https://***@h/x'"
    assert redact_userinfo("http://proxy.example:3128 and mail user@example.com") == (
        "http://proxy.example:3128 and mail user@example.com"
    )


def test_events_and_both_log_formats_never_carry_a_urls_password() -> None:
    queue = EventQueue("node-a", lambda: 0.0, lambda: 0.0, random.Random(0), lambda _what: None, 1.0, 10.0)
    queue.add("EgressProxyAuthRequired", SECRET_URL, True)
    (queued,) = queue.pending()
    assert "s3cr3t" not in queued.message and "http://***@proxy.example:3128" in queued.message
    text = TextFormatter().format(_record("egress: %s", SECRET_URL, exc=_raised(SECRET_URL)))
    entry = json.loads(JsonFormatter().format(_record("egress: %s", SECRET_URL, exc=_raised(SECRET_URL))))
    for written in (text, entry["msg"], entry["exc"]):
        assert "s3cr3t" not in written and "***@proxy.example:3128" in written
