"""What a checkpoint's `quantization_config` says each linear layer is: read once at
start-up into one `LinearScheme` per layer (or None: the layer is in the model's dtype),
refusing with the field's name whatever flagstop does not run.

Formats, as the tools that write them lay them out on disk (quant_formats.py reads them):
- `fp8` (transformers' fine-grained FP8, Qwen3-*-FP8, DeepSeek): e4m3 weights with
  `weight_scale_inv` block scales (`weight_block_size`) and activations quantized per
  token group at run time; without a block size, one scale a tensor (`weight_scale`) and
  `activation_scheme` static (`input_scale`) or dynamic per token.
- `compressed-tensors` (llm-compressor): `config_groups` of weights (int 4/8 or float 8;
  tensor, channel, group or block) and input activations (none, dynamic per token or
  group, static per tensor), in the formats int-quantized, float-quantized,
  pack-quantized and naive-quantized; `ignore` names layers left unquantized.
- `gptq` (AutoGPTQ / GPTQModel, 4-bit, `desc_act` false) and `awq` (AutoAWQ, GEMM packing).
"""

import re
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A config.json flagstop cannot run: the message names the field."""


@dataclass(slots=True, frozen=True)
class ActScheme:
    """How a layer's input is quantized before its GEMM: to `kind` ("int8" or "fp8"),
    per token (group 0), per `group` input columns, or with the checkpoint's one static
    scale (`static`)."""

    kind: str
    group: int = 0
    static: bool = False


@dataclass(slots=True, frozen=True)
class LinearScheme:
    """A quantized linear layer as flagstop holds it: weights of `bits` (8: `kind` int8 or
    fp8; 4: int4 with zero points when not `symmetric`), one scale per output row and
    `group` input columns (0: the whole row, per channel or per tensor), the on-disk
    `layout` to convert from, and the input's quantization (None: weight-only)."""

    layout: str  # fp8-block, fp8-tensor, ct-int, ct-float, ct-pack, gptq, awq
    bits: int
    kind: str  # "int8", "fp8" or "int4"
    group: int
    symmetric: bool
    act: ActScheme | None = None
    block: tuple[int, int] | None = None  # fp8's weight_block_size (rows, columns)
    gptq_zero_offset: int = 1  # GPTQ v1 stores zero points minus one


@dataclass(slots=True, frozen=True)
class QuantConfig:
    """The checkpoint's schemes: `schemes` of (target, scheme) in the config's order
    (a target is a layer-name regex, `re:`, a layer name, or "Linear"), and `ignore`
    (the same forms) of layers left in the model's dtype."""

    method: str
    schemes: tuple[tuple[str, LinearScheme], ...]
    ignore: tuple[str, ...]

    def scheme_for(self, layer: str) -> LinearScheme | None:
        """The scheme of a linear layer by its checkpoint name (`model.layers.0.mlp.down_proj`);
        only linear layers are asked ("Linear" matches any)."""
        if any(_matches(pattern, layer) for pattern in self.ignore):
            return None
        for target, scheme in self.schemes:
            if _matches(target, layer):
                return scheme
        return None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "QuantConfig | None":
        q = hf.get("quantization_config") or hf.get("compression_config")
        if not q:
            return None
        method = q.get("quant_method")
        readers = {"fp8": _fp8, "compressed-tensors": _compressed_tensors,
                   "gptq": _gptq, "awq": _awq, "mxfp4": _mxfp4}  # fmt: skip
        if method not in readers:
            raise ConfigError(
                f"quantization_config.quant_method={method!r}: flagstop reads "
                f"{', '.join(sorted(readers))}"
            )
        return readers[method](q)


def _matches(pattern: str, layer: str) -> bool:
    if pattern == "Linear":  # every linear layer (compressed-tensors' class target)
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], layer) is not None
    return layer == pattern or layer.endswith("." + pattern) or layer.startswith(pattern + ".")


def _refuse(field: str, value: Any, runs: str) -> ConfigError:
    return ConfigError(f"quantization_config.{field}={value!r}: flagstop runs {runs}")


def _mxfp4(q: dict[str, Any]) -> QuantConfig:
    """gpt-oss: only the stacked experts are MXFP4 (*_blocks, *_scales), which the
    loader dequantizes to the model's dtype; every linear layer is as it is."""
    return QuantConfig("mxfp4", (), ())


def _fp8(q: dict[str, Any]) -> QuantConfig:
    if (fmt := q.get("fmt", "e4m3")) != "e4m3":
        raise _refuse("fmt", fmt, "e4m3 FP8")
    activation = q.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise _refuse("activation_scheme", activation, "dynamic or static activations")
    block = q.get("weight_block_size")
    if block is not None:
        if activation != "dynamic" or len(block) != 2 or min(block) <= 0:
            raise _refuse("weight_block_size", block, "[rows, columns] with dynamic activations")
        act = ActScheme("fp8", group=block[1])
        scheme = LinearScheme("fp8-block", 8, "fp8", block[1], True, act, block=tuple(block))
    else:
        scheme = LinearScheme("fp8-tensor", 8, "fp8", 0, True,
                              ActScheme("fp8", static=activation == "static"))  # fmt: skip
    ignore = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
    return QuantConfig("fp8", (("Linear", scheme),), _with_lm_head(ignore))


def _with_lm_head(ignore) -> tuple[str, ...]:
    """The ignore list of a format whose tools leave the output embedding unquantized
    (transformers' fp8, GPTQ without lm_head, AWQ)."""
    return (*(ignore or ()), "lm_head")


CT_LAYOUTS = {
    "int-quantized": "ct-int",
    "float-quantized": "ct-float",
    "naive-quantized": None,  # int or float by the weights' type
    "pack-quantized": "ct-pack",
}


def _compressed_tensors(q: dict[str, Any]) -> QuantConfig:
    if q.get("sparsity_config"):
        raise _refuse("sparsity_config", "...", "dense compressed-tensors checkpoints")
    if q.get("transform_config"):
        raise _refuse("transform_config", "...", "checkpoints without transforms")
    schemes = []
    for name, group in (q.get("config_groups") or {}).items():
        scheme = _ct_scheme(f"config_groups.{name}", group, group.get("format") or q.get("format"))
        schemes += [(target, scheme) for target in group.get("targets") or ()]
    if not schemes:
        raise _refuse("config_groups", q.get("config_groups"), "at least one quantized group")
    return QuantConfig("compressed-tensors", tuple(schemes), tuple(q.get("ignore") or ()))


def _ct_scheme(where: str, group: dict[str, Any], fmt: str | None) -> LinearScheme:
    w = group.get("weights") or {}
    if fmt not in CT_LAYOUTS:
        raise _refuse(f"{where}.format", fmt, ", ".join(CT_LAYOUTS))
    if group.get("output_activations"):
        raise _refuse(f"{where}.output_activations", "...", "unquantized outputs")
    bits, kind = w.get("num_bits"), w.get("type", "int")
    if (bits, kind) not in ((8, "int"), (8, "float"), (4, "int")):
        raise _refuse(f"{where}.weights", f"{kind}{bits}", "int8, fp8 (float8) or int4 weights")
    if w.get("actorder") not in (None, "static", "weight"):
        raise _refuse(f"{where}.weights.actorder", w["actorder"], "groups in column order")
    symmetric = w.get("symmetric", True)
    if not symmetric and bits == 8:
        raise _refuse(f"{where}.weights.symmetric", False, "symmetric 8-bit weights")
    strategy, group_size = w.get("strategy", "tensor"), 0
    block = None
    if strategy == "group":
        group_size = w.get("group_size") or 0
    elif strategy == "block":
        block = tuple(w.get("block_structure") or ())
        group_size = block[1] if len(block) == 2 else 0
    elif strategy not in ("tensor", "channel"):
        raise _refuse(f"{where}.weights.strategy", strategy, "tensor, channel, group or block")
    if strategy in ("group", "block") and group_size <= 0:
        raise _refuse(f"{where}.weights", w, "a positive group size or block")
    layout = CT_LAYOUTS[fmt] or ("ct-float" if kind == "float" else "ct-int")
    if bits == 4 and layout != "ct-pack":
        raise _refuse(f"{where}.format", fmt, "4-bit weights pack-quantized")
    act = _ct_act(f"{where}.input_activations", group.get("input_activations"))
    if bits == 4 and act is not None:
        raise _refuse(f"{where}.input_activations", "...", "4-bit weights with 16-bit activations")
    return LinearScheme(layout, bits, "int4" if bits == 4 else "fp8" if kind == "float" else "int8",
                        group_size, symmetric, act, block)  # fmt: skip


def _ct_act(where: str, a: dict[str, Any] | None) -> ActScheme | None:
    if not a:
        return None
    kind = {(8, "int"): "int8", (8, "float"): "fp8"}.get((a.get("num_bits"), a.get("type", "int")))
    if kind is None:
        raise _refuse(where, f"{a.get('type')}{a.get('num_bits')}", "int8 or fp8 activations")
    if not a.get("symmetric", True):
        raise _refuse(f"{where}.symmetric", False, "symmetric activations")
    strategy, dynamic = a.get("strategy", "tensor"), a.get("dynamic", False)
    if dynamic is True and strategy == "token":
        return ActScheme(kind)
    if dynamic is True and strategy == "group" and (a.get("group_size") or 0) > 0:
        return ActScheme(kind, group=a["group_size"])
    if dynamic is False and strategy == "tensor":
        return ActScheme(kind, static=True)
    raise _refuse(where, f"strategy={strategy} dynamic={dynamic}",
                  "dynamic per-token or per-group, or static per-tensor activations")  # fmt: skip


def _int4_bits(q: dict[str, Any]) -> None:
    if (bits := q.get("bits", q.get("w_bit"))) != 4:
        raise _refuse("bits", bits, "4-bit GPTQ and AWQ")


def _gptq(q: dict[str, Any]) -> QuantConfig:
    _int4_bits(q)
    if q.get("lm_head"):
        raise _refuse("lm_head", True, "GPTQ with lm_head unquantized")
    if q.get("desc_act"):
        raise _refuse("desc_act", True, "GPTQ with desc_act false (groups in column order)")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, "gptq and gptq_v2")
    group = q.get("group_size", 128)
    scheme = LinearScheme("gptq", 4, "int4", max(group, 0), q.get("sym", True),
                          gptq_zero_offset=1 if fmt == "gptq" else 0)  # fmt: skip
    return QuantConfig(
        "gptq", (("Linear", scheme),), _with_lm_head(q.get("modules_to_not_convert"))
    )


def _awq(q: dict[str, Any]) -> QuantConfig:
    _int4_bits(q)
    if (version := str(q.get("version", "gemm")).lower()) != "gemm":
        raise _refuse("version", version, "AWQ's GEMM packing")
    if not q.get("zero_point", True):
        raise _refuse("zero_point", False, "AWQ with zero points")
    group = q.get("group_size", q.get("q_group_size", 128))
    scheme = LinearScheme("awq", 4, "int4", max(group, 0), False)
    return QuantConfig("awq", (("Linear", scheme),), _with_lm_head(q.get("modules_to_not_convert")))
