"""The node's own addresses, for the health port's node reserve: a connection from one of them comes from the node
itself (the kubelet's probes), never from a pod, whose packets leave from the pod's own address.

Where they come from:

- the addresses of the host's network namespace, read from `/proc/1/net` (with hostPID, /proc/1 is the host's
  init, and these files need no privilege): the local /32 entries of `fib_trie` (IPv4) and `if_inet6` (IPv6). The
  kubelet's probes leave from whichever address the host routes the pod's address from: the node's InternalIP, a
  CNI bridge's (flannel's cni0), a tunnel's (Calico's tunl0 or vxlan.calico) or cilium_host's; all are here;
- `NODE_IP` / `NODE_IPS` (the downward API's status.hostIP / status.hostIPs, comma-separated), which the DaemonSet
  sets: the InternalIP even where /proc/1/net cannot be read.

The host's loopback addresses are left out (no packet from them reaches the pod; a client on the pod's own address
is *local*, a class of its own). The files are
re-read every REFRESH_SECONDS in a thread (a CNI restarted, an address added), at most MAX_READ_BYTES of each; a
file that cannot be read leaves the last addresses read from it.

Why a pod cannot pose as the node: a TCP connection needs the answer to its SYN, which goes to the address, i.e.
to the node, never to a pod that put the node's address on its packets. What can come from the node's address
and is not the kubelet: a hostNetwork pod, and traffic that kube-proxy masquerades (a NodePort Service whose
endpoints are the agent's pod: a Service selects pods of its own namespace only, so it takes a hand-made
EndpointSlice in the agent's namespace). docs/http.md, The kubelet's probes.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

REFRESH_SECONDS = 30.0
MAX_READ_BYTES = 4 << 20  # fib_trie grows with the routes (a BGP node's): far below this


def _read(path: Path) -> str | None:
    try:
        with open(path, "rb") as handle:
            return handle.read(MAX_READ_BYTES).decode("ascii", "replace")
    except OSError:
        return None


def local_ipv4(fib_trie: str) -> set[str]:
    """The /32 `host LOCAL` entries of /proc/net/fib_trie: the addresses of the namespace's interfaces."""
    found: set[str] = set()
    last = ""
    for line in fib_trie.splitlines():
        stripped = line.strip()
        if stripped.startswith(("|-- ", "+-- ")):
            last = stripped[4:].split()[0]
        elif stripped.startswith("/32 host LOCAL") and last:
            found.add(last)
    return {address for address in found if _usable(address)}


def local_ipv6(if_inet6: str) -> set[str]:
    """The addresses of /proc/net/if_inet6 (32 hex digits, then the interface's fields)."""
    found = set()
    for line in if_inet6.splitlines():
        digits = line.split(" ", 1)[0]
        if len(digits) == 32:
            try:
                found.add(str(ipaddress.IPv6Address(int(digits, 16))))
            except ValueError:
                continue
    return {address for address in found if _usable(address)}


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _usable(address: str) -> bool:
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return False
    return not parsed.is_loopback and not parsed.is_unspecified


def canonical(peer: str) -> str:
    """A peer address as these sets hold it: an IPv4-mapped IPv6 one (a dual-stack socket's) as IPv4, IPv6 in its
    compressed form, a zone dropped."""
    try:
        parsed = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return peer
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    return str(parsed)


def from_environment(environ: Mapping[str, str] | None = None) -> set[str]:
    environ = os.environ if environ is None else environ
    listed = ",".join(environ.get(name, "") for name in ("NODE_IP", "NODE_IPS"))
    return {canonical(part.strip()) for part in listed.split(",") if _is_address(part.strip())}


class NodeAddresses:
    """`is_node(peer)` for the HTTP loop (a set lookup); `refresh()` re-reads the files, in a thread of its own at
    most every REFRESH_SECONDS when `is_node` finds them old (never on the loop)."""

    def __init__(self, proc: str = "/proc", environ: Mapping[str, str] | None = None) -> None:
        self._net = Path(proc) / "1" / "net"
        self._fixed = frozenset(from_environment(environ))
        self._ipv4: set[str] = set()
        self._ipv6: set[str] = set()
        self.addresses: frozenset[str] = self._fixed
        self._read_at = -1e9  # monotonic
        self._reading = threading.Lock()

    def refresh(self) -> frozenset[str]:
        """Read the host namespace's addresses now (blocks on two small /proc reads)."""
        fib_trie, if_inet6 = _read(self._net / "fib_trie"), _read(self._net / "if_inet6")
        if fib_trie is not None:
            self._ipv4 = local_ipv4(fib_trie)
        if if_inet6 is not None:
            self._ipv6 = local_ipv6(if_inet6)
        self.addresses = frozenset(self._fixed | self._ipv4 | self._ipv6)
        self._read_at = time.monotonic()
        return self.addresses

    def is_node(self, peer: str) -> bool:
        if time.monotonic() - self._read_at > REFRESH_SECONDS and self._reading.acquire(blocking=False):
            self._read_at = time.monotonic()  # one refresh at a time, the next not before REFRESH_SECONDS
            threading.Thread(target=self._refresh_in_thread, name="node-addresses", daemon=True).start()
        return canonical(peer) in self.addresses

    def _refresh_in_thread(self) -> None:
        try:
            self.refresh()
        finally:
            self._reading.release()
