"""Config files written for another release: `config_version`, and keys a newer release added.

A release may add config keys, and the ConfigMap is shared by every agent: after an upgrade that used a new key,
rolling back must not crash-loop every old pod. So the daemon (`node-health run`, and each reload) sets aside a
key it does not know, with a warning that is logged, counted (`nodehealth_config_unknown_keys`) and listed in
/status, and runs with the rest. A typo is still caught where a person looks: `node-health config --validate`
and `node-health check` refuse unknown keys (exit 2). A file may say which release it was written for,
`config_version: "0.3"`; when that is newer than this release, the warnings (or the error) say so.

Only keys are tolerated. A value this release does not accept (a new choice of an existing key) is an error as
before: the agent does not start with it, and a reload keeps the running config.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from agent.version import __version__

VERSION_KEY = "config_version"
_RELEASE = re.compile(r"(\d{1,4})(?:\.(\d{1,4}))?(?:\.(\d{1,4}))?")


def release_tuple(text: str) -> tuple[int, int, int]:
    """`0.3` → (0, 3, 0); ValueError for anything but one to three dot-separated numbers."""
    match = _RELEASE.fullmatch(text.strip())
    if match is None:
        raise ValueError(text)
    major, minor, patch = (int(part) if part else 0 for part in match.groups())
    return major, minor, patch


@dataclass(frozen=True)
class ConfigNotes:
    """What loading a file set aside, and the release it says it was written for."""

    unknown_keys: tuple[str, ...] = ()
    config_version: str | None = None

    @property
    def newer(self) -> bool:
        """The file says it was written for a newer release than this one."""
        return self.config_version is not None and release_tuple(self.config_version) > release_tuple(__version__)

    def warnings(self) -> list[str]:
        """One line per ignored key, and one when the file is for a newer release; empty when neither."""
        why = (
            f"the file says config_version {self.config_version}: written for a newer release"
            if self.newer
            else "a typo? `node-health config --validate` names it"
        )
        release = f"node-health {__version__}"
        lines = [f"config key {key}: unknown to {release}, ignored ({why})" for key in self.unknown_keys]
        if self.newer and not self.unknown_keys:
            lines.append(
                f"config written for a newer release (config_version {self.config_version}; "
                f"this is node-health {__version__}): every key is known here"
            )
        return lines


def take_config_version(data: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The document without `config_version`, and its value (a release such as "0.3"); ValueError naming the
    key when the value is not a release."""
    if VERSION_KEY not in data:
        return data, None
    value = data[VERSION_KEY]
    text = str(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""
    try:
        release_tuple(text)
    except ValueError:
        raise ValueError(
            f"config key {VERSION_KEY}: must be the release the file was written for, e.g. '0.3' or '0.3.1'"
        ) from None
    return {key: item for key, item in data.items() if key != VERSION_KEY}, text.strip()


def newer_release_note(config_version: str | None) -> str:
    """Appended to a validation error when the file is for a newer release: its new keys are unknown here."""
    notes = ConfigNotes(config_version=config_version)
    if not notes.newer:
        return ""
    return (
        f" (the file says config_version {config_version}: written for a newer release than node-health "
        f"{__version__}, which does not know the keys it added)"
    )


def without_keys(data: dict[str, Any], locations: list[tuple[Any, ...]]) -> tuple[dict[str, Any], list[str]]:
    """A copy of the document with the key at each validation-error location removed, and those keys spelt
    as the errors name them (`kernel_log.new_option`, `storage.space[0].new_option`)."""
    out = copy.deepcopy(data)
    removed = []
    for location in locations:
        key = _remove(out, location)
        if key is not None:
            removed.append(key)
    return out, removed


def _remove(document: Any, location: tuple[Any, ...]) -> str | None:
    """Walk the document along a pydantic error location (skipping the validator tags pydantic inserts, which
    are not keys of the document) and delete the last key; None when the location is not in the document."""
    node, spelt = document, ""
    for index, part in enumerate(location):
        last = index == len(location) - 1
        if isinstance(node, dict) and part in node:
            if last:
                del node[part]
                return spelt + ("." if spelt else "") + str(part)
            node, spelt = node[part], spelt + ("." if spelt else "") + str(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node, spelt = node[part], f"{spelt}[{part}]"
    return None
