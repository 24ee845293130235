"""EAGLE-3 heads saved by the speculators library itself, for tests/test_eagle.py
(tests/data/eagle3/, committed: CI does not install the library).

    make speculators-heads   (a venv of its own: speculators 0.9 pins transformers <= 5.19)

Run with that venv's python, never flagstop's. For a target of TARGET's shape (a
small one: the files are committed) it writes:
- native/: an Eagle3DraftModel (the model class speculators trains) with seeded
  random weights, a draft vocabulary of every other token and the target's
  embedding, by its own save_pretrained;
- converted/: the original-layout head `--original` (tools/make_eagle_head.py's)
  through the library's Eagle3Converter, which loads and validates it;
- qwen3/, norm_before_fc/, fc_norm/, norm_output/: the same model class with a Qwen3
  layer (q/k norms), or with each of the config's norm variants (one RMSNorm over
  the fused states before fc, gpt-oss's heads'; one per target layer; the state
  chained normed, EAGLE-3.1's);
- probes/<head>.safetensors: each native head's own forward (eager attention, three
  training-time-test steps, no loss) on seeded fused states and tokens: `aux`,
  `input_ids` and its `draft_tokens` [steps, positions]."""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.convert.eagle.eagle3_converter import Eagle3Converter
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.models.eagle3.core import Eagle3DraftModel
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import AutoConfig, LlamaConfig, Qwen3Config

LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                "vocab_size")  # fmt: skip
PROBE_POSITIONS = 12
STEPS = 3


# Each native head: its layer's config class and its config's flags.
VARIANTS = {
    "native": (LlamaConfig, {}), "qwen3": (Qwen3Config, {}),
    "norm_before_fc": (LlamaConfig, {"norm_before_fc": True}),
    "fc_norm": (LlamaConfig, {"fc_norm": True}),
    "norm_output": (LlamaConfig, {"norm_output": True}),
}  # fmt: skip


def native_head(target: Path, aux_layers: list[int], variant: str, seed: int
                ) -> Eagle3DraftModel:  # fmt: skip
    torch.manual_seed(seed)
    verifier = AutoConfig.from_pretrained(target)
    layer_class, flags = VARIANTS[variant]
    layer = layer_class(**{f: getattr(verifier, f) for f in LAYER_FIELDS}, num_hidden_layers=1,
                        rope_theta=verifier.rope_parameters["rope_theta"])  # fmt: skip
    layer._attn_implementation = "eager"  # flex attention's needs a compiler on the CPU
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=verifier.vocab_size // 2,
        eagle_aux_hidden_state_layer_ids=aux_layers, **flags,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            verifier=VerifierConfig(name_or_path=None, architectures=verifier.architectures),
        ),
    )  # fmt: skip
    model = Eagle3DraftModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # wider than its init: drafts that differ
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.1) + (p.dim() == 1))
        model.embed_tokens.weight.copy_(load_file(target / "model.safetensors")[
            "model.embed_tokens.weight"])  # fmt: skip
        model.d2t.copy_(torch.arange(config.draft_vocab_size))  # draft i is target 2i
        model.t2d.copy_(torch.arange(verifier.vocab_size) % 2 == 0)
    return model


def probe(model: Eagle3DraftModel, aux_width: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, PROBE_POSITIONS, aux_width, generator=g)
    input_ids = torch.randint(0, vocab, (1, PROBE_POSITIONS), generator=g)
    with torch.no_grad():
        drafts = model(hidden_states=aux, input_ids=input_ids, ttt_steps=STEPS,
                       document_ids=torch.zeros_like(input_ids))  # fmt: skip
    return {"aux": aux[0], "input_ids": input_ids[0],
            "draft_tokens": torch.cat(drafts).contiguous()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--original", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    original = json.loads((args.original / "config.json").read_text())
    aux_layers = original["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (args.out / "probes").mkdir(parents=True, exist_ok=True)
    for variant in VARIANTS:
        model = native_head(args.target, aux_layers, variant, seed=0)
        model.save_pretrained(args.out / variant)
        width = 3 * model.config.transformer_layer_config.hidden_size
        save_file(probe(model, width, model.verifier_vocab_size, seed=1),
                  args.out / "probes" / f"{variant}.safetensors")  # fmt: skip
    Eagle3Converter().convert(args.original, args.out / "converted", base_model=str(args.target),
                              eagle_aux_hidden_state_layer_ids=aux_layers)  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
