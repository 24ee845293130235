"""Scheduler service: the pure scheduling core (core/) and, around it, the gRPC shell:
the servicer (service.py), the router streams (router_links.py), the requests' way in
(intake.py), LoRA loads (adapters.py), the executor and the engine loop
(executor_link.py), the conversions to and from protobuf (convert.py), the remote
policy client and telemetry."""
