"""The agent's HTTP wing: read-only answers from the health snapshot, on an asyncio server of its own.

- `routes`: the endpoints /ready, /healthz, /started, /metrics and /status, on one port or two, and the health port.
- `answers`: what /ready's JSON and text bodies and the error answers look like (pure).
- `pod`: /ready?pod=: the devices the kubelet's ledger allocated to one pod.
- `server`: the HTTP/1.1 server on asyncio: connections, budgets per peer, deadlines.
- `wire`: request heads read strictly (RFC 9112), answers encoded.
- `limits`: what clients can cost the server, and the worst case those limits add up to; the health port's pool.
- `addresses`: the node's own addresses, for whom the health port keeps slots (the kubelet's probes).
"""
