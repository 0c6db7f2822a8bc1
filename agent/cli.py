"""node-health command line: check, run, probes, config, diagnose, cleanup, fleet."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from agent.config import Config, ConfigError, default_config_yaml, load_config
from agent.logs import configure_logging
from agent.scheduler import Scheduler, build_state, instantiate
from agent.state import Snapshot, matches_any
from probes import all_probes
from probes.base import CATEGORIES, Probe, Status
from probes.host.config import HostConfig
from probes.runtime.host import Host

EXIT_READY, EXIT_NOT_READY, EXIT_USAGE = 0, 1, 2
log = logging.getLogger("node-health")


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse exits 2 too; keep its message on stderr
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def package_version() -> str:
    try:
        return importlib.metadata.version("node-health")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="node-health", description="Node health-check agent for accelerator nodes.")
    parser.add_argument("--version", action="version", version=f"node-health {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    check = sub.add_parser("check", help="run every probe once and print the result")
    check.add_argument("--config", metavar="FILE", help="YAML config file (default: built-in defaults)")
    check.add_argument("--json", action="store_true", help="print the JSON document instead of a table")
    check.add_argument("--only", metavar="CHECKS", help="comma-separated checks or prefixes, e.g. npu,storage.locks")

    run = sub.add_parser("run", help="run the daemon: schedule probes, serve HTTP, reconcile the Node")
    run.add_argument("--config", metavar="FILE", help="YAML config file, reloaded when it changes or on SIGHUP")
    run.add_argument("--no-kube", action="store_true", help="do not talk to Kubernetes (metrics and /ready only)")

    probes = sub.add_parser("probes", help="list probes, their checks, intervals and what each needs on the host")
    probes.add_argument("--reasons", action="store_true", help="list every reason code: status, meaning and fix")

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

    fleet = sub.add_parser(
        "fleet", help="every node the agents marked: problems, isolated devices, withheld taints, the budgets"
    )
    fleet.add_argument("--config", metavar="FILE", help="YAML config file (key_prefix, budgets, kubeconfig)")
    fleet.add_argument("--selector", metavar="LABELS", default="", help="only the nodes matching this label selector")
    fleet.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    return parser


def parse_selectors(text: str, probe_classes: dict[str, type[Probe]]) -> tuple[str, ...]:
    checks = {check for cls in probe_classes.values() for check in cls.checks}
    selectors = tuple(part.strip() for part in text.split(","))
    for selector in selectors:
        if not selector:
            raise UsageError("--only: empty name in the list")
        known = selector in CATEGORIES or any(c == selector or c.startswith(selector + ".") for c in checks)
        if not known:
            raise UsageError(f"--only: unknown check or prefix {selector!r} (see `node-health probes`)")
    return selectors


def run_check(config: Config, probe_classes: dict[str, type[Probe]], only: tuple[str, ...] | None) -> Snapshot:
    probes = instantiate(probe_classes)
    if only is not None:
        probes = {n: p for n, p in probes.items() if any(matches_any(c, only) for c in p.checks)}
    state = build_state(config, one_shot=True)
    scheduler = Scheduler(probes, config, Host.from_config(config.section(HostConfig)), state)
    scheduler.run_all_once()
    return state.snapshot


STATUS_MARK = {
    Status.OK: "ok",
    Status.WARN: "WARN",
    Status.FAIL: "FAIL",
    Status.UNKNOWN: "UNKNOWN",
    Status.SKIP: "skip",
}


def format_table(snapshot: Snapshot, only: tuple[str, ...] | None) -> str:
    verdict = snapshot.evaluate(only) if only else snapshot.verdict
    rows = [("STATUS", "CHECK", "SUBJECT", "REASON", "MESSAGE")]
    for state in snapshot.checks:
        f = state.finding
        if only and not matches_any(f.check, only):
            continue
        rows.append((STATUS_MARK[f.status], f.check, f.subject or "-", f.reason, f.message))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4] for row in rows]
    lines.append("")
    if verdict.ready:
        lines.append(f"node {snapshot.node}: READY")
    else:
        lines.append(f"node {snapshot.node}: NOT READY")
        for reason in verdict.reasons:
            where = f"{reason.check} {reason.subject}".strip()
            lines.append(f"  - {where}: {reason.reason}: {reason.message}")
            if reason.hint:
                lines.append(f"    fix: {reason.hint}")
    return "\n".join(lines)


def cmd_check(args: argparse.Namespace) -> int:
    probe_classes = all_probes()
    config = load_config(args.config, probe_classes)
    only = parse_selectors(args.only, probe_classes) if args.only else None
    snapshot = run_check(config, probe_classes, only)
    verdict = snapshot.evaluate(only) if only else snapshot.verdict
    if args.json:
        document: dict[str, Any] = snapshot.to_document()
        if only:
            document["findings"] = [f for f in document["findings"] if matches_any(f["check"], only)]
            document["ready"] = verdict.ready
            document["reasons"] = [r for r in document["reasons"] if matches_any(r["check"], only)]
        print(json.dumps(document, indent=2))
    else:
        print(format_table(snapshot, only))
    return EXIT_READY if verdict.ready else EXIT_NOT_READY


def cmd_probes(args: argparse.Namespace) -> int:
    if args.reasons:
        from agent.reference import reason_uses, reasons_text

        sys.stdout.write(reasons_text(reason_uses()))
        return 0
    for name, cls in all_probes().items():
        print(f"{name}")
        print(f"  checks:   {', '.join(cls.checks)}")
        print(f"  interval: {cls.default_interval:g}s  timeout: {cls.default_timeout:g}s")
        print(f"  needs:    {cls.needs}")
    return 0


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
    config = load_config(args.config, all_probes())
    from agent.kube.cleanup import main_cleanup  # the kubernetes client is heavy: only when used

    return main_cleanup(config, args.node, args.all_nodes, args.dry_run)


def cmd_fleet(args: argparse.Namespace) -> int:
    config = load_config(args.config, all_probes())
    from agent.kube.fleet import main_fleet  # the kubernetes client is heavy: only when used

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
        if args.command == "fleet":
            return cmd_fleet(args)
        if args.command == "run":
            config = load_config(args.config, all_probes())
            configure_logging(config.logging.format, config.logging.level)
            from agent.daemon import run_daemon  # HTTP, metrics and the rest load only for the daemon

            return run_daemon(args.config, config, args.no_kube)
    except (ConfigError, UsageError) as exc:
        print(f"node-health: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
