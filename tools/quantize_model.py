"""Quantize a checkpoint into one of the formats people serve, laid out on disk as the
tools that define them write it: the test subjects and bench rows of quantized serving.

    python -m tools.quantize_model --scheme SCHEME [--src models/flagstop-tiny] [--out DIR]
        [--group-size 128|64|32]

compressed-tensors schemes are made by compressed-tensors itself (its preset schemes,
applied to the transformers model, scales from each weight's min/max, static activation
scales from a calibration pass over seeded random tokens, then its compressor): w8a8
(int8 per channel, activations per token), w8a16, w4a16 and w4a16-asym (int4, groups of
128, pack-quantized), fp8 (per tensor, static activations), fp8-dynamic (per channel,
per token) and fp8-block (128x128, activations per 128-column group). The other formats
have no installable writer here and follow their documented layouts:
- fp8-hf: transformers' fine-grained FP8 (quant_method fp8, as Qwen3-*-FP8 ship):
  e4m3 weights, weight_scale_inv [ceil(out/128), ceil(in/128)] = each block's amax / 448.
- gptq: AutoGPTQ's v1 format, 4-bit, group 128, desc_act false (qweight packed along the
  inputs, qzeros minus one packed along the outputs).
- awq: AutoAWQ's GEMM format (qweight and qzeros packed along the outputs in its order).
gptq, awq and fp8-hf take --group-size (the block's side for fp8-hf), as AutoGPTQ's and
AutoAWQ's group_size: 128 by default, or the largest of 64 and 32 that divides every
layer's inputs. A smaller group lets more tensor-parallel ranks cut the inputs between
groups (a group never straddles two ranks).
"""

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from flagstop.executor.models.quant_formats import AWQ_ORDER, pack_int4

CT_PRESETS = {
    "w8a8": "W8A8", "w8a16": "W8A16", "w4a16": "W4A16", "w4a16-asym": "W4A16_ASYM",
    "fp8": "FP8", "fp8-dynamic": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK",
}  # fmt: skip
SCHEMES = (*CT_PRESETS, "fp8-hf", "gptq", "awq")
GROUP = 128
CALIBRATION_TOKENS = (4, 64)  # sequences x tokens of the static scales' calibration pass


def default_out(src: Path, scheme: str) -> Path:
    return src.parent / f"{src.name}-{scheme}"


def load(src: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def _linears(model) -> list[tuple[str, torch.nn.Linear]]:
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n != "lm_head"]  # fmt: skip


def compressed_tensors(model, preset: str, out: Path) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    scheme = preset_name_to_scheme(preset, ["Linear"])
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                quantization_status=QuantizationStatus.INITIALIZED)  # fmt: skip
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for _, module in _linears(model):
            _weight_qparams(module)
        _calibrate_inputs(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    _save(model.state_dict(), out)
    compressor.update_config(str(out))


def _weight_qparams(module) -> None:
    """Scales (and zero points) from the weight's min/max, by the scheme's strategy."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args, w = module.quantization_scheme.weights, module.weight
    if args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "group":
        groups = w.unflatten(1, (-1, args.group_size))
        lo, hi = groups.amin(-1), groups.amax(-1)
    elif args.strategy == "block":
        rows, cols = args.block_structure
        blocks = w.unflatten(0, (-1, rows)).unflatten(2, (-1, cols))
        lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero = calculate_qparams(lo, hi, args)
    module.weight_scale.copy_(scale)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.copy_(zero)


def _calibrate_inputs(model) -> None:
    """Static activation scales: each layer's input amax over seeded random tokens."""
    from compressed_tensors.quantization.utils import calculate_qparams

    static = [(n, m) for n, m in _linears(model)
              if (a := m.quantization_scheme.input_activations) and not a.dynamic]  # fmt: skip
    if not static:
        return
    amax: dict[str, torch.Tensor] = {}

    def observe(name):
        def hook(_module, args):
            seen = args[0].detach().abs().amax()
            amax[name] = torch.maximum(amax.get(name, seen), seen)

        return hook

    hooks = [m.register_forward_pre_hook(observe(n)) for n, m in static]
    for module in model.modules():  # calibrate on the float model
        module.quantization_enabled = False
    ids = torch.randint(0, model.config.vocab_size, CALIBRATION_TOKENS,
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    model(ids)
    for module in model.modules():
        module.quantization_enabled = True
    for hook in hooks:
        hook.remove()
    for name, module in static:
        args = module.quantization_scheme.input_activations
        scale, _ = calculate_qparams(-amax[name].reshape(1), amax[name].reshape(1), args)
        module.input_scale.copy_(scale)


# The documented layouts are written from the checkpoint's own tensors (its on-disk
# names: transformers fuses MoE experts in memory only): every 2-D weight of a decoder
# layer but a Mixture-of-Experts router's.
LINEAR_WEIGHT = re.compile(r"^model\.layers\.\d+\..+\.weight$")
# Routers, and DeepSeek's prediction layer's embedding, head and eh_proj (its FP8
# checkpoints keep them in bf16).
ROUTERS = (
    ".mlp.gate.weight",
    ".block_sparse_moe.gate.weight",
    ".shared_expert_gate.weight",
    ".embed_tokens.weight",
    ".shared_head.head.weight",
    ".eh_proj.weight",
)
UNQUANTIZED = ["lm_head", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$",
               "re:.*shared_expert_gate$", "re:.*embed_tokens$", "re:.*shared_head\\.head$",
               "re:.*eh_proj$"]  # fmt: skip


def linear_weights(state: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, t in state.items() if t.dim() == 2 and LINEAR_WEIGHT.match(name)
            and not name.endswith(ROUTERS)]  # fmt: skip


def fp8_hf(state: dict[str, torch.Tensor], out: Path, group: int | None) -> None:
    # Blocks of 128 (64 for the small MoE's experts): the activations are quantized by
    # groups of a block's columns, which must divide every layer's inputs.
    block = int4_group(state, names := linear_weights(state), group)
    for name in names:
        w = state[name].float()
        blocks = _pad_to(w, block).unflatten(0, (-1, block)).unflatten(2, (-1, block))
        scale = blocks.abs().amax((1, 3)).clamp(min=1e-12) / 448.0
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        full = full[: w.shape[0], : w.shape[1]]
        state[name] = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        state[f"{name}_scale_inv"] = scale
    _save(state, out)
    _set_quantization(out, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [block, block],
                            "modules_to_not_convert": UNQUANTIZED})  # fmt: skip


def _pad_to(w: torch.Tensor, multiple: int) -> torch.Tensor:
    rows, cols = (-(-n // multiple) * multiple for n in w.shape)
    return torch.nn.functional.pad(w, (0, cols - w.shape[1], 0, rows - w.shape[0]))


def int4_group(state: dict[str, torch.Tensor], names: list[str], group: int | None) -> int:
    """`group` inputs a group (or block), else 128, or the largest of 64 and 32 that
    divides every layer's inputs (the small MoE checkpoints' experts have 192)."""
    fits = [g for g in (GROUP, 64, 32) if all(state[n].shape[1] % g == 0 for n in names)]
    group = group or next(iter(fits), 32)
    if group not in fits:
        widths = sorted({state[n].shape[1] for n in names})
        raise SystemExit(
            f"groups of {group} inputs (--group-size) must divide every layer's inputs {widths}"
        )
    return group


def int4_groups(w: torch.Tensor, symmetric: bool, group: int = GROUP):
    """(q [out, in] 0..15, scale [out, G], zero [out, G] 0..15) by groups of `group`
    inputs (GPTQ's and AWQ's min/max quantizer: sym, zero 8; else the range's own zero)."""
    groups = w.unflatten(1, (-1, group))
    if symmetric:
        scale = groups.abs().amax(-1).clamp(min=1e-12) / 7.5
        zero = torch.full_like(scale, 8)
    else:
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        zero = (-lo / scale).round().clamp(0, 15)
    q = (groups / scale.unsqueeze(-1) + zero.unsqueeze(-1)).round().clamp(0, 15)
    return q.flatten(1).to(torch.uint8), scale, zero.to(torch.uint8)


def gptq(state: dict[str, torch.Tensor], out: Path, group: int | None) -> None:
    group = int4_group(state, names := linear_weights(state), group)
    for name in names:
        layer = name.removesuffix(".weight")
        q, scale, zero = int4_groups(state.pop(name).float(), True, group)
        state[f"{layer}.qweight"] = pack_int4(q).t().contiguous()  # [in / 8, out]
        state[f"{layer}.qzeros"] = pack_int4(zero.t() - 1)  # v1 stores zero - 1
        state[f"{layer}.scales"] = scale.t().contiguous().half()
        state[f"{layer}.g_idx"] = torch.arange(q.shape[1], dtype=torch.int32) // group
    _save(state, out)
    _set_quantization(out, {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True,
                            "desc_act": False, "checkpoint_format": "gptq",
                            "modules_to_not_convert": UNQUANTIZED[1:]})  # fmt: skip


def awq(state: dict[str, torch.Tensor], out: Path, group: int | None) -> None:
    group = int4_group(state, names := linear_weights(state), group)
    for name in names:
        layer = name.removesuffix(".weight")
        q, scale, zero = int4_groups(state.pop(name).float(), False, group)
        state[f"{layer}.qweight"] = _awq_pack(q.t())
        state[f"{layer}.qzeros"] = _awq_pack(zero.t())
        state[f"{layer}.scales"] = scale.t().contiguous().half()
    _save(state, out)
    _set_quantization(out, {"quant_method": "awq", "bits": 4, "group_size": group,
                            "zero_point": True, "version": "gemm",
                            "modules_to_not_convert": UNQUANTIZED[1:]})  # fmt: skip


def _awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] packed along the columns in AWQ's order: column 8w + ORDER[j] in
    nibble j of word w."""
    order = torch.tensor(AWQ_ORDER)
    reordered = values.unflatten(1, (-1, 8))[:, :, order].flatten(1)
    return pack_int4(reordered.contiguous())


def _save(state: dict[str, torch.Tensor], out: Path) -> None:
    tensors = {k: v.contiguous() for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _set_quantization(out: Path, quantization: dict) -> None:
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = quantization
    path.write_text(json.dumps(config, indent=2) + "\n")


def quantize(src: Path, scheme: str, out: Path, group_size: int | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            shutil.copy(file, out / file.name)
    config = json.loads((src / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        raise SystemExit(f"{src}: tied embeddings; quantize an untied checkpoint")
    if scheme not in CT_PRESETS:
        state = load_file(src / "model.safetensors")
        {"fp8-hf": fp8_hf, "gptq": gptq, "awq": awq}[scheme](state, out, group_size)
    elif any(a.endswith("MoeForCausalLM") or "Mixtral" in a for a in config["architectures"]):
        raise SystemExit(f"{scheme}: compressed-tensors quantizes nn.Linear modules, and "
                         "transformers fuses MoE experts; use fp8-hf, gptq or awq")  # fmt: skip
    elif group_size is not None:
        raise SystemExit(f"--group-size: {scheme} is compressed-tensors' preset (groups of 128)")
    else:
        compressed_tensors(load(src), CT_PRESETS[scheme], out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", choices=SCHEMES, required=True)
    parser.add_argument("--src", type=Path, default=Path("models/flagstop-tiny"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--group-size", type=int, choices=(128, 64, 32))
    args = parser.parse_args()
    out = args.out or default_out(args.src, args.scheme)
    out = quantize(args.src, args.scheme, out, args.group_size)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
