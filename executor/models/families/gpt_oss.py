"""gpt-oss: attention sinks, and experts stacked in the checkpoint, every layer
sparse, biased, behind the clamped SwiGLU."""

from flagstop.executor.models.families.family import Architecture, MoeLayout

GPT_OSS = MoeLayout(experts_field="num_local_experts", experts_alias="num_experts",
                    inner_field="intermediate_size", every_layer_sparse=True,
                    always_renormalize=True, clamped_swiglu=True)  # fmt: skip

ARCHITECTURES = (Architecture("GptOssForCausalLM", moe=GPT_OSS, sinks=True),)
