"""Shared /proc machinery: which pod, container or unit a process is in, and who holds what open.

- `classify_cgroup`: /proc/PID/cgroup text → pod / container / service / session / host, for cgroup v1
  and v2, the cgroupfs and systemd drivers, and paths seen from a private cgroup namespace (`/../`).
- `process_info` / `parse_process_info`: pid, start time (field 22 of /proc/PID/stat, parsed by
  `probes.runtime.procstat`; pids are reused, so results are keyed by (pid, start_time)), command and cgroup
  owner; `described`: the same for the processes an fd scan found, from the texts its scanner read.
- `device_rdevs`: the device numbers of the nodes a glob names under a dev dir.
- `scan_open_files` (from `probes.runtime.fdscan`, re-exported here with the scan's results and errors, and
  `list_pids` and `scan_in_process` from `probes.runtime.fdtable`): one pass over every /proc/*/fd that a hung
  filesystem cannot block.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from probes.runtime.fdscan import (
    SCAN_KEY,
    FdMatch,
    ScanError,
    ScanResult,
    ScanTimeout,
    UnreadableProcess,
    lingering_scanners,
    scan_open_files,
)
from probes.runtime.fdtable import STATX_AVAILABLE, ProcessTexts, list_pids, scan_in_process
from probes.runtime.procstat import parse_stat

__all__ = [
    "SCAN_KEY",
    "STATX_AVAILABLE",
    "CgroupOwner",
    "FdMatch",
    "ProcessInfo",
    "ProcessTexts",
    "ScanError",
    "ScanResult",
    "ScanTimeout",
    "UnreadableProcess",
    "cgroup_path",
    "classify_cgroup",
    "classify_cgroup_path",
    "described",
    "device_rdevs",
    "format_rdev",
    "lingering_scanners",
    "list_pids",
    "parse_process_info",
    "process_info",
    "scan_in_process",
    "scan_open_files",
]

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
# A bare container id (cgroupfs driver): /docker/<64hex>, /kubepods/burstable/pod<uid>/<64hex>, and podman's
# /libpod_parent/libpod-<64hex> (its pods' containers: /libpod_parent/<pod id>/libpod-<64hex>).
_BARE_ID = re.compile(r"^(?:(crio|docker|cri-containerd|libpod)-)?([0-9a-f]{64})$")
# Parent directory → runtime for bare ids of the cgroupfs driver.
_PARENT_RUNTIME = {"docker": "docker", "crio": "cri-o", "libpod_parent": "podman", "containerd": "containerd"}
# A systemd user manager (`user@1000.service`): a container scope below it is a rootless container of that uid.
_USER_MANAGER = re.compile(r"^user@(\d+)\.service$")
# The command-line tool that manages each runtime's containers outside Kubernetes.
_RUNTIME_CLI = {"docker": "docker", "podman": "podman", "cri-o": "crictl", "containerd": "nerdctl"}


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
    # A rootless container (podman under a user's systemd manager): only that uid's podman sees it.
    rootless_uid: int | None = None

    @property
    def in_pod(self) -> bool:
        return self.kind == "pod"

    def container_command(self, verb: str, *args: str) -> str | None:
        """`podman stop 4c3b…`, `docker exec 4c3b… rm /x`: the runtime's CLI run on this container (as its user
        when it is rootless); None when this is no container outside Kubernetes."""
        if self.kind != "container" or not self.container_id:
            return None
        tool = _RUNTIME_CLI.get(self.runtime or "", "the runtime's CLI:")
        if self.rootless_uid is not None:
            uid = self.rootless_uid
            tool = f"sudo -u '#{uid}' XDG_RUNTIME_DIR=/run/user/{uid} {tool}"
        return " ".join([tool, verb, self.container_id[:12], *args])

    def describe(self) -> str:
        """A short phrase for messages: `pod 1f2e…`, `docker container 4c3b…`, `system.slice/x.service`."""
        if self.kind == "pod":
            text = f"pod {self.pod_uid}"
            return text + (f" container {self.container_id[:12]}" if self.container_id else "")
        if self.kind == "container":
            rootless = f" (rootless, uid {self.rootless_uid})" if self.rootless_uid is not None else ""
            container = f"{self.runtime or 'runtime'} container {(self.container_id or '')[:12]}"
            return f"{container}{rootless} outside Kubernetes"
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
                rootless_uid=_user_manager_uid(segments[:index]),
            )
        bare = _BARE_ID.match(segment)
        if bare:
            parents = [s for s in segments[:index] if s in _PARENT_RUNTIME]
            runtime = _SCOPE_RUNTIME.get(bare.group(1) or "") or (_PARENT_RUNTIME[parents[-1]] if parents else None)
            return CgroupOwner("container", container_id=bare.group(2), runtime=runtime, path=path)
    for segment in reversed(segments):
        if segment == "init.scope":
            return CgroupOwner("host", unit=segment, path=path)
        if segment.startswith("session-") and segment.endswith(".scope"):
            return CgroupOwner("session", unit=segment, path=path)
        if segment.endswith((".service", ".scope")):
            return CgroupOwner("service", unit=segment, path=path)
    return CgroupOwner("host", path=path)


def _user_manager_uid(segments: list[str]) -> int | None:
    """The uid of the systemd user manager (`user@1000.service`) among a container's parent segments."""
    for segment in reversed(segments):
        manager = _USER_MANAGER.match(segment)
        if manager:
            return int(manager.group(1))
    return None


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


def process_info(proc: Path, pid: int, with_command: bool = True) -> ProcessInfo | None:
    """pid, start time, command and cgroup owner of one process; None when it has vanished.

    The command comes from /proc/PID/cmdline, whose read waits while the process's mmap lock is held: holders
    come from the fd scan's texts (`described`) instead, and callers that need no command line pass
    `with_command=False` (the command is then `[comm]`)."""
    base = Path(proc) / str(pid)
    try:
        stat_text = (base / "stat").read_text(errors="replace")
        cgroup_text = (base / "cgroup").read_text(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    status_text = ""
    with contextlib.suppress(OSError):
        status_text = (base / "status").read_text(errors="replace")
    cmdline: bytes | None = None
    if with_command:
        with contextlib.suppress(OSError):
            cmdline = (base / "cmdline").read_bytes()[:4096]
    info = parse_process_info(pid, (stat_text, cgroup_text, status_text, cmdline))
    # A pid reused between the reads would mix two processes: re-check the start time.
    try:
        if info is None or parse_stat((base / "stat").read_text(errors="replace")).start_time != info.start_time:
            return None
    except (OSError, ValueError):
        return None
    return info


def parse_process_info(pid: int, texts: ProcessTexts) -> ProcessInfo | None:
    """ProcessInfo from /proc/PID/{stat,cgroup,status} text and cmdline bytes; None for a truncated stat (a
    process that is exiting). Without a cmdline the command is `[comm]`."""
    stat_text, cgroup_text, status_text, cmdline = texts
    try:
        stat_fields = parse_stat(stat_text)
    except ValueError:
        return None
    comm, start_time = stat_fields.comm, stat_fields.start_time
    # One line for messages: NULs between arguments, and newlines inside them, become single spaces.
    command = " ".join((cmdline or b"").decode("utf-8", "replace").replace("\0", " ").split())[:256]
    uid: int | None = None
    with contextlib.suppress(ValueError, IndexError):
        for line in status_text.splitlines():
            if line.startswith("Uid:"):
                uid = int(line.split()[1])
                break
    return ProcessInfo(pid, start_time, command or f"[{comm}]", classify_cgroup(cgroup_text), comm, uid)


def described(result: ScanResult) -> dict[int, ProcessInfo]:
    """The processes an fd scan found, from the texts its scanners read (never re-read here)."""
    out: dict[int, ProcessInfo] = {}
    for pid, texts in result.texts.items():
        info = parse_process_info(pid, texts)
        if info is not None:
            out[pid] = info
    return out


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
