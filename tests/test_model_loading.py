import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from flagstop.executor.models import onednn
from flagstop.executor.models.config import ConfigError, ModelConfig
from flagstop.executor.models.loader import load_model
from flagstop.executor.parallel import Shard, TensorParallel
from flagstop.kernels.torch_attention import gather_kv, store_kv
from tests.helpers.checkpoints import write_checkpoint
from tools.make_model import write_model

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


def digest(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_make_model_is_deterministic_and_loads_offline(tiny, tmp_path):
    assert digest(write_model(tmp_path / "again", "tiny", seed=0)) == digest(tiny)
    assert digest(write_model(tmp_path / "other", "tiny", seed=1)) != digest(tiny)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    assert len(tokenizer) >= 512
    ids = tokenizer("The scheduler preempts the newest request. Ünïcödé ✓").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert (
        tokenizer.decode(ids, skip_special_tokens=True)
        == "The scheduler preempts the newest request. Ünïcödé ✓"
    )


def test_config_of_an_unsupported_architecture_says_what_is_supported():
    with pytest.raises(
        ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"
    ):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})


def test_a_sliding_window_is_honoured_per_layer_not_as_a_length_cap(tiny):
    hf = json.loads((tiny / "config.json").read_text())
    mistral = ModelConfig.from_hf(hf | {"architectures": ["MistralForCausalLM"],
                                        "sliding_window": 256})  # fmt: skip
    assert mistral.max_model_len == hf["max_position_embeddings"]
    assert mistral.layer_types == ("sliding_attention",) * hf["num_hidden_layers"]
    assert mistral.sliding_window == 256
    # Qwen2: only with use_sliding_window, from max_window_layers on.
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64, "max_window_layers": 1}
    assert set(ModelConfig.from_hf(hf | qwen2 | {"use_sliding_window": False}).layer_types) == {
        "full_attention"
    }
    types = ModelConfig.from_hf(hf | qwen2 | {"use_sliding_window": True}).layer_types
    assert types == ("full_attention", *["sliding_attention"] * (hf["num_hidden_layers"] - 1))
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf(hf | {"sliding_window": 8, "layer_types": ["local"]})


def test_a_checkpoint_missing_a_tensor_is_refused(tiny, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(tiny / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"lacks 1 tensors.*layers\.1\.self_attn\.qkv_proj\.weight#1"
    ):
        load_model(broken, torch.float32, torch.device("cpu"))


def test_store_kv_skips_padding_slots_and_gather_reads_blocks_back():
    # 3 blocks of 2 tokens, 2 KV heads, head-major: [block, head, offset, dim].
    k_cache = torch.zeros(3, 2, 2, 4)
    v_cache = torch.zeros(3, 2, 2, 4)
    key = torch.arange(24.0).view(3, 2, 4)
    store_kv(key, -key, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache[2, :, 1], key[0]) and torch.equal(k_cache[0, :, 0], key[2])
    assert torch.equal(v_cache[2, :, 1], -key[0])
    assert int((k_cache != 0).sum()) == 15  # key[0] holds a zero: 16 values, 15 non-zero
    gathered = gather_kv(k_cache, torch.tensor([[2, 0]]), 3)
    assert gathered.shape == (1, 2, 3, 4)
    assert torch.equal(gathered[0, :, 1], key[0]) and torch.equal(gathered[0, :, 2], key[2])


@pytest.mark.skipif(
    not onednn.usable(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)
def test_the_cpu_model_runs_on_packed_weights_equal_to_f_linear_at_every_row_count(tiny):
    model = load_model(tiny, torch.float32, torch.device("cpu"))
    linear = model.layers[0].mlp.gate_up_proj
    assert linear.packed is not None and linear.weight.numel() == 0  # the copy replaced it
    assert model.embed_tokens.weight.numel() > 0
    weight = torch.randn(40, 24)
    fresh = onednn.Linear(24, 40, bias=True)
    with torch.no_grad():
        fresh.weight.copy_(weight)
    reference = [fresh(torch.ones(n, 24)) for n in (1, 17, 33)]
    assert onednn.pack(fresh, shared=set()) == 0  # too small to pay: F.linear
    assert onednn.pack(fresh, shared=set(), min_elements=0) == 1
    for n, expected in zip((1, 17, 33), reference, strict=True):
        torch.testing.assert_close(fresh(torch.ones(n, 24)), expected, rtol=1e-5, atol=1e-5)
    assert [onednn.padded_rows(n) for n in (16, 17, 33, 512, 513)] == [16, 18, 36, 512, 576]


def test_an_expert_parallel_rank_reads_only_its_own_experts(tmp_path):
    """Rank 1 of 2 holds experts 4-7: a checkpoint without expert 0 loads there (its
    tensors are never read) and is refused on rank 0, naming the expert."""
    path = write_checkpoint("mixtral", tmp_path / "mixtral")
    weights = load_file(path / "model.safetensors")
    for name in [n for n in weights if ".experts.0." in n]:
        del weights[name]
    save_file(weights, path / "model.safetensors")
    cpu = torch.device("cpu")
    model = load_model(path, torch.float32, cpu, TensorParallel(Shard(1, 2, True)))
    experts = model.layers[0].mlp.experts
    assert (experts.first_expert, experts.num_experts) == (4, 4)
    with pytest.raises(ValueError, match=r"lacks 6 tensors.*experts\.w13#0 of expert 0"):
        load_model(path, torch.float32, cpu, TensorParallel(Shard(0, 2, True)))


def test_moe_configs_flagstop_cannot_run_are_refused_naming_the_field():
    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}  # fmt: skip
    assert ModelConfig.from_hf(base).moe.num_experts == 4
    assert ModelConfig.from_hf({**base, "num_local_experts": 4, "num_experts": None}).moe
    refusals = {
        "scoring_func": ({"scoring_func": "sigmoid"}, "routing scheme flagstop does not run"),
        "topk_method": ({"topk_method": "noaux_tc"}, "routing scheme"),
        "num_experts_per_tok": ({"num_experts_per_tok": 5}, "must be 1..4 experts"),
        "moe_intermediate_size": ({"moe_intermediate_size": None}, "positive integer"),
        "hidden_act": ({"hidden_act": "gelu"}, "MLPs run silu"),
    }
    for field, (change, message) in refusals.items():
        with pytest.raises(ConfigError, match=rf"^{field}=.*{message}"):
            ModelConfig.from_hf({**base, **change})


def test_qwen_moe_layers_are_sparse_by_mlp_only_layers_and_the_sparse_step():
    hf = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
          "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
          "decoder_sparse_step": 2, "mlp_only_layers": [3]}  # fmt: skip
    moe = ModelConfig.from_hf(hf).moe
    assert moe.sparse_layers == (False, True, False, False, False, True)
    assert moe.shared_expert_intermediate_size == 0 and not moe.routing.renormalize
