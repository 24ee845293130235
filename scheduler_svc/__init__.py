"""Scheduler service: the pure scheduling core (core/) and, around it, the gRPC shell
(service.py), its conversions to and from protobuf (convert.py), the remote policy
client and telemetry."""
