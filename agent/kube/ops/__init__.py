"""The operator's commands, run from a kubeconfig or a Job; the daemon never imports them.

- `cleanup`: take off the Nodes what the agents put there, before an uninstall.
- `fleet`: every node the agents marked, in one table.
- `uninstall`: the whole uninstall in one step (`kubectl apply -k deploy/uninstall` runs it as a Job).
"""
