"""Holders: who holds a device node (or a port), in which pod, and how to stop it.

Shared by npu.holders, gpu.holders and the port checks, so every family names a holder the same way:

- A sighting is one process seen holding one thing: an fd found by the /proc scan (`probes.runtime.fdscan`:
  a device node by its device number, a socket by its inode), a device node it has mapped (source "mmap",
  `probes.runtime.mapscan`), or a PID a tool lists (npu-smi, NVML).
  `collect_holders` merges the sightings into one `Holder` per process, keyed by (pid, start time) so a
  reused PID is never taken for the process a tool saw.
- Each holder is classified by its /proc/PID/cgroup (pod UID and container, a runtime's container outside
  Kubernetes, podman's `/libpod_parent/libpod-<id>` included, a systemd service, a login session, the host).
  A pod's namespace/name comes, best effort, from the container runtime's OCI bundle under the host root
  (`PodNames`), else it is named by UID.
- Holders are described by PID, executable name and owner; the full command line only when the operator
  allows it (`redact_cmdlines: false`): another tenant's argv can hold secrets.
- `stop_hint` gives the command that stops a holder, runtime-aware and naming the real PIDs.
- `matches_command` is the one allow/ignore matcher: fnmatch on the executable's base name or the task name.
"""

from __future__ import annotations

import fnmatch
import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probes.runtime.cpulimit import limit_note
from probes.runtime.fdscan import shortfall
from probes.runtime.procfs import (
    CgroupOwner,
    ProcessInfo,
    ScanError,
    ScanResult,
    UnreadableProcess,
    described,
    device_rdevs,
    process_info,
    scan_open_files,
)

if TYPE_CHECKING:
    from probes.runtime.host import Host

# --- pods by name ----------------------------------------------------------------------------------

# OCI bundles of the container runtimes (relative to the host root), and the annotations that name the pod.
_BUNDLES: Mapping[str, tuple[str, tuple[str, str, str]]] = {
    "containerd": (
        "run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json",
        ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.sandbox-name", "io.kubernetes.cri.container-name"),
    ),
    "cri-o": (
        "run/containers/storage/overlay-containers/{id}/userdata/config.json",
        ("io.kubernetes.pod.namespace", "io.kubernetes.pod.name", "io.kubernetes.container.name"),
    ),
}
_MAX_BUNDLE_BYTES = 4 << 20
_MAX_CACHED_PODS = 4096


@dataclass(frozen=True)
class PodRef:
    """A pod as messages name it: namespace/name when the runtime's bundle says, else its UID."""

    uid: str
    namespace: str = ""
    name: str = ""
    container: str = ""  # the container's name in the pod, when known

    def describe(self) -> str:
        return f"pod {self.namespace}/{self.name}" if self.namespace and self.name else f"pod {self.uid}"

    def to_dict(self) -> dict[str, str]:
        out = {"uid": self.uid}
        if self.name:
            out.update(namespace=self.namespace, name=self.name)
        if self.container:
            out["container"] = self.container
        return out


class PodNames:
    """Pod namespace/name by container id, read from the runtime's OCI bundle (config.json annotations).

    The bundles live on the host's /run (tmpfs). A container keeps its pod for life, so answers are cached.
    """

    def __init__(self, root: Path | str = "/") -> None:
        self.root = Path(root)
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[str, str, str]] = {}

    def pod(self, owner: CgroupOwner) -> PodRef | None:
        """The pod of a process in a pod's cgroup; None for processes outside pods."""
        if owner.kind != "pod" or not owner.pod_uid:
            return None
        names = self._names(owner.container_id, owner.runtime) if owner.container_id else None
        if names is None:
            return PodRef(owner.pod_uid)
        namespace, name, container = names
        return PodRef(owner.pod_uid, namespace, name, container)

    def _names(self, container_id: str, runtime: str | None) -> tuple[str, str, str] | None:
        with self._lock:
            cached = self._cache.get(container_id)
        if cached is not None:
            return cached
        runtimes = [runtime] if runtime in _BUNDLES else list(_BUNDLES)
        for candidate in runtimes:
            path_template, keys = _BUNDLES[candidate or ""]
            annotations = self._annotations(self.root / path_template.format(id=container_id))
            namespace, name, container = (str(annotations.get(key, "")) for key in keys)
            if namespace and name:
                with self._lock:
                    if len(self._cache) >= _MAX_CACHED_PODS:
                        self._cache.clear()
                    self._cache[container_id] = (namespace, name, container)
                return namespace, name, container
        return None

    @staticmethod
    def _annotations(path: Path) -> Mapping[str, Any]:
        # Only the annotations are kept: the rest of the spec (env, mounts) is the tenant's business.
        try:
            with open(path, "rb") as handle:
                document = json.loads(handle.read(_MAX_BUNDLE_BYTES))
        except (OSError, ValueError):
            return {}
        annotations = document.get("annotations") if isinstance(document, dict) else None
        return annotations if isinstance(annotations, dict) else {}


# --- holders ---------------------------------------------------------------------------------------


def executable_name(info: ProcessInfo) -> str:
    """The base name of the executable: argv[0]'s, or the task name for kernel threads and empty argv."""
    if info.command and not info.command.startswith("["):
        return os.path.basename(info.command.split(" ", 1)[0]) or info.comm
    return info.comm


def matches_command(info: ProcessInfo, patterns: Iterable[str]) -> bool:
    """Whether the executable's base name or the task name matches any fnmatch pattern (allow/ignore lists)."""
    names = {name for name in (executable_name(info), info.comm) if name}
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns for name in names)


@dataclass
class Holder:
    """One process (keyed by pid and start time) holding some of the things looked for."""

    info: ProcessInfo
    pod: PodRef | None = None
    things: set[str] = field(default_factory=set)  # device node names (davinci0, nvidia1) or ports
    sources: set[str] = field(default_factory=set)  # "fd", "socket", or the tool that listed it (npu-smi, nvml)

    @property
    def pid(self) -> int:
        return self.info.pid

    @property
    def key(self) -> tuple[int, int]:
        return self.info.key

    @property
    def owner(self) -> CgroupOwner:
        return self.info.cgroup

    @property
    def in_pod(self) -> bool:
        return self.info.cgroup.in_pod

    @property
    def executable(self) -> str:
        return executable_name(self.info)

    def who(self, redact: bool) -> str:
        """`PID 42 (python)`, or with the whole command line when command lines are not redacted."""
        shown = self.executable if redact else (self.info.command[:160] or self.executable)
        return f"PID {self.pid} ({shown or '?'})"

    def where(self) -> str:
        """`pod ns/name`, `docker container 4c3b… outside Kubernetes`, `service x.service`, `host cgroup /`."""
        if self.pod is not None:
            container = f" container {self.pod.container}" if self.pod.container else ""
            return self.pod.describe() + container
        return self.owner.describe()

    def phrase(self, redact: bool) -> str:
        return f"{self.who(redact)} in {self.where()}"

    def to_dict(self, redact: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pid": self.pid,
            "start_time": self.info.start_time,
            "executable": self.executable,
            "owner": self.where(),
            "kind": self.owner.kind,
            "cgroup_path": self.owner.path,
            "things": sorted(self.things),
            "sources": sorted(self.sources),
        }
        if self.pod is not None:
            out["pod"] = self.pod.to_dict()
        if self.owner.container_id:
            out["container_id"] = self.owner.container_id
        if not redact:
            out["command"] = self.info.command[:256]
        return out


@dataclass(frozen=True)
class Sighting:
    """One process seen holding one thing (a device node name, a port)."""

    pid: int
    thing: str
    source: str
    # Known for fd-scan sightings: the holder must be that very process, not a later one with its PID.
    start_time: int | None = None


def collect_holders(
    proc: Path,
    sightings: Iterable[Sighting],
    pod_names: PodNames | None = None,
    exclude: Iterable[int] = (),
    known: Mapping[int, ProcessInfo] | None = None,
    read_commands: bool = False,
) -> tuple[list[Holder], int]:
    """One Holder per live process among the sightings; (holders by pid, sightings whose process is gone).

    `known`: the processes the fd scan's scanners described (`described(scan)`); only the others (PIDs a tool
    listed that the scan did not see) are read here, and their cmdline (a read that waits while the process's
    mmap lock is held) only with `read_commands`, when the operator asked for command lines."""
    excluded = set(exclude)
    infos: dict[int, ProcessInfo | None] = dict(known or {})
    holders: dict[tuple[int, int], Holder] = {}
    vanished = 0
    for sighting in sightings:
        if sighting.pid in excluded:
            continue
        if sighting.pid not in infos:
            infos[sighting.pid] = process_info(proc, sighting.pid, with_command=read_commands)
        info = infos[sighting.pid]
        if info is None or (sighting.start_time is not None and info.start_time != sighting.start_time):
            vanished += 1  # exited (or the PID was reused) since it was seen; a tool's PID not visible here
            continue
        holder = holders.get(info.key)
        if holder is None:
            holder = holders[info.key] = Holder(info, pod_names.pod(info.cgroup) if pod_names else None)
        holder.things.add(sighting.thing)
        holder.sources.add(sighting.source)
    return sorted(holders.values(), key=lambda h: h.key), vanished


# --- device holder scan ----------------------------------------------------------------------------


@dataclass
class HolderScan:
    """The holders of a set of device nodes, and how complete the view of them is."""

    holders: list[Holder]
    vanished: int = 0
    permission_denied: int = 0
    processes: int = 0
    duration: float = 0.0
    error: str = ""  # the fd scan could not run at all: only the tools' lists were used
    unreadable: tuple[UnreadableProcess, ...] = ()
    unscanned: int = 0
    maps_truncated: int = 0  # processes with more mappings than the scan reads
    maps_denied: int = 0  # processes whose mappings could not be matched (map_files needs CAP_SYS_ADMIN)

    @property
    def complete(self) -> bool:
        return not self.error and not self.unreadable and not self.unscanned

    def shortfall(self) -> str:
        """What was not seen, for messages; "" when the scan is complete."""
        if self.error:
            return self.error
        missed = shortfall(self.unreadable, self.unscanned)
        note = limit_note() if self.unscanned else ""  # a deadline missed for want of CPU names the limit
        return f"{missed} {note}" if note else missed

    def observed(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "vanished": self.vanished,
            "permission_denied": self.permission_denied,
            "processes_scanned": self.processes,
            "scan_seconds": round(self.duration, 3),
        }
        if self.error:
            out["scan_error"] = self.error
        if self.unreadable:
            out["unreadable"] = [{"pid": p.pid, "comm": p.comm, "why": p.why} for p in self.unreadable[:10]]
        if self.unscanned:
            out["unscanned"] = self.unscanned
        if self.maps_truncated or self.maps_denied:
            out["mappings_unread"] = {"truncated": self.maps_truncated, "denied": self.maps_denied}
        return out


def device_nodes(dev_dir: Path, patterns: Sequence[str]) -> dict[int, str]:
    """Device number → node name (`davinci0`) of the character devices the globs name under dev_dir."""
    return {rdev: Path(path).name for rdev, path in device_rdevs(dev_dir, patterns).items()}


@dataclass(frozen=True)
class DeviceScan:
    """The fd scan for a set of device nodes (rdev → name), or why it could not be done."""

    nodes: Mapping[int, str]
    result: ScanResult | None
    error: str = ""


def scan_devices(host: Host, nodes: Mapping[int, str], timeout: float) -> DeviceScan:
    """One /proc/*/fd and /proc/*/maps scan for the device nodes (an fd open on one, or a mapping of one whose
    fd was closed); partial results are kept (the scan says what it missed)."""
    try:
        scan = scan_open_files(host, rdevs=nodes.keys(), timeout=timeout, partial=True, mappings=True)
        return DeviceScan(nodes, scan)
    except ScanError as exc:
        return DeviceScan(nodes, None, str(exc))


def device_holders(
    host: Host,
    scan: DeviceScan | None,
    *,
    listed: Mapping[int, set[str]] | None = None,
    listed_source: str = "",
    pod_names: PodNames | None = None,
    exclude: Iterable[int] = (),
    read_commands: bool = False,
) -> HolderScan:
    """The holders a device scan found, merged with the PIDs a tool lists (pid → node names). A scan that could
    not run leaves the tool's list; one that is partial says what it missed."""
    result = scan.result if scan else None
    sightings: list[Sighting] = []
    for match in result.matches if result else ():
        name = scan.nodes.get(match.key[1]) if scan and match.key[0] == "rdev" else None
        thing = name or os.path.basename(match.target)
        sightings.append(Sighting(match.pid, thing, match.via, match.start_time))  # via: "fd" or "mmap"
    for pid, things in (listed or {}).items():
        sightings.extend(Sighting(pid, thing, listed_source) for thing in sorted(things))
    known = described(result) if result else {}
    holders, vanished = collect_holders(host.proc, sightings, pod_names, exclude, known, read_commands)
    return HolderScan(
        holders,
        vanished=vanished + (result.vanished if result else 0),
        permission_denied=result.permission_denied if result else 0,
        processes=result.processes if result else 0,
        duration=result.duration if result else 0.0,
        error=scan.error if scan else "",
        unreadable=result.unreadable if result else (),
        unscanned=result.unscanned if result else 0,
        maps_truncated=result.maps_truncated if result else 0,
        maps_denied=result.maps_denied if result else 0,
    )


# --- what to say about holders ---------------------------------------------------------------------


def stop_command(holder: Holder) -> str:
    """The command that stops one holder, for the kind of thing it runs in."""
    owner = holder.owner
    if owner.kind == "pod":
        if holder.pod is not None and holder.pod.name:
            return f"kubectl delete pod -n {holder.pod.namespace} {holder.pod.name}"
        return f"crictl stopp $(crictl pods -q --label io.kubernetes.pod.uid={owner.pod_uid})"
    container = owner.container_command("stop")  # podman stop 4c3b…, as its user when rootless
    if container is not None:
        return container
    if owner.kind == "service" and owner.unit:
        return f"systemctl stop {owner.unit}"
    return f"kill {holder.pid}"


def stop_hint(holders: Sequence[Holder]) -> str:
    """One command per owner, the real PIDs of bare processes together: `kill 12 34; docker stop 4c3b…`."""
    commands: list[str] = []
    pids: list[str] = []
    for holder in holders:
        command = stop_command(holder)
        if command.startswith("kill "):
            pids.append(str(holder.pid))
        elif command not in commands:
            commands.append(command)
    if pids:
        commands.insert(0, "kill " + " ".join(dict.fromkeys(pids)))
    return "; ".join(commands)


def describe_holders(holders: Sequence[Holder], redact: bool, limit: int = 3) -> str:
    """`PID 12 (python) in pod a/b, PID 34 (sleep) in host cgroup / and 2 more`."""
    shown = ", ".join(holder.phrase(redact) for holder in holders[:limit])
    return shown + (f" and {len(holders) - limit} more" if len(holders) > limit else "")


def pods_of(holders: Iterable[Holder]) -> dict[str, list[Holder]]:
    """In-pod holders grouped by pod UID, in first-seen order."""
    out: dict[str, list[Holder]] = {}
    for holder in holders:
        if holder.in_pod and holder.owner.pod_uid:
            out.setdefault(holder.owner.pod_uid, []).append(holder)
    return out


def list_processes(holders: Sequence[Holder], redact: bool, limit: int = 3) -> str:
    """`PID 12 (python), PID 34 (python) and 2 more`."""
    shown = ", ".join(holder.who(redact) for holder in holders[:limit])
    return shown + (f" and {len(holders) - limit} more" if len(holders) > limit else "")


def describe_pods(groups: Mapping[str, Sequence[Holder]], redact: bool) -> str:
    """`pod a/b: PID 12 (python); pod 1f2e…: PID 34 (python), PID 35 (python)`."""
    return "; ".join(f"{members[0].where()}: {list_processes(members, redact)}" for members in groups.values())
