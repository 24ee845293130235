"""What the tests share, in one place: no test module imports another.

checkpoints: random-weight checkpoints of each architecture and the transformers
oracle; executor_harness: hand-written step plans for a model runner; hash_model: a
deterministic stand-in model for the scheduler's tests; scheduler_invariants: what
must hold between scheduler steps; certs: TLS certificates; tp_scenarios: the
tensor-parallel scenarios; streams: many client streams against a running stack and
their checks; metrics: a /metrics scrape; compose: the settings parser of each
command the compose files and manifests run."""
