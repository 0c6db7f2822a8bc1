"""The daemon: wires config, probes, scheduler, state, HTTP and (optionally) Kubernetes; reloads config."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import resource
import signal
import threading
import time
from typing import Any

from agent.config import Config, ConfigError, load_config_tolerant, status_on_main_port
from agent.configcompat import ConfigNotes
from agent.configfile import ConfigFileError, read_bounded
from agent.http.addresses import NodeAddresses
from agent.http.pod import PodLedger
from agent.http.process import ServerProcess
from agent.http.routes import HttpServer
from agent.kube.pods import PodFeed
from agent.logs import HealthLog, configure_logging
from agent.metrics import MetricsRenderer
from agent.scheduler import Scheduler, build_state, instantiate
from agent.version import __version__
from probes import all_probes
from probes.base import Probe, Sample
from probes.host.config import HostConfig
from probes.runtime import cpulimit
from probes.runtime.host import Host

log = logging.getLogger(__name__)

CONFIG_POLL_SECONDS = 5.0
HEALTHZ_TICK_AGE = 10.0
STARTUP_GRACE_SECONDS = 120.0  # the most the agent's process stays out of the work cgroup after start


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit: connections from any pod must not leave probes without
    descriptors for their children. Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise RLIMIT_NOFILE from %d to %d: %s", soft, target, exc)
    return soft


# glibc's mallopt parameter number for the most malloc arenas (malloc.h).
M_ARENA_MAX = -8
MALLOC_ARENAS = 2


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas, before any thread starts. Every probe run is a thread of its own (a hung one
    is left behind, never reused), and glibc gives threads arenas of their own, up to 8 per core: each keeps
    the memory its threads freed, fragmented, so RSS crept up 0.2 MiB/min for half an hour with every probe
    failing every 2 s, and was flat with 2 arenas (benchmarks/soak.py). The GIL runs one thread at a time, so
    more arenas buy no parallelism. False where the C library is not glibc (no mallopt)."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


class ConfigWatcher:
    """Notices a changed config file: a mounted ConfigMap is swapped in place through a symlink."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._fingerprint = self._read()

    def _read(self) -> str | None:
        if self.path is None:
            return None
        try:
            return hashlib.sha256(read_bounded(self.path)).hexdigest()
        except ConfigFileError as exc:
            # Still a change: a file that became unreadable or oversized must reach reload() and be rejected
            # (and counted), not be ignored.
            return f"unreadable: {exc}"

    def changed(self) -> bool:
        current = self._read()
        if current is None or current == self._fingerprint:
            return False
        self._fingerprint = current
        return True


class Agent:
    def __init__(
        self,
        config_path: str | None,
        config: Config,
        no_kube: bool = False,
        probe_classes: dict[str, type[Probe]] | None = None,
        cpu: cpulimit.Confinement | None = None,
        http_process: bool = False,
    ) -> None:
        self.config_path = config_path
        # The container's CPU limit and the work cgroup the probes' children run in (run_daemon confines).
        self.cpu = cpu if cpu is not None else cpulimit.observe()
        self.config = config
        self.no_kube = no_kube
        self.probe_classes = probe_classes if probe_classes is not None else all_probes()
        self.probes = instantiate(self.probe_classes)
        self.host = Host.from_config(config.section(HostConfig))
        self.state = build_state(config)
        self.state.add_sink(HealthLog())  # the health history in the log: when and why (docs/observability.md)
        # The one seam by which the node's pods reach the probes and /ready?pod=; the Kubernetes side connects to it.
        self.pods = PodFeed()
        self.scheduler = Scheduler(self.probes, config, self.host, self.state, pods=self.pods)
        self.reloads: dict[str, int] = {"ok": 0, "error": 0}
        self.last_reload_error = ""
        # Keys of the running config this release does not know, set aside (agent/configcompat.py).
        self.config_notes = self._notes_of(config_path)
        self.kube: Any = None
        self.metrics = MetricsRenderer(self.state.current, [self._agent_samples])
        # /ready?pod=: the kubelet's ledger as the config of the moment names it, the node's pods from the feed.
        self.pod_ledger = PodLedger(
            lambda: self.config.kubernetes.pod_resources_socket,
            lambda: self.config.kubernetes.pod_resources_timeout_seconds,
            lambda: self.pods,
        )
        self.http = self._server(config, http_process)
        self._stop = threading.Event()
        self._reload_requested = threading.Event()
        self._watcher = ConfigWatcher(config_path)

    def _server(self, config: Config, in_process_of_its_own: bool) -> HttpServer | ServerProcess:
        common: dict[str, Any] = {
            "address": config.http.address,
            "port": config.http.port,
            "max_wait": config.http.max_wait_seconds,
            "metrics_port": config.http.metrics_port or None,
            "status_on_main_port": status_on_main_port(config.http),
            "health_port": config.http.health_port or None,
        }
        views = (self.state, self.metrics.render, self.healthz, self.known_checks, self.status_extra)
        if in_process_of_its_own:
            # The daemon's way: the server in a process of its own (agent/http/serving.py), out of this one's GIL
            # and, once this process joins the work cgroup (run_daemon), out of its CPU quota.
            return ServerProcess(
                *views,
                **common,
                proc=config.section(HostConfig).proc,
                pod_ledger=self.pod_ledger,
                logging_setup=(config.logging.format, config.logging.level),
                cgroup_procs=self.cpu.serving_procs,
            )
        server = HttpServer(
            *views,
            **common,
            pod_ledger=self.pod_ledger,
            node_addresses=NodeAddresses(config.section(HostConfig).proc),
        )
        self.metrics.collector.add_source(server.samples)
        return server

    # --- views for HTTP --------------------------------------------------------------------------

    def known_checks(self) -> set[str]:
        # The probes' instances: a probe whose checks come from the config (site checks) holds the config's.
        return {check for probe in self.probes.values() for check in probe.checks}

    def healthz(self) -> tuple[bool, dict[str, Any]]:
        problems = []
        if not self.scheduler.alive(HEALTHZ_TICK_AGE):
            problems.append("scheduler loop is not ticking")
        stuck = self.scheduler.stuck_probes(self.config.health.wedged_after_seconds)
        problems.extend(f"probe {name} stuck for {seconds:.0f}s" for name, seconds in sorted(stuck.items()))
        return not problems, {"problems": problems}

    def status_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "version": __version__,
            "agent": {
                "config_path": self.config_path,
                "config_reloads": dict(self.reloads),
                "last_reload_error": self.last_reload_error or None,
                "children_in_flight": len(self.host.children.in_flight()),
                "config_version": self.config_notes.config_version,
                "config_unknown_keys": list(self.config_notes.unknown_keys),
                "config_warnings": self.config_notes.warnings(),
            },
        }
        extra["cpu"] = self.cpu.status()
        if self.kube is not None:
            extra["kubernetes"] = self.kube.status()
        return extra

    def _agent_samples(self) -> list[Sample]:
        samples = [
            Sample("nodehealth_config_reloads_total", "Config reloads by result.", count, {"result": result}, "counter")
            for result, count in self.reloads.items()
        ]
        samples.append(
            Sample(
                "nodehealth_config_unknown_keys",
                "Keys of the running config this release does not know and ignores (a newer release's, or typos).",
                len(self.config_notes.unknown_keys),
            )
        )
        samples.append(
            Sample(
                "nodehealth_child_processes_in_flight",
                "Filesystem-check children not yet reaped (a hung mount keeps one).",
                len(self.host.children.in_flight()),
            )
        )
        samples.extend(cpu_samples(self.cpu))
        if self.kube is not None:
            samples.extend(self.kube.samples())
        return samples

    # --- lifecycle -------------------------------------------------------------------------------

    def _notes_of(self, config_path: str | None) -> ConfigNotes:
        """What loading the config this agent starts with set aside (the caller loaded it tolerantly too)."""
        try:
            return load_config_tolerant(config_path, self.probe_classes)[1]
        except ConfigError:
            return ConfigNotes()

    def _log_config_notes(self) -> None:
        for warning in self.config_notes.warnings():
            log.warning("%s", warning)

    def start(self) -> None:
        self._log_config_notes()
        self.http.start()
        listening = self.http.listening()
        for served in listening["ports"]:
            note = " (the kubelet's probes)" if served["routes"] == ["/healthz", "/started"] else ""
            routes = ", ".join(served["routes"])
            log.info("serving on %s:%d %s%s", self.config.http.address, served["port"], routes, note)
        if isinstance(self.http, ServerProcess):
            log.info("the HTTP server runs in process %d", self.http.pid)
        self._log_cpu()
        self.scheduler.start()
        if self.config.kubernetes.enabled and not self.no_kube:
            from agent.kube import KubeAgent  # the kubernetes client is heavy: only when used

            # No client given: KubeAgent loads it itself and backs off while that fails, so a missing
            # service account or kubeconfig never keeps HTTP and metrics from serving.
            self.kube = KubeAgent(self.config, self.config.resolved_node_name, self.state.current)
            self.kube.start()
            self.pods.connect(self.kube.pods)

    def join_work_when_started(self, poll: float = 0.5, give_up: float = STARTUP_GRACE_SECONDS) -> bool:
        """Move this process into the work cgroup once every probe has run once (or `give_up` seconds passed): from
        then on the server's process keeps the headroom, and this one and its children share the rest. Not before:
        every probe's first run at once, and the Kubernetes client's start, would take the first holder scan's share
        of the work quota, and the scan its deadline (benchmarks/pod_quota.py); /ready says warming up meanwhile."""
        deadline = time.monotonic() + give_up
        while time.monotonic() < deadline and not self._stop.is_set():
            if all(probe.last_run is not None for probe in self.state.current().probes):
                break
            self._stop.wait(poll)
        if self._stop.is_set() or not cpulimit.join_work():
            return False
        log.info("the agent's process joined %s", self.cpu.work.path if self.cpu.work is not None else "work")
        return True

    def _log_cpu(self) -> None:
        cpu = self.cpu
        if cpu.work is not None:
            share = f"{cpu.work_millicores()}m of the {cpu.limit_millicores()}m limit"
            log.info("probes' children run in %s (%s, %s)", cpu.work.path, cpu.mode, share)
        else:
            log.info("probes' children share the agent's cgroup: %s", cpu.why or "no work cgroup")

    def request_stop(self, *_: Any) -> None:
        self._stop.set()

    def request_reload(self, *_: Any) -> None:
        self._reload_requested.set()

    def install_signal_handlers(self) -> None:
        """Before anything announces the agent: a SIGHUP that arrives early must reload, not kill."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)

    def serve_forever(self) -> None:
        next_poll = time.monotonic() + CONFIG_POLL_SECONDS
        while not self._stop.is_set():
            self._stop.wait(0.2)
            if self._reload_requested.is_set():
                self._reload_requested.clear()
                self._watcher.changed()  # adopt the fingerprint of what we are loading now
                self.reload("SIGHUP")
            elif time.monotonic() >= next_poll:
                next_poll = time.monotonic() + CONFIG_POLL_SECONDS
                if self._watcher.changed():
                    self.reload("file changed")
        self.shutdown()

    def reload(self, why: str) -> bool:
        try:
            config, notes = load_config_tolerant(self.config_path, self.probe_classes)
        except Exception as exc:  # whatever a bad ConfigMap does, the running config stays
            if not isinstance(exc, ConfigError):
                log.exception("config reload (%s) failed unexpectedly", why)
            self.reloads["error"] += 1
            self.last_reload_error = str(exc)
            log.error("config reload (%s) rejected, keeping the running config: %s", why, exc)
            return False
        listeners = ("address", "port", "metrics_port", "status_on_main_port", "health_port")
        changed = [key for key in listeners if getattr(config.http, key) != getattr(self.config.http, key)]
        if changed:
            log.warning("%s changed: takes effect at the next restart", ", ".join(f"http.{key}" for key in changed))
        if config.section(HostConfig) != self.config.section(HostConfig):
            self.host = Host.from_config(
                config.section(HostConfig), children=self.host.children, devices=self.host.devices
            )
        self.config = config
        self.config_notes = notes
        configure_logging(config.logging.format, config.logging.level)
        self._log_config_notes()
        self.scheduler.reconfigure(config, self.host)
        if self.kube is not None:
            self.kube.reconfigure(config)
        self.reloads["ok"] += 1
        self.last_reload_error = ""
        log.info("config reloaded (%s)", why)
        return True

    def shutdown(self) -> None:
        log.info("stopping")
        deadline = time.monotonic() + 4.0
        self.scheduler.stop(timeout=1.0)
        if self.kube is not None:
            self.kube.stop(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
        self.http.stop(timeout=max(0.1, deadline - time.monotonic()))


def cpu_samples(cpu: cpulimit.Confinement) -> list[Sample]:
    """The container's CFS counters (and the work cgroup's, where the probes' children run in one): throttled
    periods stop every thread of the cgroup, the HTTP loop's included when it is the container's."""
    samples = []
    for name, group in (("container", cpu.container), (cpulimit.WORK, cpu.work)):
        if group is None:
            continue
        stat, labels, limit = group.stat(), {"cgroup": name}, group.millicores()
        samples += [
            Sample(
                "nodehealth_cpu_periods_total",
                "CFS periods with runnable tasks, by cgroup.",
                stat.periods,
                labels,
                "counter",
            ),
            Sample(
                "nodehealth_cpu_throttled_periods_total",
                "CFS periods in which the cgroup used up its CPU quota and was stopped until the next one.",
                stat.throttled_periods,
                labels,
                "counter",
            ),
            Sample(
                "nodehealth_cpu_throttled_seconds_total",
                "Seconds the cgroup's threads were stopped by its CPU quota.",
                stat.throttled_seconds,
                labels,
                "counter",
            ),
            Sample(
                "nodehealth_cpu_limit_cores",
                "The cgroup's CPU quota in cores; 0 when it has none.",
                (limit or 0) / 1000,
                labels,
            ),
        ]
    return samples


def run_daemon(config_path: str | None, config: Config, no_kube: bool) -> int:
    raise_fd_limit()
    limit_malloc_arenas()
    cpu = cpulimit.confine()  # before the first child: every later one runs in the work cgroup
    agent = Agent(config_path, config, no_kube=no_kube, cpu=cpu, http_process=True)
    agent.install_signal_handlers()
    try:
        agent.start()
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    if cpu.work is not None:
        threading.Thread(target=agent.join_work_when_started, name="join-work", daemon=True).start()
    agent.serve_forever()
    return 0
