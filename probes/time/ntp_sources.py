"""Which NTP servers to measure against: `time.ntp_servers`, else the servers the host's own time daemon uses.

Read under host.root, first match wins: chrony (/etc/chrony.conf, /etc/chrony/chrony.conf and what they pull
in with include, confdir and sourcedir: server, pool and peer lines), ntpd (/etc/ntp.conf, or ntpsec's
/etc/ntpsec/ntp.conf: server, pool and peer lines), systemd-timesyncd (/etc/systemd/timesyncd.conf and its
timesyncd.conf.d drop-ins: NTP=, else FallbackNTP=). The node's clock is then judged against the servers
its daemon follows, so a daemon following the wrong servers shows.
"""

from __future__ import annotations

import glob
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from probes.runtime.addresses import split_host_port
from probes.runtime.paths import HostPaths

CONFIGURED = "time.ntp_servers"
MAX_DISCOVERED = 8  # a pool line may be followed by many more; a handful judges the clock
# chrony's default `maxsources` of a pool: how many of a name's addresses judge the clock. A `server` name (or a
# time.ntp_servers entry) with several addresses is judged the same way, by up to this many that answer.
DEFAULT_MAX_SOURCES = 4
MAX_MAX_SOURCES = 16  # chrony's own limit for maxsources
MAX_INCLUDE_DEPTH = 4

CHRONY_FILES = ("/etc/chrony.conf", "/etc/chrony/chrony.conf")
NTPD_FILES = ("/etc/ntp.conf", "/etc/ntpsec/ntp.conf")
TIMESYNCD_FILE = "/etc/systemd/timesyncd.conf"
TIMESYNCD_DROPIN_DIRS = (
    "/etc/systemd/timesyncd.conf.d",
    "/run/systemd/timesyncd.conf.d",
    "/usr/lib/systemd/timesyncd.conf.d",
)
SOURCE_DIRECTIVES = ("server", "pool", "peer")
# ntpd's reference-clock pseudo addresses (127.127.t.u): a driver, not a server to ask.
NTPD_REFCLOCK_PREFIX = "127.127."


@dataclass(frozen=True)
class NtpServer:
    entry: str  # as configured or written in the host file: "host" or "host:port"; the finding's subject
    host: str
    port: int
    source: str  # "time.ntp_servers" or the host file it came from, e.g. /etc/chrony/chrony.conf
    directive: str = ""  # server, pool, peer, NTP, FallbackNTP
    # Of the addresses the name resolves to, how many answering ones judge the clock (a pool's maxsources).
    max_sources: int = DEFAULT_MAX_SOURCES


@dataclass
class NtpSources:
    servers: list[NtpServer]
    origin: str  # "time.ntp_servers", "chrony", "ntpd", "systemd-timesyncd" or "" when none was found
    files: list[str] = field(default_factory=list)  # host files read
    unreadable: list[str] = field(default_factory=list)  # "path: why"


def _entry(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return host if port == 123 else f"{shown}:{port}"


def _is_comment(line: str) -> bool:
    return not line or line[0] in "#!;%"


def parse_chrony_conf(text: str, source: str) -> tuple[list[NtpServer], list[tuple[str, list[str]]]]:
    """chrony.conf (or a *.sources file) → (servers, include directives as (keyword, arguments))."""
    servers: list[NtpServer] = []
    includes: list[tuple[str, list[str]]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if _is_comment(line):
            continue
        words = line.split()
        keyword = words[0].lower()
        if keyword in SOURCE_DIRECTIVES and len(words) >= 2:
            port, max_sources = 123, DEFAULT_MAX_SOURCES
            for option, value in itertools.pairwise(words[2:]):
                if not value.isascii() or not value.isdigit():
                    continue
                if option.lower() == "port" and 0 < int(value) < 65536:
                    port = int(value)
                elif option.lower() == "maxsources" and keyword == "pool" and int(value) > 0:
                    max_sources = min(int(value), MAX_MAX_SOURCES)
            servers.append(NtpServer(_entry(words[1], port), words[1], port, source, keyword, max_sources))
        elif keyword in ("include", "confdir", "sourcedir") and len(words) >= 2:
            includes.append((keyword, words[1:]))
    return servers, includes


def parse_ntp_conf(text: str, source: str) -> list[NtpServer]:
    """ntp.conf → its server, pool and peer lines (`server -4 host iburst`; refclocks left out)."""
    servers: list[NtpServer] = []
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].split()
        if len(words) < 2 or words[0].lower() not in SOURCE_DIRECTIVES:
            continue
        hosts = [word for word in words[1:] if not word.startswith("-")]
        if not hosts or hosts[0].startswith(NTPD_REFCLOCK_PREFIX):
            continue
        servers.append(NtpServer(hosts[0], hosts[0], 123, source, words[0].lower()))
    return servers


def parse_timesyncd_conf(text: str, current: dict[str, list[str]]) -> None:
    """One timesyncd.conf (or drop-in) applied to `current` ({"NTP": [...], "FallbackNTP": [...]}): each
    assignment adds its space-separated servers, an empty one resets the list (systemd.syntax(7))."""
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if section != "Time" or not sep or key not in ("NTP", "FallbackNTP"):
            continue
        if not value.strip():
            current[key] = []
        else:
            current.setdefault(key, []).extend(value.split())


class _HostFiles:
    """Reads host files under host.root, noting what it read and what it could not."""

    def __init__(self, paths: HostPaths, sources: NtpSources) -> None:
        self.paths = paths
        self.sources = sources

    def read(self, host_path: str) -> str | None:
        path = self.paths.root_path(host_path)
        try:
            text = path.read_text(errors="replace")
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.sources.unreadable.append(f"{host_path}: {exc.strerror or exc}")
            return None
        self.sources.files.append(host_path)
        return text

    def glob(self, host_pattern: str) -> list[str]:
        """Host paths matching a host glob pattern, sorted."""
        matches = sorted(glob.glob(str(self.paths.root_path(host_pattern))))
        return [self.paths.host_path(match) for match in matches]


def _chrony_included(files: _HostFiles, keyword: str, arguments: list[str]) -> list[str]:
    if keyword == "include":
        return files.glob(arguments[0])
    suffix = ".conf" if keyword == "confdir" else ".sources"
    by_name: dict[str, str] = {}
    for directory in arguments:  # the first directory holding a file name wins (chrony.conf(5))
        for path in files.glob(f"{directory.rstrip('/')}/*{suffix}"):
            by_name.setdefault(Path(path).name, path)
    return [by_name[name] for name in sorted(by_name)]


def _chrony_file(files: _HostFiles, host_path: str, depth: int, out: list[NtpServer]) -> None:
    if host_path in files.sources.files:
        return  # included twice (or by itself): its servers are already listed
    text = files.read(host_path)
    if text is None:
        return
    servers, includes = parse_chrony_conf(text, host_path)
    out.extend(servers)
    if depth >= MAX_INCLUDE_DEPTH:
        return
    for keyword, arguments in includes:
        for included in _chrony_included(files, keyword, arguments):
            _chrony_file(files, included, depth + 1, out)


def chrony_servers(files: _HostFiles) -> list[NtpServer]:
    out: list[NtpServer] = []
    for host_path in CHRONY_FILES:
        _chrony_file(files, host_path, 0, out)
    return out


def ntpd_servers(files: _HostFiles) -> list[NtpServer]:
    out: list[NtpServer] = []
    for host_path in NTPD_FILES:
        text = files.read(host_path)
        if text is not None:
            out.extend(parse_ntp_conf(text, host_path))
    return out


def timesyncd_servers(files: _HostFiles) -> list[NtpServer]:
    dropins: dict[str, str] = {}
    for directory in TIMESYNCD_DROPIN_DIRS:  # /etc overrides /run overrides /usr/lib, by file name
        for path in files.glob(f"{directory}/*.conf"):
            dropins.setdefault(Path(path).name, path)
    current: dict[str, list[str]] = {}
    last_source: dict[str, str] = {}
    for host_path in [TIMESYNCD_FILE, *(dropins[name] for name in sorted(dropins))]:
        text = files.read(host_path)
        if text is None:
            continue
        before = {key: list(value) for key, value in current.items()}
        parse_timesyncd_conf(text, current)
        for key, value in current.items():
            if value != before.get(key):
                last_source[key] = host_path
    key = "NTP" if current.get("NTP") else "FallbackNTP"
    out: list[NtpServer] = []
    for item in current.get(key, []):
        try:
            host, port = split_host_port(item, 123)
        except ValueError:
            continue
        out.append(NtpServer(item, host, port, last_source.get(key, TIMESYNCD_FILE), key))
    return out


def _unique(servers: Iterable[NtpServer]) -> list[NtpServer]:
    seen: dict[str, NtpServer] = {}
    for server in servers:
        seen.setdefault(server.entry, server)
    return list(seen.values())[:MAX_DISCOVERED]


def ntp_sources(configured: list[str], paths: HostPaths) -> NtpSources:
    """The servers to measure against and where they came from."""
    if configured:
        servers = []
        for entry in configured:
            host, port = split_host_port(entry, 123)
            servers.append(NtpServer(entry, host, port, CONFIGURED))
        return NtpSources(servers, CONFIGURED)
    sources = NtpSources([], "")
    files = _HostFiles(paths, sources)
    for origin, read in (("chrony", chrony_servers), ("ntpd", ntpd_servers), ("systemd-timesyncd", timesyncd_servers)):
        found = _unique(read(files))
        if found:
            sources.servers, sources.origin = found, origin
            break
    return sources
