"""Load Hugging Face `*.safetensors` weights into our packed modules by HF names."""

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.llama import LlamaForCausalLM

# HF name fragment -> (our module, index of the shard inside the packed tensor)
PACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def our_name(hf_name: str) -> tuple[str, int | None]:
    name = hf_name.removeprefix("model.")
    for hf, (ours, shard) in PACKED.items():
        if f".{hf}." in name:
            return name.replace(hf, ours), shard
    return name, None


def shard_bounds(model: LlamaForCausalLM, module_name: str, shard: int) -> tuple[int, int]:
    c = model.config
    if "qkv_proj" in module_name:
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
    return shard * c.intermediate_size, (shard + 1) * c.intermediate_size


def load_weights(model: LlamaForCausalLM, model_dir: str | Path) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if "rotary_emb.inv_freq" in hf_name:
                    continue
                name, shard = our_name(hf_name)
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue
                if name not in params:
                    raise ValueError(f"unexpected tensor {hf_name!r} in {file.name}")
                _copy(params[name], f.get_tensor(hf_name), model, name, shard)
                loaded.add(f"{name}#{shard}")
    _check_complete(model, params, loaded)


def _copy(param: nn.Parameter, tensor: torch.Tensor, model, name: str, shard: int | None) -> None:
    with torch.no_grad():
        target = param if shard is None else param[slice(*shard_bounds(model, name, shard))]
        if target.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(target.shape)}"
            )
        target.copy_(tensor)


def _check_complete(model: LlamaForCausalLM, params: dict, loaded: set[str]) -> None:
    expected = set()
    for name in params:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        num_shards = 3 if "qkv_proj.weight" in name or "qkv_proj.bias" in name else 2
        packed = any(ours in name for ours, _ in PACKED.values())
        expected |= {f"{name}#{i}" for i in range(num_shards)} if packed else {f"{name}#None"}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    config = ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Built on meta, so no memory is spent on a random init the checkpoint overwrites.
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gives the tied parameters separate storage
    load_weights(model, model_dir)
    model.rotary.build(device)
    return model.to(dtype=dtype).eval()
