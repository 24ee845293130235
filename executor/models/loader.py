"""Load Hugging Face `*.safetensors` weights into our packed modules by HF names. Under
tensor parallelism each rank reads only its own slice of each tensor (safetensors'
get_slice reads the bytes of the slice, never the whole tensor). Where each tensor
goes and which slice: sharding.py; quantized layers, KV scales and stacked experts:
quantized_load.py."""

import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from flagstop.executor.models import linear, onednn
from flagstop.executor.models.checkpoint_files import checkpoint_files, open_checkpoint
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.decoder import Decoder
from flagstop.executor.models.quantized_load import (
    KV_SCALE,
    MXFP4,
    STACKED,
    QuantizedLayers,
    dequantized,
    take_kv_scale,
    take_stacked,
)
from flagstop.executor.models.sharding import (
    VOCAB,
    Target,
    copy_part,
    packed_offset,
    parts,
    rank_slice,
    target,
)
from flagstop.executor.parallel import SINGLE, TensorParallel
from flagstop.kernels import torch_attention


def read(f, hf_name: str, region: tuple[int, int, int] | None, full_rows: int | None):
    """The region of a tensor; full_rows: how many rows the whole tensor must have."""
    if region is None:
        return f.get_tensor(hf_name)
    piece = f.get_slice(hf_name)
    if full_rows is not None and piece.get_shape()[0] != full_rows:
        raise ValueError(f"{hf_name}: {piece.get_shape()[0]} rows, the vocabulary has {full_rows}")
    dim, start, length = region
    return piece[start : start + length] if dim == 0 else piece[:, start : start + length]


# A decoder layer's tensors by its index: those at num_hidden_layers and beyond are
# multi-token-prediction layers (DeepSeek's, GLM-4.5's), as are Qwen3-Next's and
# Qwen3.5's `mtp.*`: the main model skips them (as transformers does) and the `mtp`
# drafter loads them (executor/speculative/mtp.py).
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# A vision-language checkpoint's image encoder's tensors: not the language model's.
VISION_TENSORS = tuple(
    f"{model}{name}."
    for model in ("", "model.")
    for name in ("visual", "vision_tower", "multi_modal_projector")
)
# A bare backbone's tensors (an embedding model's checkpoint: transformers' Qwen3Model
# saves them without the causal LM's "model." prefix).
BACKBONE_TENSORS = ("embed_tokens.", "layers.", "norm.")
# A sequence classifier's head: the pooler's, not the decoder's (executor/pooler.py).
CLASSIFIER_HEAD = "score.weight"
# The name a checkpoint tensor loads as in a model (its HF form), None: not this model's.
Names = Callable[[str], str | None]


def language_name(hf_name: str) -> str:
    """A vision-language checkpoint's language model tensor as a text model's: by
    transformers 5's names (model.language_model.layers) or the older ones
    (language_model.model.layers, language_model.lm_head)."""
    if hf_name.startswith("model.language_model."):
        return "model." + hf_name.removeprefix("model.language_model.")
    return hf_name.removeprefix("language_model.")


def main_layers(num_layers: int) -> Names:
    """The main model's tensors: every one but the prediction layers'."""

    def name(hf_name: str) -> str | None:
        if hf_name.startswith(("mtp.", *VISION_TENSORS)) or hf_name == CLASSIFIER_HEAD:
            return None  # an image encoder's (models/vision.py loads them), the head's
        if hf_name.startswith(BACKBONE_TENSORS):  # a bare backbone's (Qwen3Model's)
            hf_name = "model." + hf_name
        hf_name = language_name(hf_name)
        return hf_name if (m := LAYER.match(hf_name)) is None or int(m[1]) < num_layers else None

    return name


class Renamed:
    """A safetensors file's tensors under the names `names` gives them (those it
    gives none left out), read as safe_open reads them."""

    def __init__(self, f, names: Names) -> None:
        self.f = f
        self.stored = {ours: n for n in f.keys() if (ours := names(n)) is not None}  # noqa: SIM118

    def keys(self) -> list[str]:
        return list(self.stored)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.f.get_tensor(self.stored[name])

    def get_slice(self, name: str):
        return self.f.get_slice(self.stored[name])


def load_weights(model: nn.Module, model_dir: str | Path, names: Names | None = None) -> None:
    """names: which checkpoint tensors are this model's, and as what (default: the main
    model's, as they are)."""
    names = names or main_layers(model.config.num_layers)
    params = dict(model.named_parameters())
    config, shard = model.config, model.tp.shard
    first_expert, num_experts = shard.experts(config.moe.num_experts) if config.moe else (0, 0)
    loaded: set[Target] = set()
    files = checkpoint_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors (or pytorch_model*.bin) in {model_dir}")
    quantized = QuantizedLayers(model, params, loaded)
    for file in files:
        with open_checkpoint(file) as stored:
            f = Renamed(stored, names)
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if "rotary_emb.inv_freq" in hf_name:
                    continue
                if quantized.take(f, hf_name):
                    continue
                if (kv := KV_SCALE.match(hf_name)) is not None:
                    take_kv_scale(model, int(kv[1]), kv[2], f.get_tensor(hf_name))
                    continue
                if (stacked := STACKED.match(hf_name)) is not None:
                    tensor = f.get_slice(hf_name)[first_expert : first_expert + num_experts]
                    loaded |= take_stacked(model, params, stacked, tensor)
                    continue
                if (mx := MXFP4.match(hf_name)) is not None:
                    if mx[2] == "blocks":  # with its scales, from the same file
                        experts = slice(first_expert, first_expert + num_experts)
                        tensor = dequantized(f, mx[1], experts, model.norm.weight.dtype)
                        loaded |= take_stacked(model, params, STACKED.match(mx[1]), tensor)
                    continue
                t = target(hf_name, config.mla is not None)
                if t.name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                if t.name not in params:
                    raise ValueError(f"unexpected tensor {hf_name!r} in {file.name}")
                if t.expert is not None:  # another rank's expert: never read
                    if not first_expert <= t.expert < first_expert + num_experts:
                        continue
                    t = Target(t.name, t.part, t.expert - first_expert)
                rows = config.vocab_size if t.name in VOCAB else None
                tensor = read(f, hf_name, rank_slice(t, config, shard), rows)
                copy_part(params[t.name], tensor, t, packed_offset(t, config, shard))
                loaded.add(t)
        quantized.load_complete()
    quantized.check_none_left()
    if config.pooling is not None and Target("lm_head.weight") not in loaded:
        model.lm_head.weight = model.embed_tokens.weight  # an embedding model has none
        loaded.add(Target("lm_head.weight"))
    _check_complete(model, params, loaded, num_experts)


def _check_complete(model: Decoder, params: dict, loaded: set[Target], num_experts: int):
    expected = set()
    for name in params:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        experts = range(num_experts) if ".experts." in name else (None,)
        expected |= {Target(name, part, e) for part in parts(name) for e in experts}
    missing = sorted(expected - loaded, key=str)
    if missing:
        shown = [f"{t.name}#{t.part}" + (f" of expert {t.expert}" if t.expert is not None else "")
                 for t in missing[:3]]  # fmt: skip
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {shown}")


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel = SINGLE,
    backend: ModuleType = torch_attention,
    overrides: dict | None = None,
) -> Decoder:
    """The model on `backend`'s kernels (attention's, and the experts' with it);
    overrides: config.json's fields replaced (--hf-overrides)."""
    config = ModelConfig.from_pretrained(model_dir, overrides)
    with torch.device("meta"):
        model = Decoder(config, tp)
    model = build(model, model_dir, dtype, device, backend)
    for table in model.rotary_tables:
        table.build(device)
    return model


def build(
    model: nn.Module, model_dir: str | Path, dtype: torch.dtype, device: torch.device,
    backend: ModuleType, names: Names | None = None,
) -> nn.Module:  # fmt: skip
    """A model made on meta, given its weights (those `names` takes) on `device`."""
    # Built and cast on meta, so no memory is spent on a random init the checkpoint
    # overwrites; quantized layers get their tensors after the cast (their dtypes).
    model = model.to(dtype=dtype).to_empty(device=device)
    for module in model.modules():  # DeepSeek's routing bias stays float32 (moe.py)
        if getattr(module, "e_score_correction_bias", None) is not None:
            module.e_score_correction_bias.data = module.e_score_correction_bias.float()
    linear.materialize(model, device)
    model.tie_weights()  # to_empty gives the tied parameters separate storage
    load_weights(model, model_dir, names)
    for module in model.modules():  # what layers derive from their weights (mla.py)
        if hasattr(module, "after_load"):
            module.after_load(dtype)
    model = model.eval()
    model.set_attention_backend(backend)  # before packing: the experts pack for torch's
    if onednn.usable(device, dtype):
        onednn.pack(model, shared={id(p) for p in model.shared_weights()})
    return model
