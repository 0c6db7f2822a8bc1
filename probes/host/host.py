"""host.memory and host.shm: host memory for pinned buffers and hugepages, and the size of /dev/shm."""

from __future__ import annotations

import os

from probes.base import Finding, Probe, ProbeContext, ProbeOutput, ProbeParseError, Sample, Status, register

MIB = 1024 * 1024


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


def memory_findings(
    meminfo: dict[str, int], min_available_mib: float, min_available_percent: float, min_free_hugepages: int
) -> list[Finding]:
    total = meminfo["MemTotal"]
    available = meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
    percent = 100.0 * available / total if total else 0.0
    observed = {
        "available_mib": round(available / MIB),
        "total_mib": round(total / MIB),
        "available_percent": round(percent, 1),
    }
    findings = []
    if available < min_available_mib * MIB or percent < min_available_percent:
        findings.append(
            Finding(
                "host.memory",
                "",
                Status.FAIL,
                "HostMemoryLow",
                f"only {available / MIB:.0f} MiB of {total / MIB:.0f} MiB host memory available ({percent:.1f}%), "
                f"below {min_available_mib:g} MiB / {min_available_percent:g}%",
                "pinned host buffers will fail to allocate (error 207001): find the processes using memory "
                "(ps aux --sort=-rss | head) and stop leftovers of earlier jobs",
                observed,
            )
        )
    else:
        findings.append(
            Finding(
                "host.memory",
                "",
                Status.OK,
                "OK",
                f"{available / MIB:.0f} MiB available ({percent:.1f}%)",
                observed=observed,
            )
        )
    if min_free_hugepages > 0:
        free = meminfo.get("HugePages_Free", 0)
        hp_observed = {"hugepages_free": free, "hugepages_total": meminfo.get("HugePages_Total", 0)}
        if free < min_free_hugepages:
            findings.append(
                Finding(
                    "host.memory",
                    "hugepages",
                    Status.FAIL,
                    "HostMemoryLow",
                    f"{free} free hugepages, below {min_free_hugepages}",
                    "hugepages are held by a previous job or are not reserved: check /proc/meminfo and vm.nr_hugepages",
                    hp_observed,
                )
            )
        else:
            findings.append(
                Finding("host.memory", "hugepages", Status.OK, "OK", f"{free} free hugepages", observed=hp_observed)
            )
    return findings


def shm_finding(path: str, size_bytes: int, free_bytes: int, min_size_mib: float, min_free_mib: float) -> Finding:
    observed = {"size_mib": round(size_bytes / MIB), "free_mib": round(free_bytes / MIB)}
    if size_bytes < min_size_mib * MIB:
        return Finding(
            "host.shm",
            path,
            Status.FAIL,
            "ShmTooSmall",
            f"{path} is {size_bytes / MIB:.0f} MiB, below {min_size_mib:g} MiB",
            "data loaders and collective communication use shared memory: remount it larger "
            "(mount -o remount,size=...) or give the pod an emptyDir with medium: Memory",
            observed,
        )
    if free_bytes < min_free_mib * MIB:
        return Finding(
            "host.shm",
            path,
            Status.FAIL,
            "ShmTooSmall",
            f"only {free_bytes / MIB:.0f} MiB free in {path}, below {min_free_mib:g} MiB",
            f"stale segments fill it: list them (ls -la {path}) and remove those of finished jobs",
            observed,
        )
    return Finding(
        "host.shm",
        path,
        Status.OK,
        "OK",
        f"{path}: {size_bytes / MIB:.0f} MiB, {free_bytes / MIB:.0f} MiB free",
        observed=observed,
    )


@register
class HostProbe(Probe):
    name = "host"
    checks = ("host.memory", "host.shm")
    default_interval = 30.0
    default_timeout = 5.0
    needs = "/proc/meminfo; /dev/shm"

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.config.host
        meminfo = parse_meminfo(ctx.host.proc_path("meminfo").read_text())
        out: ProbeOutput = list(
            memory_findings(
                meminfo,
                settings.memory.min_available_mib,
                settings.memory.min_available_percent,
                settings.memory.min_free_hugepages,
            )
        )
        out.append(
            Sample("nodehealth_host_memory_available_bytes", "Host MemAvailable.", meminfo.get("MemAvailable", 0))
        )
        out.append(Sample("nodehealth_host_memory_total_bytes", "Host MemTotal.", meminfo["MemTotal"]))
        if "HugePages_Total" in meminfo:
            out.append(
                Sample(
                    "nodehealth_host_hugepages_free",
                    "Free hugepages of the default size.",
                    meminfo.get("HugePages_Free", 0),
                )
            )
            out.append(
                Sample(
                    "nodehealth_host_hugepages", "Hugepages of the default size (reserved).", meminfo["HugePages_Total"]
                )
            )
        shm_path = settings.shm.path
        local = (
            ctx.host.root_path(shm_path)
            if shm_path.startswith("/dev/") is False
            else (ctx.host.dev_path(shm_path[len("/dev/") :]))
        )
        try:
            st = os.statvfs(local)  # tmpfs: memory-backed, cannot hang
        except FileNotFoundError:
            out.append(
                Finding(
                    "host.shm",
                    shm_path,
                    Status.FAIL,
                    "ShmTooSmall",
                    f"{shm_path} does not exist",
                    "mount a tmpfs at /dev/shm",
                    {},
                )
            )
            return out
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        out.append(shm_finding(shm_path, size, free, settings.shm.min_size_mib, settings.shm.min_free_mib))
        out.append(
            Sample("nodehealth_host_shm_size_bytes", "Size of the shared-memory filesystem.", size, {"path": shm_path})
        )
        out.append(
            Sample(
                "nodehealth_host_shm_free_bytes",
                "Free bytes in the shared-memory filesystem.",
                free,
                {"path": shm_path},
            )
        )
        return out
