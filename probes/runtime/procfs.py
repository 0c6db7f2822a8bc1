"""Shared /proc machinery: who holds a device or file open, and which pod, container or unit a process is in.

- `scan_open_files`: one pass over every /proc/*/fd, in a forked child with a deadline (a stat of an fd
  on a hung NFS file blocks in D state, so it never runs on an agent thread). Character devices match by
  st_rdev (a container's /dev/davinci0 is a different inode with the same major:minor, which `fuser` on
  the host path misses), regular files by (st_dev, st_ino), sockets by the `socket:[N]` link text.
- `classify_cgroup`: /proc/PID/cgroup text → pod / container / service / session / host, for cgroup v1
  and v2, the cgroupfs and systemd drivers, and paths seen from a private cgroup namespace (`/../`).
- `process_info`: pid, start time (field 22 of /proc/PID/stat; pids are reused, so results are keyed by
  (pid, start_time)), command and cgroup owner.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from probes.runtime.host import Host

# --- cgroup → owner --------------------------------------------------------------------------------

# A pod UID as kubelet writes it into cgroup names: dashed (cgroupfs), underscored (systemd driver), or
# a bare 32-hex hash (static pods' UIDs are an md5 of the manifest).
_UID = r"[0-9a-f]{8}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{12}"
# `pod<uid>` (cgroupfs) or `kubepods[-<qos>]-pod<uid>.slice` (systemd). Guaranteed pods have no QoS level;
# a kubelet with its own cgroup root (kind: `kubelet-kubepods-besteffort-pod<uid>.slice`) adds a prefix.
_POD_SEGMENT = re.compile(rf"^(?:[a-z0-9_.]+(?:-[a-z0-9_.]+)*-)?pod({_UID})(?:\.slice)?$")
# Container scopes of the systemd driver: cri-containerd-<id>.scope, crio-<id>.scope,
# crio-conmon-<id>.scope, docker-<id>.scope, libpod-<id>.scope (podman), nerdctl-<id>.scope.
_SCOPE_SEGMENT = re.compile(
    r"^(cri-containerd|containerd|crio-conmon|crio|docker|libpod-conmon|libpod|nerdctl)-([0-9a-f]{12,64})\.scope$"
)
_SCOPE_RUNTIME = {
    "cri-containerd": "containerd",
    "containerd": "containerd",
    "nerdctl": "containerd",
    "crio": "cri-o",
    "crio-conmon": "cri-o",
    "docker": "docker",
    "libpod": "podman",
    "libpod-conmon": "podman",
}
# A bare container id (cgroupfs driver): /docker/<64hex>, /kubepods/burstable/pod<uid>/<64hex>.
_BARE_ID = re.compile(r"^(?:(crio|docker|cri-containerd)-)?([0-9a-f]{64})$")
# Parent directory → runtime for bare ids of the cgroupfs driver.
_PARENT_RUNTIME = {"docker": "docker", "crio": "cri-o", "libpod_parent": "podman", "containerd": "containerd"}


@dataclass(frozen=True)
class CgroupOwner:
    """What a process belongs to, from its cgroup path.

    kind: "pod" (a Kubernetes pod; `pod_uid` set, `container_id` when the path names a container),
    "container" (a runtime scope outside Kubernetes: `docker run`, `nerdctl run`, podman),
    "service" (a systemd unit other than a login session, `unit` set), "session" (a login session
    scope, `unit` = session-N.scope), "host" (the root cgroup, init.scope, or a path nothing above
    recognises), "unknown" (no cgroup text at all).
    """

    kind: str
    pod_uid: str | None = None
    container_id: str | None = None
    runtime: str | None = None  # containerd, cri-o, docker, podman
    unit: str | None = None  # systemd unit or scope
    path: str = ""

    @property
    def in_pod(self) -> bool:
        return self.kind == "pod"

    def describe(self) -> str:
        """A short phrase for messages: `pod 1f2e…`, `docker container 4c3b…`, `system.slice/x.service`."""
        if self.kind == "pod":
            text = f"pod {self.pod_uid}"
            return text + (f" container {self.container_id[:12]}" if self.container_id else "")
        if self.kind == "container":
            return f"{self.runtime or 'runtime'} container {(self.container_id or '')[:12]} outside Kubernetes"
        if self.kind in ("service", "session"):
            return f"{self.kind} {self.unit}"
        return f"host cgroup {self.path or '/'}"


def cgroup_path(cgroup_file_text: str) -> str:
    """The one path that tells where a process lives: v1 memory, else v1 pids, else v2 `0::`, else the first."""
    first: str | None = None
    unified: str | None = None
    by_controller: dict[str, str] = {}
    for line in cgroup_file_text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if first is None:
            first = path
        if hierarchy == "0" and controllers == "":
            unified = path
            continue
        for controller in controllers.split(","):
            by_controller.setdefault(controller, path)
    for wanted in ("memory", "pids"):
        if wanted in by_controller:
            return by_controller[wanted]
    if unified is not None:
        return unified
    return first if first is not None else ""


def classify_cgroup(cgroup_file_text: str) -> CgroupOwner:
    """Classify /proc/PID/cgroup text (v1 or v2, cgroupfs or systemd driver, any cgroup namespace)."""
    if not cgroup_file_text.strip():
        return CgroupOwner("unknown")
    return classify_cgroup_path(cgroup_path(cgroup_file_text))


def classify_cgroup_path(path: str) -> CgroupOwner:
    """Classify one cgroup path; `..` segments (a reader in a private cgroup namespace) are ignored."""
    segments = [s for s in path.split("/") if s and s not in (".", "..")]
    for index, segment in enumerate(segments):
        pod = _POD_SEGMENT.match(segment)
        if pod:
            uid = pod.group(1).replace("_", "-")
            container_id, runtime = _container_in(segments[index + 1 :])
            return CgroupOwner("pod", pod_uid=uid, container_id=container_id, runtime=runtime, path=path)
    for index in range(len(segments) - 1, -1, -1):
        segment = segments[index]
        scope = _SCOPE_SEGMENT.match(segment)
        if scope:
            return CgroupOwner(
                "container",
                container_id=scope.group(2),
                runtime=_SCOPE_RUNTIME[scope.group(1)],
                unit=segment,
                path=path,
            )
        bare = _BARE_ID.match(segment)
        if bare:
            parent = segments[index - 1] if index > 0 else ""
            runtime = _SCOPE_RUNTIME.get(bare.group(1) or "") or _PARENT_RUNTIME.get(parent)
            return CgroupOwner("container", container_id=bare.group(2), runtime=runtime, path=path)
    for segment in reversed(segments):
        if segment == "init.scope":
            return CgroupOwner("host", unit=segment, path=path)
        if segment.startswith("session-") and segment.endswith(".scope"):
            return CgroupOwner("session", unit=segment, path=path)
        if segment.endswith((".service", ".scope")):
            return CgroupOwner("service", unit=segment, path=path)
    return CgroupOwner("host", path=path)


def _container_in(segments: list[str]) -> tuple[str | None, str | None]:
    """(container id, runtime) from the segments below a pod's cgroup; (None, None) for the pod itself."""
    for segment in reversed(segments):
        scope = _SCOPE_SEGMENT.match(segment)
        if scope:
            return scope.group(2), _SCOPE_RUNTIME[scope.group(1)]
        bare = _BARE_ID.match(segment)
        if bare:
            return bare.group(2), _SCOPE_RUNTIME.get(bare.group(1) or "")
    if segments:
        # An id format not seen before: still report the leaf, without guessing the runtime.
        leaf = segments[-1]
        return (leaf[: -len(".scope")] if leaf.endswith(".scope") else leaf), None
    return None, None


# --- processes -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    start_time: int  # field 22 of /proc/PID/stat, clock ticks since boot: (pid, start_time) is unique
    command: str  # the command line (NULs as spaces, at most 256 chars), or [comm] for kernel threads
    cgroup: CgroupOwner
    comm: str = ""  # the kernel's 15-character task name
    uid: int | None = None  # real uid from /proc/PID/status

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start_time)


def parse_stat(text: str) -> tuple[str, list[str]]:
    """/proc/PID/stat → (comm, fields from field 3 on). comm may hold spaces and ')': split at the last ')'."""
    open_paren = text.find("(")
    close_paren = text.rfind(")")
    if open_paren < 0 or close_paren < open_paren:
        raise ValueError(f"not a /proc/PID/stat line: {text[:80]!r}")
    return text[open_paren + 1 : close_paren], text[close_paren + 1 :].split()


def parse_start_time(text: str) -> int:
    """Field 22 (starttime) of a /proc/PID/stat line."""
    _, rest = parse_stat(text)
    if len(rest) < 20:
        raise ValueError(f"/proc/PID/stat has {len(rest) + 2} fields, need 22")
    return int(rest[19])  # rest[0] is field 3


def process_info(proc: Path, pid: int) -> ProcessInfo | None:
    """pid, start time, command and cgroup owner of one process; None when it has vanished."""
    base = Path(proc) / str(pid)
    try:
        stat_text = (base / "stat").read_text(errors="replace")
        comm, _ = parse_stat(stat_text)
        start_time = parse_start_time(stat_text)
        cgroup_text = (base / "cgroup").read_text(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    except ValueError:  # a truncated read of a process that is exiting
        return None
    command = ""
    with contextlib.suppress(OSError):
        raw = (base / "cmdline").read_bytes()[:4096]
        # One line for messages: NULs between arguments, and newlines inside them, become single spaces.
        command = " ".join(raw.decode("utf-8", "replace").replace("\0", " ").split())[:256]
    uid: int | None = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in (base / "status").read_text(errors="replace").splitlines():
            if line.startswith("Uid:"):
                uid = int(line.split()[1])
                break
    # A pid reused between the two reads would mix two processes: re-check the start time.
    try:
        if parse_start_time((base / "stat").read_text(errors="replace")) != start_time:
            return None
    except (OSError, ValueError):
        return None
    return ProcessInfo(pid, start_time, command or f"[{comm}]", classify_cgroup(cgroup_text), comm, uid)


def list_pids(proc: Path) -> list[int]:
    return sorted(int(name) for name in os.listdir(proc) if name.isdigit())


# --- device numbers --------------------------------------------------------------------------------


def device_rdevs(dev_dir: Path, patterns: Sequence[str]) -> dict[int, str]:
    """rdev → path of the character devices under dev_dir whose name matches any glob pattern.

    Patterns are relative to dev_dir (`davinci[0-9]*`, `davinci_manager`, `dri/card*`). When two nodes
    share a device number the first path in sorted order names it.
    """
    found: dict[int, str] = {}
    base = Path(dev_dir)
    paths: set[Path] = set()
    for pattern in patterns:
        with contextlib.suppress(OSError):
            paths.update(base.glob(pattern))
    for path in sorted(paths):
        try:
            st = path.stat()
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            found.setdefault(st.st_rdev, str(path))
    return found


def format_rdev(rdev: int) -> str:
    return f"{os.major(rdev)}:{os.minor(rdev)}"


# --- open-file scan --------------------------------------------------------------------------------


class ScanError(Exception):
    """The scan of /proc/*/fd could not be done (the child failed); the check is unknown."""


class ScanTimeout(ScanError):
    """The scan did not finish by its deadline, or a previous scan is still stuck (a hung filesystem)."""


@dataclass(frozen=True)
class FdMatch:
    pid: int
    start_time: int
    fd: int
    target: str  # readlink text of /proc/PID/fd/N, as the holder's mount namespace names it
    key: tuple[Any, ...]  # ("rdev", rdev) | ("inode", st_dev, st_ino) | ("socket", inode)


@dataclass(frozen=True)
class ScanResult:
    matches: tuple[FdMatch, ...]
    vanished: int  # processes that exited, and fds closed, while being read
    permission_denied: int  # processes whose fd table (or some fd) could not be read (EACCES/EPERM)
    processes: int
    fds: int
    duration: float  # seconds, including the child's start

    def by_key(self) -> dict[tuple[Any, ...], list[FdMatch]]:
        out: dict[tuple[Any, ...], list[FdMatch]] = {}
        for match in self.matches:
            out.setdefault(match.key, []).append(match)
        return out


SCAN_KEY = "procfs-fd-scan"
_SCAN_LOCKS: dict[str, threading.Lock] = {}
_SCAN_LOCKS_GUARD = threading.Lock()


def _scan_lock(key: str) -> threading.Lock:
    with _SCAN_LOCKS_GUARD:
        return _SCAN_LOCKS.setdefault(key, threading.Lock())


def scan_open_files(
    host: Host,
    *,
    rdevs: Collection[int] = (),
    inodes: Collection[tuple[int, int]] = (),
    sockets: Collection[int] = (),
    timeout: float,
    key: str = SCAN_KEY,
) -> ScanResult:
    """One pass over every /proc/*/fd of the host, in a child process bounded by `timeout`.

    Scans with the same `key` run one at a time: a caller waits (within its timeout) for another probe's
    scan to finish rather than being refused, and a child stuck on a hung filesystem blocks further
    scans under that key (ScanTimeout) until it is gone, instead of piling up children.

    Raises ScanTimeout when the child does not answer in time (or a previous one is still stuck),
    ScanError when it fails otherwise. Vanished processes and fds, and permission errors, are counted.
    """
    started = time.monotonic()
    lock = _scan_lock(key)
    if not lock.acquire(timeout=max(timeout, 0.0)):
        raise ScanTimeout(f"scan of {host.proc}/*/fd: another scan still running after {timeout:g}s")
    try:
        result = host.child_call(
            key,
            scan_fds_in_child,
            str(host.proc),
            frozenset(int(r) for r in rdevs),
            frozenset((int(d), int(i)) for d, i in inodes),
            frozenset(int(s) for s in sockets),
            timeout=max(timeout - (time.monotonic() - started), 1e-3),
        )
    finally:
        lock.release()
    if result.state in ("timeout", "busy"):
        raise ScanTimeout(f"scan of {host.proc}/*/fd: {result.error or result.state}")
    if not result.ok:
        raise ScanError(f"scan of {host.proc}/*/fd failed: {result.error}")
    return scan_result_from_raw(result.value, time.monotonic() - started)


def scan_result_from_raw(raw: dict[str, Any], duration: float) -> ScanResult:
    matches = tuple(FdMatch(pid, start, fd, target, tuple(key)) for pid, start, fd, target, key in raw["matches"])
    return ScanResult(
        matches=matches,
        vanished=raw["vanished"],
        permission_denied=raw["permission_denied"],
        processes=raw["processes"],
        fds=raw["fds"],
        duration=duration,
    )


_DENIED = (errno.EACCES, errno.EPERM)
_GONE = (errno.ENOENT, errno.ESRCH)


def scan_fds_in_child(
    proc_dir: str, rdevs: frozenset[int], inodes: frozenset[tuple[int, int]], sockets: frozenset[int]
) -> dict[str, Any]:
    """Runs in a forked child (see probes.runtime.host.ChildCalls): only `os` and pure Python, no logging, no imports.

    Returns plain data: {"matches": [(pid, start_time, fd, target, key)], "vanished", "permission_denied",
    "processes", "fds"}.
    """
    want_stat = bool(rdevs or inodes)
    want_sockets = bool(sockets)
    self_pid = os.getpid()
    s_ischr = stat.S_ISCHR
    found: list[tuple[int, int, str, tuple[Any, ...]]] = []
    vanished = denied = processes = fds = 0
    for name in os.listdir(proc_dir):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == self_pid:
            continue
        processes += 1
        try:
            dir_fd = os.open(f"{proc_dir}/{name}/fd", os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            if exc.errno in _DENIED:
                denied += 1
            else:
                vanished += 1
            continue
        proc_denied = False
        try:
            try:
                entries = os.listdir(dir_fd)
            except OSError as exc:
                if exc.errno in _DENIED:
                    denied += 1
                else:
                    vanished += 1
                continue
            for entry in entries:
                fds += 1
                try:
                    target = os.readlink(entry, dir_fd=dir_fd)
                except OSError as exc:
                    if exc.errno in _DENIED:
                        proc_denied = True
                    else:
                        vanished += 1
                    continue
                if target.startswith("socket:["):
                    if want_sockets:
                        try:
                            inode = int(target[8:-1])
                        except ValueError:
                            continue
                        if inode in sockets:
                            found.append((pid, int(entry), target, ("socket", inode)))
                    continue
                # pipe:[N], anon_inode:[eventfd], net:[N], mnt:[N] ... name no file we could want.
                if not want_stat or not target.startswith("/"):
                    continue
                try:
                    st = os.stat(entry, dir_fd=dir_fd)
                except OSError as exc:
                    if exc.errno in _DENIED:
                        proc_denied = True
                    else:
                        vanished += 1
                    continue
                if rdevs and s_ischr(st.st_mode) and st.st_rdev in rdevs:
                    found.append((pid, int(entry), target, ("rdev", st.st_rdev)))
                elif inodes and (st.st_dev, st.st_ino) in inodes:
                    found.append((pid, int(entry), target, ("inode", st.st_dev, st.st_ino)))
        finally:
            os.close(dir_fd)
        if proc_denied:
            denied += 1
    start_times: dict[int, int | None] = {}
    matches: list[tuple[int, int, int, str, tuple[Any, ...]]] = []
    for pid, fd, target, key in found:
        if pid not in start_times:
            start_times[pid] = _start_time_or_none(proc_dir, pid)
            if start_times[pid] is None:
                vanished += 1
        start = start_times[pid]
        if start is not None:
            matches.append((pid, start, fd, target, key))
    return {
        "matches": matches,
        "vanished": vanished,
        "permission_denied": denied,
        "processes": processes,
        "fds": fds,
    }


def _start_time_or_none(proc_dir: str, pid: int) -> int | None:
    try:
        with open(f"{proc_dir}/{pid}/stat", "rb") as handle:
            text = handle.read().decode("utf-8", "replace")
        return parse_start_time(text)
    except (OSError, ValueError):
        return None
