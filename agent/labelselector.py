"""Kubernetes label selectors as kube-apiserver parses them (k8s.io/apimachinery's labels.Parse): checked when the
config is loaded, so a selector the API server would refuse with 400 at the first recount is a config error."""

from __future__ import annotations

import re

_QUALIFIED_NAME = re.compile(r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_SELECTOR_TERM = re.compile(
    r"\s*(?:(?P<not>!)\s*(?P<absent>[^\s!=(),]+)|(?P<key>[^\s!=(),]+)"
    r"(?:\s*(?P<op>==|!=|=)\s*(?P<value>[^\s!=(),]*)|\s+(?P<set>in|notin)\s*\((?P<values>[^()]*)\))?)\s*"
)


def label_selector_problem(selector: str) -> str:
    """What makes `selector` no label selector kube-apiserver parses (keys, values, operators; `key`, `!key`,
    `key=v`, `key==v`, `key!=v`, `key in (a,b)`, `key notin (a,b)`, comma-separated); empty when it is one."""
    rest = selector.strip()
    while rest:
        found = _SELECTOR_TERM.match(rest)
        if found is None or found.end() == 0:
            return f"cannot parse {rest!r}"
        key = found["absent"] or found["key"]
        values = [v.strip() for v in found["values"].split(",")] if found["set"] else [found["value"] or ""]
        if not _QUALIFIED_NAME.fullmatch(key):
            return f"{key!r} is not a label key"
        bad = next((v for v in values if not _LABEL_VALUE.fullmatch(v)), None)
        if bad is not None:
            return f"{bad!r} is not a label value"
        rest = rest[found.end() :]
        if rest and not rest.startswith(","):
            return f"cannot parse {rest!r}"
        rest = rest[1:].strip() if rest else rest
        if not rest and selector.rstrip().endswith(","):
            return "a trailing comma"
    return ""
