"""host.memory and host.shm: host memory for pinned buffers and hugepages, and the size of /dev/shm.

host.memory reports MemAvailable (subject "") and, whenever the kernel shows hugepages, the free hugepages
of the default size (subject "hugepages"), so `/ready?min_host_mem_mib=` and `?min_hugepages=` are answered
from cached results; the hugepages finding fails only below host.memory.min_free_hugepages.
"""

from __future__ import annotations

import errno
from pathlib import Path

from probes.base import (
    OBSERVED_HOST_MEM_AVAILABLE_MIB,
    OBSERVED_HUGEPAGES_FREE,
    Check,
    Finding,
    Probe,
    ProbeContext,
    ProbeOutput,
    ProbeParseError,
    Reason,
    Sample,
    Status,
    register,
)
from probes.host.config import HostConfig, HostMemoryConfig, HostShmConfig
from probes.runtime.children import ChildResult, statvfs_in_child
from probes.runtime.host import Host

MIB = 1024 * 1024

MEMORY = Check("host.memory")
SHM = Check("host.shm")

HOST_MEMORY_LOW = Reason(
    "HostMemoryLow",
    Status.FAIL,
    "MemAvailable below host.memory.min_available_mib / min_available_percent, or free hugepages below "
    "host.memory.min_free_hugepages: pinned host buffers fail to allocate (error 207001)",
    "find the processes using memory (ps aux --sort=-rss | head) and stop leftovers of earlier jobs; when shared "
    "memory holds it (Shmem: tmpfs and /dev/shm files, which no process shows) the finding says so and how to "
    "find the files (df -h -t tmpfs, du -ah /dev/shm | sort -h | tail)",
)
HUGEPAGES_HINT = "hugepages are held by a previous job or are not reserved: check /proc/meminfo and vm.nr_hugepages"
# Shared memory (Shmem: tmpfs files, /dev/shm segments, shared anonymous mappings) this large, and this share of
# the memory in use, is named in HostMemoryLow: no process's RSS shows a file left on a tmpfs.
SHMEM_NOTABLE_BYTES = 256 * MIB
SHMEM_NOTABLE_SHARE = 0.10
MEMINFO_UNREADABLE = Reason(
    "MeminfoUnreadable",
    Status.UNKNOWN,
    "meminfo under host.proc could not be read or has no MemTotal line",
    "check that host.proc points at the host's /proc (in the DaemonSet, hostPID or a /proc mount)",
)
SHM_TOO_SMALL = Reason(
    "ShmTooSmall",
    Status.FAIL,
    "the shared-memory filesystem is missing, smaller than host.shm.min_size_mib or has less than "
    "host.shm.min_free_mib free",
    "data loaders and collective communication use shared memory: remount it larger "
    "(mount -o remount,size=...) or give the pod an emptyDir with medium: Memory",
)
SHM_UNREADABLE = Reason(
    "ShmUnreadable",
    Status.UNKNOWN,
    "statvfs of host.shm.path failed or did not answer within the deadline",
    "check that host.shm.path is a tmpfs the agent can reach (host.dev / host.root point at the host's)",
)


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo → {field: value}; kB values are returned in bytes, page counts as they are."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if not sep:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            number = int(parts[0])
        except ValueError:
            continue
        values[name.strip()] = number * 1024 if len(parts) > 1 and parts[1] == "kB" else number
    if "MemTotal" not in values:
        raise ProbeParseError("no MemTotal line in /proc/meminfo")
    return values


def memory_finding(meminfo: dict[str, int], settings: HostMemoryConfig, shm: tuple[str, int] | None = None) -> Finding:
    """MemAvailable against the thresholds. `shm`: the shared-memory filesystem's path and bytes used, to name
    it when shared memory holds the memory."""
    total = meminfo["MemTotal"]
    available = meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
    percent = 100.0 * available / total if total else 0.0
    shmem = meminfo.get("Shmem", 0)
    observed = {
        OBSERVED_HOST_MEM_AVAILABLE_MIB: round(available / MIB),
        "total_mib": round(total / MIB),
        "available_percent": round(percent, 1),
        "shmem_mib": round(shmem / MIB),
    }
    if available < settings.min_available_mib * MIB or percent < settings.min_available_percent:
        message = (
            f"only {available / MIB:.0f} MiB of {total / MIB:.0f} MiB host memory available ({percent:.1f}%), "
            f"below {settings.min_available_mib:g} MiB / {settings.min_available_percent:g}%"
        )
        if not shmem_holds_memory(shmem, total - available):
            return MEMORY.report(HOST_MEMORY_LOW, "", message, observed)
        message += (
            f"; {shmem / MIB:.0f} MiB of it is shared memory (Shmem: tmpfs and /dev/shm files), which ps does not show"
        )
        return MEMORY.report(HOST_MEMORY_LOW, "", message, observed, hint=shmem_hint(shmem, shm))
    return MEMORY.ok("", f"{available / MIB:.0f} MiB available ({percent:.1f}%)", observed)


def shmem_holds_memory(shmem: int, used: int) -> bool:
    return shmem >= SHMEM_NOTABLE_BYTES and shmem >= SHMEM_NOTABLE_SHARE * used


def shmem_hint(shmem: int, shm: tuple[str, int] | None) -> str:
    """Where shared memory hides: files on tmpfs mounts (leftovers of finished jobs), which no process's RSS
    counts, so `ps --sort=-rss` shows nothing."""
    path = shm[0] if shm else "/dev/shm"
    held = f" ({path} alone holds {shm[1] / MIB:.0f} MiB)" if shm and shm[1] >= SHMEM_NOTABLE_BYTES else ""
    return (
        f"shared memory holds {shmem / MIB:.0f} MiB{held}: files on tmpfs mounts and in {path}, left by finished "
        f"jobs, use memory that no process shows. Find them: `df -h -t tmpfs` (which tmpfs is full), then the "
        f"largest files: `du -ah {path} | sort -h | tail` (and under each full tmpfs); remove those of finished "
        "jobs. Processes: ps aux --sort=-rss | head"
    )


def hugepages_finding(meminfo: dict[str, int], min_free: int) -> Finding | None:
    """Free hugepages of the default size, whenever the kernel shows hugepages (None when it does not)."""
    if "HugePages_Total" not in meminfo:
        return None
    free = meminfo.get("HugePages_Free", 0)
    observed = {OBSERVED_HUGEPAGES_FREE: free, "hugepages_total": meminfo["HugePages_Total"]}
    if min_free > 0 and free < min_free:
        message = f"{free} free hugepages, below {min_free}"
        return MEMORY.report(HOST_MEMORY_LOW, "hugepages", message, observed, hint=HUGEPAGES_HINT)
    return MEMORY.ok("hugepages", f"{free} free hugepages of {meminfo['HugePages_Total']}", observed)


def memory_findings(
    meminfo: dict[str, int], settings: HostMemoryConfig, shm: tuple[str, int] | None = None
) -> list[Finding]:
    hugepages = hugepages_finding(meminfo, settings.min_free_hugepages)
    return [memory_finding(meminfo, settings, shm), *([hugepages] if hugepages is not None else [])]


def memory_samples(meminfo: dict[str, int]) -> list[Sample]:
    out = [
        Sample("nodehealth_host_memory_available_bytes", "Host MemAvailable.", meminfo.get("MemAvailable", 0)),
        Sample("nodehealth_host_memory_total_bytes", "Host MemTotal.", meminfo["MemTotal"]),
    ]
    if "HugePages_Total" in meminfo:
        free = meminfo.get("HugePages_Free", 0)
        out.append(Sample("nodehealth_host_hugepages_free", "Free hugepages of the default size.", free))
        out.append(
            Sample("nodehealth_host_hugepages", "Hugepages of the default size (reserved).", meminfo["HugePages_Total"])
        )
    return out


def shm_finding(path: str, size_bytes: int, free_bytes: int, settings: HostShmConfig) -> Finding:
    observed = {"size_mib": round(size_bytes / MIB), "free_mib": round(free_bytes / MIB)}
    if size_bytes < settings.min_size_mib * MIB:
        message = f"{path} is {size_bytes / MIB:.0f} MiB, below {settings.min_size_mib:g} MiB"
        return SHM.report(SHM_TOO_SMALL, path, message, observed)
    if free_bytes < settings.min_free_mib * MIB:
        message = f"only {free_bytes / MIB:.0f} MiB free in {path}, below {settings.min_free_mib:g} MiB"
        hint = f"stale segments fill it: list them (ls -la {path}) and remove those of finished jobs"
        return SHM.report(SHM_TOO_SMALL, path, message, observed, hint=hint)
    return SHM.ok(path, f"{path}: {size_bytes / MIB:.0f} MiB, {free_bytes / MIB:.0f} MiB free", observed)


def shm_local_path(host: Host, path: str) -> Path:
    """host.shm.path as the agent sees it: under host.dev for /dev/..., else under host.root."""
    if path.startswith("/dev/"):
        return host.dev_path(path[len("/dev/") :])
    return host.root_path(path)


def shm_output(ctx: ProbeContext, settings: HostShmConfig) -> tuple[ProbeOutput, tuple[str, int] | None]:
    """host.shm's finding and samples, and (path, bytes used) when the statvfs answered."""
    path = settings.path
    # A child with a deadline: host.shm.path may be configured onto a filesystem that can hang.
    result: ChildResult = ctx.host.child_call(
        f"host.shm:{path}", statvfs_in_child, str(shm_local_path(ctx.host, path)), timeout=ctx.remaining()
    )
    if result.state == "error" and result.errno in (errno.ENOENT, errno.ENOTDIR):
        return [SHM.report(SHM_TOO_SMALL, path, f"{path} does not exist", hint="mount a tmpfs at /dev/shm")], None
    if not result.ok:
        why = result.error if result.state == "error" else f"no answer ({result.state}: {result.error})"
        return [SHM.report(SHM_UNREADABLE, path, f"statvfs {path}: {why}", {"state": result.state})], None
    st = result.value
    size, free = st["blocks"] * st["frsize"], st["bavail"] * st["frsize"]
    used = (st["blocks"] - st["bfree"]) * st["frsize"]
    labels = {"path": path}
    output: ProbeOutput = [
        shm_finding(path, size, free, settings),
        Sample("nodehealth_host_shm_size_bytes", "Size of the shared-memory filesystem.", size, labels),
        Sample("nodehealth_host_shm_free_bytes", "Free bytes in the shared-memory filesystem.", free, labels),
    ]
    return output, (path, used)


@register
class HostProbe(Probe):
    name = "host"
    checks = ("host.memory", "host.shm")
    reasons = (HOST_MEMORY_LOW, MEMINFO_UNREADABLE, SHM_TOO_SMALL, SHM_UNREADABLE)
    default_interval = 30.0
    default_timeout = 5.0
    needs = "/proc/meminfo; /dev/shm"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(HostConfig)
        meminfo_path = ctx.host.proc_path("meminfo")
        shm, shm_used = shm_output(ctx, settings.shm)
        out: ProbeOutput = []
        try:
            meminfo = parse_meminfo(meminfo_path.read_text())
        except (OSError, ProbeParseError) as exc:
            why = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
            out.append(MEMORY.report(MEMINFO_UNREADABLE, "", f"cannot read {meminfo_path}: {why}"))
        else:
            out.extend(memory_findings(meminfo, settings.memory, shm_used))
            out.extend(memory_samples(meminfo))
        return out + shm
