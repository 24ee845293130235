"""A LoRA adapter in PEFT's layout, read and checked against the base model: the
directory's adapter_config.json and adapter_model.safetensors (or .bin refused), as
peft's save_pretrained writes them. Pure: host tensors, no device."""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from flagstop.adapters import LoadedAdapter, adapter_digest
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.quantization import ConfigError

# The base model's linear layers an adapter may target, by PEFT's module names.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION + MLP
# base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight
TENSOR = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# adapter_config.json fields that change what the weights compute: refused unless off.
UNSUPPORTED = {
    "use_dora": False, "lora_bias": False, "fan_in_fan_out": False, "bias": "none",
    "modules_to_save": None, "alpha_pattern": {}, "layer_replication": None,
    "trainable_token_indices": None, "use_qalora": False, "alora_invocation_tokens": None,
    "target_parameters": None,
}  # fmt: skip


class AdapterError(ConfigError):
    """An adapter that cannot be served on this base model: the message names the file
    and the field or tensor."""


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter, whole (every rank slices its share): weights[(layer, module)] =
    (A [r, in], B [out, r]) float32, B already multiplied by the scaling (alpha / r,
    or alpha / sqrt(r) with rslora), as the merged weight W + scaling * B @ A has it."""

    name: str
    path: str
    digest: str  # its identity (flagstop.adapters.adapter_digest)
    rank: int  # the largest of its modules' ranks
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> list[str]:
        return sorted({module for _, module in self.weights}, key=MODULES.index)

    def summary(self) -> LoadedAdapter:
        return LoadedAdapter(self.path, self.digest, self.rank, tuple(self.modules))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter in `path`, checked against the base model `config`: every tensor
    one of MODULES' A or B with the base layer's shape, its rank at most max_rank."""
    path = Path(path)
    settings = _read_config(path)
    digest = adapter_digest(path)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterError(f"{path}: no adapter_model.safetensors (peft's save_pretrained "
                           "writes it; convert a .bin with safetensors first)")  # fmt: skip
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is no dict)
            layer, module, which = _parse(key, config, weights_file)
            pairs.setdefault((layer, module), {})[which] = f.get_tensor(key).float()
    if not pairs:
        raise AdapterError(f"{weights_file}: no LoRA tensors")
    weights = {}
    for (layer, module), pair in sorted(pairs.items()):
        weights[layer, module] = _checked(pair, layer, module, config, settings, weights_file)
        rank = weights[layer, module][0].shape[0]
        if rank > max_rank:
            raise AdapterError(f"{weights_file}: layer {layer} {module} has rank {rank}, "
                               f"above --max-lora-rank {max_rank}")  # fmt: skip
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoRAAdapter(name, str(path), digest, rank, weights)


def _read_config(path: Path) -> dict:
    file = path / "adapter_config.json"
    try:
        settings = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path}: no adapter_config.json (not a PEFT adapter)") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"{file}: {e}") from None
    if settings.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{file}: peft_type={settings['peft_type']!r}; only LORA is served")
    for field, off in UNSUPPORTED.items():
        value = settings.get(field, off)
        if value != off and value not in (None, [], {}):
            raise AdapterError(f"{file}: {field}={value!r} is not supported (only plain LoRA "
                               f"on {', '.join(MODULES)})")  # fmt: skip
    if not isinstance(settings.get("lora_alpha", 8), int | float):
        raise AdapterError(f"{file}: lora_alpha={settings['lora_alpha']!r} is not a number")
    return settings


def _parse(key: str, config: ModelConfig, file: Path) -> tuple[int, str, str]:
    match = TENSOR.match(key)
    if match is None or match[3] not in MODULES:
        raise AdapterError(f"{file}: tensor {key!r} is not a LoRA A/B of "
                           f"{', '.join(MODULES)}")  # fmt: skip
    layer, block, module, which = int(match[1]), match[2], match[3], match[4]
    if (block == "mlp") != (module in MLP) or layer >= config.num_layers:
        raise AdapterError(f"{file}: tensor {key!r}: the base model has no such layer")
    if module in MLP and config.moe is not None and config.moe.sparse_layers[layer]:
        raise AdapterError(f"{file}: tensor {key!r}: layer {layer}'s MLP is a mixture of "
                           "experts; LoRA on experts is not served")  # fmt: skip
    return layer, module, which


def _checked(pair, layer: int, module: str, config: ModelConfig, settings: dict, file: Path):
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{file}: layer {layer} {module} has lora_{''.join(pair)} alone")
    a, b = pair["A"], pair["B"]
    out_features, in_features = base_shape(module, config)
    rank = a.shape[0]
    if a.shape != (rank, in_features) or b.shape != (out_features, rank):
        raise AdapterError(f"{file}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B "
                           f"{tuple(b.shape)} do not fit the base layer's [{out_features}, "
                           f"{in_features}] (an adapter of another model?)")  # fmt: skip
    alpha = settings.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    return a.contiguous(), (b * scaling).contiguous()


def base_shape(module: str, c: ModelConfig) -> tuple[int, int]:
    """(out_features, in_features) of the base model's module, whole."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "q_proj": (q, c.hidden_size), "k_proj": (kv, c.hidden_size),
        "v_proj": (kv, c.hidden_size), "o_proj": (c.hidden_size, q),
        "gate_proj": (c.intermediate_size, c.hidden_size),
        "up_proj": (c.intermediate_size, c.hidden_size),
        "down_proj": (c.hidden_size, c.intermediate_size),
    }[module]  # fmt: skip
