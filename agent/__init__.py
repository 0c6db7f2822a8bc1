"""The agent: assembles the probes, keeps their health state and answers from its snapshot, in wings.

- `daemon`: wires config, probes, scheduler, state, HTTP and (optionally) Kubernetes; reloads config.
- `cli`: the command line (check, run, probes, config, diagnose and the operator's commands); `diagnose`: a
  stuck process's classified py-spy dump; `checktable`: `check`'s table (width, --problems, colour).
- `config`: the one YAML document, validated strictly; `configfile`: reading it without trusting it;
  `configcompat`: files written for another release; `labelselector`: label selectors as the API server
  parses them.
- `scheduler`: each probe on its own interval, in its own thread, under a deadline.
- `state`: the health state (hysteresis, fail-closed rules, freshness); `snapshot`: the immutable Snapshot it
  publishes; `ready`: selectors and the readiness verdict; `reasons`: the agent's own reasons.
- `metrics`: Prometheus exposition of a snapshot; `logs`: plain or JSON logging and the health history;
  `timestamps`: RFC 3339.
- `reference`: the reason reference generated from the declarations; `version`: the release.
- `http/`: the HTTP wing; `kube/`: the Kubernetes side (its node and devices wings, the operator's commands).
"""
