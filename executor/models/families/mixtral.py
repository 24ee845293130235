"""Mixtral: every layer sparse, top-k renormalised; its experts are w1 (gate), w3 (up)
and w2 (down) in block_sparse_moe."""

from flagstop.executor.models.families.family import Architecture, MoeLayout

MIXTRAL = MoeLayout(experts_field="num_local_experts", experts_alias="num_experts",
                    inner_field="intermediate_size", every_layer_sparse=True,
                    always_renormalize=True, expert_names=("w1", "w3", "w2"),
                    block_name="block_sparse_moe")  # fmt: skip

ARCHITECTURES = (Architecture("MixtralForCausalLM", moe=MIXTRAL),)
