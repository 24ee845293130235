"""Scheduler service: a pure scheduling core (no I/O) and, around it, the gRPC service."""
