"""The pure scheduling core: no I/O, no gRPC, protobuf, torch, asyncio or flagstop
runtime (a test holds it to that). The service around it (scheduler_svc/) drives it;
tests drive it in-process. The step plan it hands out, `SchedulerOutput`, is the one
the executor runs."""
