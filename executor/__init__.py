"""Executor: the model runner (persistent batch, paged KV cache, forward, sampling)."""
