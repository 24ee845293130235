"""Router: the client-facing gRPC server (tokenizing, admission queue, streaming)."""
