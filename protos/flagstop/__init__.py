"""The flagstop wire contract: the flagstop.v1 protos, their generated stubs and the
conventions every process applies on the wire (`flagstop.wire`)."""
