"""The agent hands a probe what it needs of the agent's settings as typed fields of the run's context (node
name, command-line redaction, the node's resolver); probes never read the agent's settings themselves."""

from __future__ import annotations

import pytest

from agent.config import parse_config
from agent.scheduler import execute, probe_context
from probes.base import Check, Probe, ProbeContext, ProbeOutput, Reason, Status
from probes.runtime.host import Host
from probes.runtime.resolver import HostResolverSettings

SEEN = Check("host.context")
SAW = Reason("ContextSeen", Status.OK, "what the probe saw of its context")


class ContextEcho(Probe):
    """Reports the context fields it was given (not registered: built for this test only)."""

    name = "test.context"
    checks = ("host.context",)
    reasons = (SAW,)

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        observed = {
            "node_name": ctx.node_name,
            "redact_cmdlines": ctx.redact_cmdlines,
            "nameservers": list(ctx.host_resolver.nameservers),
            "source": ctx.host_resolver.source,
            "try_seconds": ctx.host_resolver.try_seconds,
        }
        return [SEEN.report(SAW, "", "seen", observed)]


def test_the_agent_sets_every_field_from_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    config = parse_config(
        {
            "node_name": "gpu-7",
            "redact_cmdlines": False,
            "network": {"dns": {"nameservers": ["10.0.0.53", "10.0.0.54:5353"], "timeout_seconds": 1.5}},
        }
    )
    result, findings, _ = execute(ContextEcho(), Host(), config, 5.0)
    assert result == "ok"
    assert findings[0].observed == {
        "node_name": "gpu-7",
        "redact_cmdlines": False,
        "nameservers": ["10.0.0.53", "10.0.0.54:5353"],
        "source": "network.dns.nameservers",
        "try_seconds": 1.5,
    }


def test_defaults_redact_and_use_the_hosts_resolv_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "from-downward-api")
    ctx = probe_context(Host(), parse_config({}), 5.0)
    assert ctx.node_name == "from-downward-api"
    assert ctx.redact_cmdlines is True
    assert ctx.host_resolver == HostResolverSettings((), "network.dns.nameservers", 2.0)
    assert ctx.host_resolver.setup(Host(root="/nonexistent-root").paths).source == "/nonexistent-root/etc/resolv.conf"


def test_a_context_built_without_the_agent_is_the_safe_one() -> None:
    ctx = ProbeContext(Host(), parse_config({"redact_cmdlines": False, "node_name": ""}), 5.0)
    # Nothing is read from the settings behind the probe's back: redaction stays on, no node is assumed.
    assert (ctx.redact_cmdlines, ctx.node_name, ctx.host_resolver.nameservers) == (True, "", ())
