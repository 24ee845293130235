"""Load Hugging Face `*.safetensors` weights into our packed modules by HF names. Under
tensor parallelism each rank reads only its own slice of each tensor (safetensors'
get_slice reads the bytes of the slice, never the whole tensor)."""

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from flagstop.executor.models import onednn
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.llama import LlamaForCausalLM
from flagstop.executor.parallel import SINGLE, Shard, TensorParallel

# HF name fragment -> (our module, index of the part inside the packed tensor)
PACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
VOCAB = ("embed_tokens.weight", "lm_head.weight")


def our_name(hf_name: str) -> tuple[str, int | None]:
    name = hf_name.removeprefix("model.")
    for hf, (ours, part) in PACKED.items():
        if f".{hf}." in name:
            return name.replace(hf, ours), part
    return name, None


def rank_slice(
    name: str, part: int | None, c: ModelConfig, shard: Shard
) -> tuple[int, int, int] | None:
    """(dim, start, length) of the checkpoint tensor this rank holds; None: all of it."""
    d = c.head_dim
    if "qkv_proj" in name:
        first, count = shard.heads(c.num_heads) if part == 0 else shard.kv_heads(c.num_kv_heads)
        return 0, first * d, count * d
    if "gate_up_proj" in name:
        return (0, *shard.split(c.intermediate_size))
    if name.endswith("o_proj.weight"):
        first, count = shard.heads(c.num_heads)
        return 1, first * d, count * d
    if name.endswith("down_proj.weight"):
        return (1, *shard.split(c.intermediate_size))
    if name in VOCAB:
        first, rows = shard.vocab(c.vocab_size)
        return 0, first, max(0, min(rows, c.vocab_size - first))
    return None


def packed_offset(name: str, part: int | None, c: ModelConfig, shard: Shard) -> int:
    """Where a part starts in our packed tensor (rows)."""
    if not part:
        return 0
    if "gate_up_proj" in name:
        return shard.split(c.intermediate_size)[1]
    q, kv = shard.heads(c.num_heads)[1] * c.head_dim, shard.kv_heads(c.num_kv_heads)[1] * c.head_dim
    return q + (part - 1) * kv


def read(f, hf_name: str, region: tuple[int, int, int] | None, full_rows: int | None):
    """The region of a tensor; full_rows: how many rows the whole tensor must have."""
    if region is None:
        return f.get_tensor(hf_name)
    piece = f.get_slice(hf_name)
    if full_rows is not None and piece.get_shape()[0] != full_rows:
        raise ValueError(f"{hf_name}: {piece.get_shape()[0]} rows, the vocabulary has {full_rows}")
    dim, start, length = region
    return piece[start : start + length] if dim == 0 else piece[:, start : start + length]


def load_weights(model: LlamaForCausalLM, model_dir: str | Path) -> None:
    params = dict(model.named_parameters())
    config, shard = model.config, model.tp.shard
    loaded: set[str] = set()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if "rotary_emb.inv_freq" in hf_name:
                    continue
                name, part = our_name(hf_name)
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                if name not in params:
                    raise ValueError(f"unexpected tensor {hf_name!r} in {file.name}")
                rows = config.vocab_size if name in VOCAB else None
                tensor = read(f, hf_name, rank_slice(name, part, config, shard), rows)
                _copy(params[name], tensor, name, packed_offset(name, part, config, shard))
                loaded.add(f"{name}#{part}")
    _check_complete(model, params, loaded)


def _copy(param: nn.Parameter, tensor: torch.Tensor, name: str, offset: int) -> None:
    with torch.no_grad():
        if name in VOCAB:
            param.zero_()  # rows past the vocabulary pad it to a multiple of the ranks
            target = param[: tensor.shape[0]]
        elif _is_packed(name):
            target = param[offset : offset + tensor.shape[0]]
        else:
            target = param
        if target.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(target.shape)}"
            )
        target.copy_(tensor)


def _is_packed(name: str) -> bool:
    return any(ours in name for ours, _ in PACKED.values())


def _check_complete(model: LlamaForCausalLM, params: dict, loaded: set[str]) -> None:
    expected = set()
    for name in params:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        num_parts = 3 if "qkv_proj.weight" in name or "qkv_proj.bias" in name else 2
        expected |= (
            {f"{name}#{i}" for i in range(num_parts)} if _is_packed(name) else {f"{name}#None"}
        )
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE
) -> LlamaForCausalLM:
    config = ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    # Built on meta, so no memory is spent on a random init the checkpoint overwrites.
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gives the tied parameters separate storage
    load_weights(model, model_dir)
    model.rotary.build(device)
    model = model.to(dtype=dtype).eval()
    if onednn.usable(device, dtype):
        onednn.pack(model, shared={id(model.embed_tokens.weight)})
    return model
