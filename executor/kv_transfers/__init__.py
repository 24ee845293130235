"""KV beyond the pool, the executor's side (the scheduler's is
scheduler_svc/core/kv_transfers.py and its connectors): worker.py, what each step asks
of a worker (NoKVWorker without one) and which worker a rank gets; host_tier.py, the
prefix cache's host tier; prefill.py and decode.py, the two sides of prefill/decode
disaggregation, leases.py the prefill side's leases and mooncake.py the transfer
engine they read through."""
