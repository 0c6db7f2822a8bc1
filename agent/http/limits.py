"""What clients can cost the HTTP server, bounded: the limits (`Limits`) and the worst case they add up to.

The agent's port is reachable by every pod of the cluster. The connection limits follow the fd limit (accept()
failing with EMFILE would stop all answers) and the memory limit: `worst_case_bytes` is the most memory every
client together can make the server hold, kernel socket buffers included (they are charged to the pod's memory
cgroup), and docs/http.md does the sum.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field

from agent.http.wire import MAX_HEAD_BYTES

# What every connection may pin must fit the memory limit with room (`worst_case_bytes`): far more than the
# clients of one node's agent (its jobs' pre-flights, kubelet, Prometheus) ever hold at once.
MAX_CONNECTIONS = 1024
# File descriptors left to the rest of the agent (probes, children, files) when the connection limit is
# derived from RLIMIT_NOFILE.
FD_RESERVE = 256
# An answer larger than this goes to the transport in pieces of this size, each once the last has gone to
# the kernel: the transport copies what the kernel does not take, so this is what a client that never reads
# pins of an answer (a /metrics body is shared by every client, never copied whole per connection).
WRITE_CHUNK = 16 * 1024
# Measured: what an open connection costs besides its buffers (asyncio transport and protocol, the socket
# object, the selector's key): RSS grew 10.6 MiB for 2,560 idle connections.
CONNECTION_OVERHEAD = 4 * 1024


def _fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def default_backlog(fd_limit: int | None = None) -> int:
    """The listen queue absorbs connection bursts; asyncio also accepts up to this many sockets in one loop
    turn, so it is part of the fd budget: 1024, less where the fd limit is low."""
    fd_limit = _fd_limit() if fd_limit is None else fd_limit
    return max(64, min(1024, (fd_limit - FD_RESERVE) // 4))


# The listen backlog of each further port (the metrics port, http.metrics_port): its clients are a Prometheus or
# two, and its queue is part of the fd budget too.
SECONDARY_BACKLOG = 64

# The health port (http.health_port): /healthz and /started for the kubelet's probes, on a pool of its own
# (`health_limits`), so that no client of the other ports can take the slots the probes need. The kubelet probes
# without keep-alive, one connection per probe at a time (liveness and readiness: two): a few slots are plenty.
HEALTH_CONNECTIONS = 64
HEALTH_NODE_RESERVE = 16
HEALTH_LOCAL_RESERVE = 8
# What the health port takes of the fd budget: its slots and its listen queue.
HEALTH_FDS = HEALTH_CONNECTIONS + HEALTH_NODE_RESERVE + HEALTH_LOCAL_RESERVE + SECONDARY_BACKLOG


def default_max_connections(fd_limit: int | None = None) -> int:
    """At most MAX_CONNECTIONS, and always below the fd limit, the listen queues of every port and the health
    port's own slots included: accept() failing with EMFILE would stop all answers."""
    fd_limit = _fd_limit() if fd_limit is None else fd_limit
    budget = fd_limit - FD_RESERVE - default_backlog(fd_limit) - SECONDARY_BACKLOG - HEALTH_FDS
    return max(16, min(MAX_CONNECTIONS, budget))


@dataclass(frozen=True)
class Limits:
    max_connections: int = field(default_factory=default_max_connections)
    max_per_peer: int = 64  # one address (one pod) cannot hold more
    # Local peers (loopback, or the address the client connected to: the node talking to itself) may go this
    # far beyond max_connections, and are not held to max_per_peer.
    local_reserve: int = 32
    # The last slots below max_connections go only to peers that hold no connection yet.
    new_peer_reserve: int = 64
    # Slots of their own for the node's own addresses (the kubelet's probes; agent/http/addresses.py), beyond
    # max_connections and not held to max_per_peer; 0: the node is a peer like any other. The health port's.
    node_reserve: int = 0
    head_timeout: float = 10.0  # from connecting (or the first byte of a later request) to a complete head
    idle_timeout: float = 75.0  # keep-alive between requests
    send_timeout: float = 10.0  # answers left unread this long: the connection is dropped
    linger: float = 2.0  # a closed connection whose last bytes cannot be delivered is dropped after this
    # Unparsed input held per connection, and the most one read takes for it; reading pauses when it is full.
    max_buffered: int = MAX_HEAD_BYTES
    # Queued answer bytes beyond which a connection pauses (reading too). 0: the next answer is written only
    # once the last one has gone to the kernel, so a client that never reads pins at most one answer.
    write_high_water: int = 0
    backlog: int = field(default_factory=default_backlog)
    secondary_backlog: int = SECONDARY_BACKLOG  # the listen backlog of each further port
    send_buffer: int = 16 * 1024  # SO_SNDBUF: bounds the kernel memory a client that never reads pins
    receive_buffer: int = 8 * 1024  # SO_RCVBUF: bounds what the kernel holds of a client's unread input
    sweep_every: float = 1.0
    log_every: float = 10.0  # loop errors of one kind: one log line per this many seconds

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_per_peer < 1:
            raise ValueError("connection limits must be at least 1")
        if self.max_buffered < MAX_HEAD_BYTES:
            raise ValueError(f"max_buffered must hold a whole request head ({MAX_HEAD_BYTES} bytes)")


def health_limits() -> Limits:
    """The health port's pool: small, its own, with slots kept for the node's addresses; short deadlines (the
    kubelet sends its request at once and closes after the answer: its timeoutSeconds is 5 s)."""
    return Limits(
        max_connections=HEALTH_CONNECTIONS,
        max_per_peer=4,
        local_reserve=HEALTH_LOCAL_RESERVE,
        new_peer_reserve=16,
        node_reserve=HEALTH_NODE_RESERVE,
        head_timeout=5.0,
        idle_timeout=5.0,
        send_timeout=5.0,
        backlog=SECONDARY_BACKLOG,
    )


def worst_case_bytes(limits: Limits, listeners: int = 2, health: Limits | None = None) -> int:
    """The most memory clients can make the server hold, the kernel's socket buffers (charged to the pod's
    memory cgroup) included: every connection slot (one budget for the main and metrics ports, and the health
    port's pool when given) with a full input buffer, one answer chunk unsent, and both kernel buffers full (the
    kernel doubles SO_RCVBUF and SO_SNDBUF for its bookkeeping), plus full listen backlogs of connections the
    kernel accepted and the loop has not: the main port's, `listeners - 1` further ones (the metrics port) and
    the health port's."""
    total = _pool_bytes(limits, limits.backlog + max(0, listeners - 1) * limits.secondary_backlog)
    return total + (_pool_bytes(health, health.backlog) if health is not None else 0)


def _pool_bytes(limits: Limits, queued: int) -> int:
    slots = limits.max_connections + limits.local_reserve + limits.node_reserve
    user = limits.max_buffered + WRITE_CHUNK + CONNECTION_OVERHEAD
    kernel = 2 * (limits.receive_buffer + limits.send_buffer)
    return slots * (user + kernel) + queued * 2 * limits.receive_buffer
