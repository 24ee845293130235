"""Write a random LoRA adapter for a checkpoint, in PEFT's layout (adapter_config.json
and adapter_model.safetensors, the tensors named as peft's save_pretrained names them):
for load tests and benchmarks of many adapters, where peft itself is not needed.

    python -m tools.make_adapter --base models/flagstop-tiny --out DIR [--rank 16]
        [--targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj] [--seed 0]
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from flagstop.executor.lora.adapter import MLP, MODULES, base_shape
from flagstop.executor.models.config import ModelConfig


def write_adapter(base: Path, out: Path, rank: int = 16, targets=MODULES, seed: int = 0,
                  scale: float = 0.05) -> Path:  # fmt: skip
    config = ModelConfig.from_pretrained(base)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            if module in MLP and config.moe is not None and config.moe.sparse_layers[layer]:
                continue
            out_features, in_features = base_shape(module, config)
            block = "mlp" if module in MLP else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) * scale
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out_features, rank, generator=g) * scale
            )
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
                "target_modules": list(targets), "bias": "none", "use_rslora": False,
                "base_model_name_or_path": str(base), "task_type": "CAUSAL_LM"}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, default=Path("models/flagstop-tiny"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=",".join(MODULES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    targets = tuple(args.targets.split(","))
    if unknown := set(targets) - set(MODULES):
        raise SystemExit(f"--targets: {', '.join(sorted(unknown))} not among {', '.join(MODULES)}")
    print(f"wrote {write_adapter(args.base, args.out, args.rank, targets, args.seed)}")


if __name__ == "__main__":
    main()
