"""Executor: the model runner (persistent batch, paged KV cache, one forward and the
sampler a step) and its components (KV beyond the pool, drafts, grammar rows, LoRA),
the models and their weights, tensor parallelism, the simulator and the gRPC service."""
