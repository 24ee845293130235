"""Tools for development, tests and benchmarks, not part of the installed package: the
embedded model writer, the local stack launcher and a minimal OTLP collector."""
