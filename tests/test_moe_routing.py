"""MoE routing of DeepSeek's families (executor/models/expert_routing.py) against transformers'
routers on the same weights: DeepSeek-V3's and GLM-4.5's noaux_tc (sigmoid, correction
bias, group-limited), DeepSeek-V2's softmax greedy and group_limited_greedy, a whole
DeepSeek-V3 sparse layer; and the plain softmax top-k unchanged."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DeepseekV2Config, DeepseekV3Config, Glm4MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from flagstop.executor.models.expert_routing import Routing
from flagstop.executor.models.moe import select_experts
from flagstop.executor.models.quantization import ConfigError

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)

HIDDEN = 16


def dense(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, E] each expert's weight per token (0: not chosen): order-free."""
    return torch.zeros(ids.shape[0], num_experts).scatter_(1, ids, weights.float())


def compare(router, routing: Routing, top_k: int, num_experts: int, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        router.weight.normal_()
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(std=0.3)
    x = torch.randn(64, HIDDEN)
    _, want_weights, want_ids = router(x)
    logits = x @ router.weight.T
    weights, ids = select_experts(routing, logits, top_k, bias if routing.corrected else None)
    torch.testing.assert_close(dense(ids, weights, num_experts),
                               dense(want_ids, want_weights, num_experts))  # fmt: skip


# (experts, groups, groups chosen, top-k); groups of two or more: transformers ranks a
# group by its two best scores.
shapes = st.sampled_from([(8, 2, 1, 2), (16, 4, 2, 4), (16, 8, 4, 2), (32, 8, 3, 6), (12, 1, 1, 3)])


@settings(max_examples=25, deadline=None)
@given(shape=shapes, norm=st.booleans(), scale=st.sampled_from([1.0, 2.5, 2.827]),
       seed=st.integers(0, 2**16))  # fmt: skip
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_noaux_tc_matches_transformers(family, shape, norm, scale, seed):
    num_experts, n_group, topk_group, top_k = shape
    fields = dict(hidden_size=HIDDEN, num_attention_heads=2, n_routed_experts=num_experts,
                  num_experts_per_tok=top_k,
                  n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                  routed_scaling_factor=scale)  # fmt: skip
    if family == "deepseek_v3":
        router = DeepseekV3TopkRouter(DeepseekV3Config(**fields))
    else:
        router = Glm4MoeTopkRouter(Glm4MoeConfig(**fields))
    routing = Routing.deepseek(fields, version=3)
    assert routing.corrected and routing.scoring == "sigmoid"
    compare(router, routing, top_k, num_experts, seed)


@settings(max_examples=25, deadline=None)
@given(shape=shapes, method=st.sampled_from(["greedy", "group_limited_greedy"]),
       scale=st.sampled_from([1.0, 16.0]), seed=st.integers(0, 2**16))  # fmt: skip
def test_deepseek_v2_routing_matches_transformers(shape, method, scale, seed):
    num_experts, n_group, topk_group, top_k = shape
    fields = dict(hidden_size=HIDDEN, num_attention_heads=2, n_routed_experts=num_experts,
                  num_experts_per_tok=top_k,
                  n_group=n_group, topk_group=topk_group, topk_method=method,
                  routed_scaling_factor=scale)  # fmt: skip
    router = DeepseekV2TopkRouter(DeepseekV2Config(**fields))
    routing = Routing.deepseek(fields, version=2)
    assert routing.scoring == "softmax" and not routing.corrected
    compare(router, routing, top_k, num_experts, seed)


def test_plain_routing_is_the_softmax_top_k():
    logits = torch.randn(32, 8)
    probs = logits.softmax(-1)
    want_weights, want_ids = probs.topk(2, dim=-1)
    weights, ids = select_experts(Routing(), logits, 2)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    weights, _ = select_experts(Routing(renormalize=True), logits, 2)
    torch.testing.assert_close(weights.sum(-1), torch.ones(32))


@pytest.mark.parametrize("fields, names", [
    ({"n_routed_experts": 10, "n_group": 4, "topk_group": 2}, "n_group=4"),
    ({"n_routed_experts": 8, "n_group": 4, "topk_group": 5}, "topk_group=5"),
    ({"n_routed_experts": 8, "topk_method": "auction"}, "topk_method='auction'"),
])  # fmt: skip
def test_a_routing_that_cannot_run_is_named(fields, names):
    with pytest.raises(ConfigError, match=names):
        Routing.deepseek(fields, version=2)


def test_a_deepseek_v3_sparse_layer_matches_transformers():
    """The whole block: routed experts by noaux_tc plus two ungated shared experts fused
    into one, the first layer dense (first_k_dense_replace), on transformers' weights."""
    from dataclasses import replace

    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from flagstop.executor.models.config import ModelConfig
    from flagstop.executor.models.config_sections import MoeConfig
    from flagstop.executor.models.families import ARCHITECTURES
    from flagstop.executor.models.moe import SparseMoeBlock
    from flagstop.executor.parallel import SINGLE

    fields = dict(hidden_size=HIDDEN, num_attention_heads=2, n_routed_experts=8,
                  num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=6,
                  n_shared_experts=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
                  hidden_act="silu")  # fmt: skip
    layout = ARCHITECTURES["DeepseekV3ForCausalLM"].moe
    moe = MoeConfig.from_hf(layout, fields, num_layers=3)
    assert moe.sparse_layers == (False, True, True) and moe.shared_expert_intermediate_size == 12
    base = ModelConfig.from_hf({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 32,
                                "hidden_size": HIDDEN, "intermediate_size": 8,
                                "num_hidden_layers": 3, "num_attention_heads": 2})  # fmt: skip
    torch.manual_seed(0)
    theirs = DeepseekV3MoE(DeepseekV3Config(**fields)).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(std=0.5)
        theirs.gate.e_score_correction_bias.normal_(std=0.3)
    ours = SparseMoeBlock(replace(base, moe=moe), SINGLE, "model.layers.1.mlp")
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        ours.e_score_correction_bias.copy_(theirs.gate.e_score_correction_bias)
        ours.experts.w13.copy_(theirs.experts.gate_up_proj)
        ours.experts.w2.copy_(theirs.experts.down_proj)
        shared = theirs.shared_experts
        ours.shared_expert.gate_up_proj.weight.copy_(
            torch.cat((shared.gate_proj.weight, shared.up_proj.weight))
        )
        ours.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
        x = torch.randn(40, HIDDEN)
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
