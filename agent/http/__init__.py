"""The agent's HTTP wing: read-only answers from the health snapshot, on an asyncio server in a process of its own.

- `routes`: the endpoints /ready, /healthz, /started, /metrics and /status, on one port or two, and the health port.
- `answers`: what /ready's JSON and text bodies and the error answers look like (pure).
- `pod`: /ready?pod=: the devices the kubelet's ledger allocated to one pod.
- `server`: the HTTP/1.1 server on asyncio: connections, budgets per peer, deadlines.
- `wire`: request heads read strictly (RFC 9112), answers encoded.
- `limits`: what clients can cost the server, and the worst case those limits add up to; the health port's pool.
- `addresses`: the node's own addresses, for whom the health port keeps slots (the kubelet's probes).
- `serving`: the server's own process: a replica of the agent's state, fed each snapshot; why it is a process.
- `process`: the agent's side of it: starts it, feeds it, renders /metrics and /status and resolves pod= for it.
- `channel`: the framed messages between the two (pickles from the agent, JSON from the server).
"""
