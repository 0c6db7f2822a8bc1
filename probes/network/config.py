"""Config of the network family (`network:`)."""

from __future__ import annotations

import ipaddress

from pydantic import Field, ValidationInfo, field_validator, model_validator

from probes.family import PositiveSeconds, Section
from probes.network.proxy import parse_proxy
from probes.runtime.addresses import split_host_port
from probes.runtime.resolver import DEFAULT_TRY_SECONDS, HostResolverSettings


class DnsConfig(Section):
    names: list[str] = []
    nameservers: list[str] = []  # "ip" or "ip:port"; empty: the host's resolv.conf
    timeout_seconds: PositiveSeconds = DEFAULT_TRY_SECONDS  # per try, per nameserver
    lifetime_seconds: PositiveSeconds = 4.0  # per name, all tries (bounded by the probe's deadline)
    slow_seconds: PositiveSeconds = 0.5
    # Resolved only when the agent runs in a pod (KUBERNETES_SERVICE_HOST set), and only through the pod's
    # own resolver (`cluster_resolv_conf`, with its search domains; dnsPolicy ClusterFirstWithHostNet), never
    # the node's: datacenter resolvers do not serve the cluster domain. Relative, so no cluster domain is
    # assumed: the pod's search list completes it.
    cluster_names: list[str] = ["kubernetes.default.svc"]
    # The pod's own resolv.conf (a path in the agent's filesystem, not under host.root).
    cluster_resolv_conf: str = "/etc/resolv.conf"

    @field_validator("nameservers")
    @classmethod
    def _ip_and_port(cls, value: list[str]) -> list[str]:
        for entry in value:
            host, _ = split_host_port(entry, 53)
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ValueError(f"{entry!r}: a nameserver must be an IP address, optionally with :port") from None
        return value

    def host_resolver(self) -> HostResolverSettings:
        """The node's own resolver as these settings set it up: the agent hands it to every probe (`time`
        resolves NTP server names with it), so no other family reads this section."""
        return HostResolverSettings(tuple(self.nameservers), "network.dns.nameservers", self.timeout_seconds)


class EgressTarget(Section):
    name: str = ""  # empty: the subject is host:port
    host: str
    port: int = Field(443, ge=1, le=65535)
    tls: bool = True
    http_path: str | None = None
    expect_status: list[int] = [200]
    # http://host:port, or http://user:password@host:port (sent as Proxy-Authorization: Basic, never shown).
    proxy: str | None = None
    # A file holding USER:PASSWORD for the proxy (a Secret mounted into the agent; a path in the agent's own
    # filesystem, not under host.root), read at each check. Not with userinfo in `proxy`.
    proxy_credentials_file: str | None = None
    timeout_seconds: PositiveSeconds = 5.0
    # Extra CA bundle (a host path, e.g. a corporate CA) trusted besides the agent's default CAs.
    ca_file: str | None = None
    # A check that passes but takes longer than this (DNS, connect, proxy, TLS and HTTP together) is a
    # warning (EgressSlow); None: network.egress_slow_ms.
    slow_ms: float | None = Field(None, gt=0)

    @field_validator("proxy")
    @classmethod
    def _http_proxy(cls, value: str | None) -> str | None:
        if value is None:
            return value
        parse_proxy(value)  # its errors never quote the userinfo
        return value

    @field_validator("proxy_credentials_file")
    @classmethod
    def _one_source_of_credentials(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        proxy = info.data.get("proxy")
        if proxy is None:
            raise ValueError("set, but proxy is not (or is invalid): credentials for which proxy?")
        if parse_proxy(proxy).userinfo:
            raise ValueError(
                "set either userinfo in proxy (http://user:password@host:port) or proxy_credentials_file, not both"
            )
        if not value.startswith("/"):
            raise ValueError("must be an absolute path (where the Secret is mounted in the agent's container)")
        return value

    @field_validator("http_path")
    @classmethod
    def _absolute_path(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError("http_path must start with /")
        return value

    @property
    def subject(self) -> str:
        return self.name or f"{self.host}:{self.port}"


class LinksConfig(Section):
    interfaces: list[str] = []  # empty: every physical NIC
    max_carrier_changes_per_hour: float = Field(6, ge=0)
    # Network namespace to inspect (a path such as /run/netns/x); empty: the host's, <proc>/1/ns/net.
    netns: str = ""


class PortsConfig(Section):
    base: int = Field(60000, ge=1, le=65535)
    count: int = Field(16, ge=1, le=65535)
    # Warn (PortsNotReserved) when net.ipv4.ip_local_reserved_ports does not cover the range.
    check_reserved: bool = True
    # HCCL is Ascend's collective library: on a node without /dev/davinciN (a GPU node) the check does not
    # apply. false checks the range on every node.
    only_with_npus: bool = True

    @model_validator(mode="after")
    def _fits(self) -> PortsConfig:
        if self.base + self.count - 1 > 65535:
            raise ValueError("base + count - 1 must not exceed 65535")
        return self


class NetworkConfig(Section):
    dns: DnsConfig = DnsConfig()
    egress: list[EgressTarget] = []
    # EgressSlow threshold of targets that set no slow_ms of their own.
    egress_slow_ms: float = Field(2000, gt=0)
    links: LinksConfig = LinksConfig()
    ports: PortsConfig = PortsConfig()
