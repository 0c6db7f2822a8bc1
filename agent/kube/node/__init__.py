"""The node wing: what the agent's own Node carries, from one health snapshot.

- `policy`: what the Node should carry per category, from a health snapshot (pure).
- `plan`: the patch to send, from the snapshot, the Node as read and the policy (pure).
- `budget`: the cluster taint budget (a ConfigMap of slots, compare-and-swap).
- `seat`: the node's seat in the taint budget (slot held, refusal and its backoff, taints withheld).
- `events`: the Event queue, sent on its own schedule.
- `report`: the reconciler's part of /status, and its metrics.
"""
