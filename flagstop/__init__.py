"""flagstop: a continuous-batching LLM server in three gRPC processes.

One import package. Its own folder (flagstop/) holds what every process shares: the
generated stubs of the protos/ contracts (`flagstop.v1`) and the runtime, one job a
module: `server` (serving, channels, TLS, process bootstrap), `settings`, `logs`,
`telemetry`, `health` (liveness and readiness, and their CLI), `reconnect`. Each
service lives in its own top-level folder and installs under this package
(pyproject.toml's package-dir): flagstop.router (router/), flagstop.scheduler_svc
(scheduler_svc/, its pure core in scheduler_svc/core/), flagstop.executor (executor/)
and flagstop.kernels (kernels/)."""
