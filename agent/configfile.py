"""Reading the config file without trusting it: bounded size, regular files only, bounded YAML.

The same ConfigMap reaches every agent at once, so a bad edit must never kill or bloat them: a file that is
not UTF-8, YAML nested thousands deep, a 5,000-digit integer, an alias bomb (a few hundred bytes that expand
to billions of values when walked), a path that turned into a symlink to /dev/zero — each becomes a
`ConfigFileError` naming what is wrong, before anything walks the document.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from probes.text import clip, redact_userinfo

MAX_CONFIG_BYTES = 1 << 20  # a generous config is a few KiB; the shipped one is about 2
MAX_ALIASES = 100
MAX_DEPTH = 50
MAX_VALUES = 100_000  # scalars and containers, counted with aliases expanded
ERROR_EXCERPT_CHARS = 120
ERROR_MESSAGE_CHARS = 300  # a parser's own message quoted in a config error


class ConfigFileError(Exception):
    """The file cannot be read as a config document; the message says why (never the whole input)."""


def excerpt(value: Any, limit: int = ERROR_EXCERPT_CHARS) -> str:
    """A repr for error messages, cut short: errors must never echo (or expand) a huge input."""
    try:
        text = repr(value) if not isinstance(value, (dict, list)) or _small(value) else f"<{type(value).__name__}>"
    except (RecursionError, ValueError):
        text = f"<{type(value).__name__}>"
    return clip(redact_userinfo(text), limit)


def _small(value: dict[Any, Any] | list[Any]) -> bool:
    return len(value) <= 8 and all(not isinstance(v, (dict, list)) for v in value)


def read_bounded(path: str | Path, limit: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of a regular file (symlinks followed: a mounted ConfigMap is a chain of them), at most
    `limit`; anything else — a device, a FIFO, a directory, a bigger file — is refused without reading on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise ConfigFileError(f"config file {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigFileError(f"config file {path}: not a regular file")
        if info.st_size > limit:
            raise ConfigFileError(f"config file {path}: {info.st_size} bytes, more than the {limit} allowed")
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                raise ConfigFileError(f"config file {path}: more than the {limit} bytes allowed")
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise ConfigFileError(f"config file {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses deep nesting and many aliases while composing, before any value is built."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise ConfigFileError(f"more than {MAX_ALIASES} YAML aliases")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ConfigFileError(f"nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def count_values(document: Any, limit: int = MAX_VALUES) -> int:
    """Values in the document with aliases expanded (as a validator walks it), stopping past `limit`."""
    count = 0
    stack = [document]
    while stack:
        value = stack.pop()
        count += 1
        if count > limit:
            return count
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return count


def parse_yaml(data: bytes, where: str = "config") -> Any:
    """UTF-8 YAML → a Python document within the limits above; ConfigFileError otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"{where}: not UTF-8 (byte {exc.start}: {data[exc.start : exc.start + 1]!r})") from None
    loader = _BoundedLoader(text)
    try:
        document = loader.get_single_data()
    except ConfigFileError as exc:
        raise ConfigFileError(f"{where}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{where}: not valid YAML: {clip(str(exc), ERROR_MESSAGE_CHARS)}") from None
    except (ValueError, RecursionError, OverflowError) as exc:  # e.g. an integer of thousands of digits
        raise ConfigFileError(f"{where}: unreadable value: {clip(str(exc), ERROR_MESSAGE_CHARS)}") from None
    finally:
        loader.dispose()
    if count_values(document) > MAX_VALUES:
        raise ConfigFileError(f"{where}: expands to more than {MAX_VALUES} values (YAML aliases?)")
    return document
