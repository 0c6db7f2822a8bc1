"""node-health command line: check, run, probes, config, diagnose, cleanup, uninstall, fleet."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from agent.checktable import format_table, terminal_style
from agent.config import Config, ConfigError, default_config_yaml, load_config, load_config_tolerant
from agent.logs import configure_logging
from agent.ready import BadQuery, ReadyQuery, judge, matches_any, matches_finding, validate_selectors
from agent.scheduler import Scheduler, build_state, instantiate
from agent.snapshot import Snapshot, Verdict, reason_dict
from agent.version import __version__
from probes import all_probes
from probes.base import Probe
from probes.host.config import HostConfig
from probes.runtime import cpulimit
from probes.runtime.host import Host
from probes.text import clip, escape

EXIT_READY, EXIT_NOT_READY, EXIT_USAGE = 0, 1, 2
CHECK_EXIT_CODES = f"""exit status:
  {EXIT_READY}  ready: nothing blocks jobs (of the checks --only selects)
  {EXIT_NOT_READY}  not ready: a fail, a required unknown, or a check without a result
  {EXIT_USAGE}  usage or config error (the message names the option or the config key)"""
EXIT_CODES = f"""exit status: {EXIT_USAGE} for a usage or config error in every command; `check`: {EXIT_READY} ready, \
{EXIT_NOT_READY} not ready
(node-health COMMAND --help for a command's own)"""
log = logging.getLogger("node-health")


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse exits 2 too; keep its message on stderr
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _add_check(sub: Any) -> None:
    check = sub.add_parser(
        "check",
        help="run every probe once and print the result",
        description="Run every enabled probe once and print the table (or --json) and the verdict.",
        epilog=CHECK_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("--config", metavar="FILE", help="YAML config file (default: built-in defaults)")
    check.add_argument("--json", action="store_true", help="print the JSON document instead of a table")
    check.add_argument("--only", metavar="CHECKS", help="comma-separated checks or prefixes, e.g. npu,storage.locks")
    check.add_argument(
        "--problems", action="store_true", help="show only fail, unknown and warn rows (and the verdict)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="node-health",
        description="Node health-check agent for accelerator nodes.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"node-health {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    _add_check(sub)

    run = sub.add_parser("run", help="run the daemon: schedule probes, serve HTTP, reconcile the Node")
    run.add_argument("--config", metavar="FILE", help="YAML config file, reloaded when it changes or on SIGHUP")
    run.add_argument("--no-kube", action="store_true", help="do not talk to Kubernetes (metrics and /ready only)")

    probes = sub.add_parser("probes", help="list probes, their checks, intervals and what each needs on the host")
    probes.add_argument(
        "--reasons",
        nargs="?",
        const="",
        metavar="CODE",
        help="list every reason code (or only CODE): status, meaning and fix; an unknown CODE exits 2",
    )

    config = sub.add_parser("config", help="configuration helpers")
    config.add_argument("--defaults", action="store_true", help="print the full default config as YAML")
    config.add_argument("--validate", metavar="FILE", help="validate a config file (exit 2 when invalid)")

    diagnose = sub.add_parser("diagnose", help="py-spy stack dump of a stuck process, classified")
    diagnose.add_argument("pid", help="process id")
    diagnose.add_argument("--json", action="store_true", help="print JSON")

    cleanup = sub.add_parser(
        "cleanup", help="remove the agent's taints, labels and conditions and release budget slots (uninstall)"
    )
    cleanup.add_argument("--config", metavar="FILE", help="YAML config file (key_prefix, budget, kubeconfig)")
    which = cleanup.add_mutually_exclusive_group()
    which.add_argument("--node", metavar="NAME", help="this node (default: node_name, $NODE_NAME, the hostname)")
    which.add_argument("--all-nodes", action="store_true", help="every node of the cluster")
    cleanup.add_argument("--dry-run", action="store_true", help="print what would be removed, change nothing")

    uninstall = sub.add_parser(
        "uninstall",
        help="the whole uninstall: stop the agents, clean every node, delete the install (deploy/uninstall runs it)",
    )
    uninstall.add_argument("--config", metavar="FILE", help="YAML config file (key_prefix, budgets, kubeconfig)")
    uninstall.add_argument(
        "--namespace", metavar="NS", help="the install's namespace (default: $POD_NAMESPACE, the ServiceAccount's)"
    )
    uninstall.add_argument(
        "--wait-seconds",
        type=float,
        default=300.0,
        metavar="S",
        help="how long to wait for the agents' pods to stop (default 300)",
    )
    uninstall.add_argument("--dry-run", action="store_true", help="print what would be done, change nothing")

    fleet = sub.add_parser(
        "fleet", help="every node the agents marked: problems, isolated devices, withheld taints, the budgets"
    )
    fleet.add_argument("--config", metavar="FILE", help="YAML config file (key_prefix, budgets, kubeconfig)")
    fleet.add_argument("--selector", metavar="LABELS", default="", help="only the nodes matching this label selector")
    fleet.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    return parser


def parse_selectors(text: str, probe_classes: dict[str, type[Probe]], config: Config | None = None) -> tuple[str, ...]:
    checks = {check for cls in probe_classes.values() for check in cls.checks}
    if config is not None:  # and the checks the config names (site checks)
        for cls in probe_classes.values():
            if cls.checks_from_config:
                probe = cls()
                probe.configure(config)
                checks.update(probe.checks)
    selectors = tuple(part.strip() for part in text.split(","))
    try:
        validate_selectors(selectors, checks)
    except BadQuery as exc:
        raise UsageError(f"--only: {exc} (see `node-health probes`)") from None
    return selectors


def run_check(config: Config, probe_classes: dict[str, type[Probe]], only: tuple[str, ...] | None) -> Snapshot:
    probes = instantiate(probe_classes)
    for probe in probes.values():
        probe.configure(config)  # the checks of a probe that takes them from the config (site checks)
    if only is not None:
        probes = {n: p for n, p in probes.items() if probe_selected(p, only)}
    state = build_state(config)
    scheduler = Scheduler(probes, config, Host.from_config(config.section(HostConfig)), state, one_shot=True)
    scheduler.run_all_once()
    return state.current()


def probe_selected(probe: Probe, only: tuple[str, ...]) -> bool:
    """Whether --only selects a check of the probe, by name or by a category its findings can carry."""
    return any(matches_any(check, only) for check in probe.checks) or any(c in only for c in probe.categories)


def verdict_of(snapshot: Snapshot, only: tuple[str, ...] | None) -> Verdict:
    """The whole node's verdict, or that of the checks --only selects (as /ready?checks= judges them)."""
    return judge(snapshot, ReadyQuery(checks=only)) if only else snapshot.verdict


def cpu_line(status: dict[str, Any]) -> str:
    """The container's CPU limit and how often it stopped the agent (and the probes' work cgroup)."""
    limit = status.get("limit_millicores")
    if limit is None:
        return "cpu: no CPU limit"
    parts = [f"cpu: limit {limit}m"]
    for name, what in (("container", "agent's cgroup"), ("work", "children's work cgroup")):
        counters = status.get(name)
        if counters:
            share = f" ({status['work_millicores']}m)" if name == "work" and status.get("work_millicores") else ""
            parts.append(
                f"{what}{share} throttled in {counters['throttled_periods']} of {counters['periods']} periods "
                f"({counters['throttled_seconds']:g} s)"
            )
    return "; ".join(parts)


def cmd_check(args: argparse.Namespace) -> int:
    probe_classes = all_probes()
    config = load_config(args.config, probe_classes)
    only = parse_selectors(args.only, probe_classes, config) if args.only else None
    snapshot = run_check(config, probe_classes, only)
    verdict = verdict_of(snapshot, only)
    if args.json:
        document: dict[str, Any] = snapshot.to_document()
        if only:
            document["findings"] = [f for f in document["findings"] if matches_any(f["check"], only, f.get("category"))]
            document["ready"] = verdict.ready
            document["reasons"] = [reason_dict(finding) for finding in verdict.reasons]
        document["cpu"] = cpulimit.observe().status()
        print(json.dumps(document, indent=2))
    else:
        findings = [s.finding for s in snapshot.checks if not only or matches_finding(s.finding, only)]
        style = terminal_style(sys.stdout)
        cpu = cpu_line(cpulimit.observe().status())
        print(format_table(snapshot.node, findings, verdict.ready, len(verdict.reasons), style, args.problems, cpu))
    return EXIT_READY if verdict.ready else EXIT_NOT_READY


def cmd_probes(args: argparse.Namespace) -> int:
    if args.reasons is not None:
        from agent.reference import reason_uses, reasons_text

        uses = reason_uses()
        if args.reasons:
            uses = [use for use in uses if use.reason.code == args.reasons]
            if not uses:
                raise UsageError(
                    f"probes --reasons: no reason code {clip(escape(args.reasons), 60)!r}{_did_you_mean(args.reasons)}"
                )
        sys.stdout.write(reasons_text(uses))
        return 0
    for name, cls in all_probes().items():
        print(f"{name}")
        checks = "one per entry of the config's list (docs/probes/site.md)" if cls.checks_from_config else ""
        print(f"  checks:   {', '.join(cls.checks) or checks}")
        print(f"  interval: {cls.default_interval:g}s  timeout: {cls.default_timeout:g}s")
        print(f"  needs:    {cls.needs}")
    return 0


def _did_you_mean(code: str) -> str:
    from agent.reference import reason_uses

    codes = sorted({use.reason.code for use in reason_uses()})
    by_case = {known.lower(): known for known in codes}
    close = difflib.get_close_matches(code.lower(), list(by_case), n=3, cutoff=0.6)
    if not close:
        return " (node-health probes --reasons lists them all)"
    return "; did you mean " + " or ".join(by_case[c] for c in close) + "?"


def cmd_config(args: argparse.Namespace) -> int:
    probe_classes = all_probes()
    if args.validate:
        load_config(args.validate, probe_classes)
        print(f"{args.validate}: valid")
        return 0
    if args.defaults:
        sys.stdout.write(default_config_yaml(probe_classes))
        return 0
    raise UsageError("config: give --defaults or --validate FILE")


def cmd_diagnose(args: argparse.Namespace) -> int:
    try:
        pid = int(args.pid)
        if pid <= 0:
            raise ValueError
    except ValueError:
        raise UsageError(f"diagnose: {args.pid!r} is not a process id") from None
    from agent.diagnose import main_diagnose

    return main_diagnose(pid, args.json)


def cmd_cleanup(args: argparse.Namespace) -> int:
    if args.node is not None and not args.node.strip():
        raise UsageError("cleanup: --node needs a node name")
    config, _ = load_config_tolerant(args.config, all_probes())  # the uninstall must work after a rollback too
    from agent.kube.ops.cleanup import main_cleanup  # the kubernetes client is heavy: only when used

    return main_cleanup(config, args.node, args.all_nodes, args.dry_run)


def cmd_uninstall(args: argparse.Namespace) -> int:
    if not 0 <= args.wait_seconds <= 86400:
        raise UsageError(f"uninstall: --wait-seconds {args.wait_seconds:g} is not within 0..86400")
    config, _ = load_config_tolerant(args.config, all_probes())  # a ConfigMap of a newer release too
    from agent.kube.ops.uninstall import main_uninstall  # the kubernetes client is heavy: only when used

    return main_uninstall(config, args.namespace, args.wait_seconds, args.dry_run)


def cmd_fleet(args: argparse.Namespace) -> int:
    config = load_config(args.config, all_probes())
    from agent.kube.ops.fleet import main_fleet  # the kubernetes client is heavy: only when used

    return main_fleet(config, args.selector, args.json)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging("text", "warning" if args.command != "run" else "info")
    try:
        if args.command == "check":
            return cmd_check(args)
        if args.command == "probes":
            return cmd_probes(args)
        if args.command == "config":
            return cmd_config(args)
        if args.command == "diagnose":
            return cmd_diagnose(args)
        if args.command == "cleanup":
            return cmd_cleanup(args)
        if args.command == "uninstall":
            return cmd_uninstall(args)
        if args.command == "fleet":
            return cmd_fleet(args)
        if args.command == "run":
            # Keys this release does not know are set aside with a warning (agent/configcompat.py): a rollback
            # under a ConfigMap written for a newer release must not crash-loop every agent.
            config, _ = load_config_tolerant(args.config, all_probes())
            configure_logging(config.logging.format, config.logging.level)
            from agent.daemon import run_daemon  # HTTP, metrics and the rest load only for the daemon

            return run_daemon(args.config, config, args.no_kube)
    except (ConfigError, UsageError) as exc:
        print(f"node-health: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
