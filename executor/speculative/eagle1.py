"""An EAGLE-1 draft head as a drafter: the speculative method `eagle` (docs/speculative.md).

The head predicts the target's next final hidden state, not a token: at position i
it reads token i+1's embedding and the target's final (normed) hidden state at i,
fused by `fc` ([embedding, state], 2 x hidden -> hidden, with a bias in some heads),
then one Llama decoder layer whose input norm is left out (EAGLE-1's first layer
reads fc's output as it is). Its output, with no final norm, is the predicted state:
the target's own LM head gives the draft, and the next draft chains from it.

The layout is the original EAGLE-1 one (SafeAILab's heads, e.g. yuhuili/EAGLE-LLaMA3-
Instruct-8B): config.json of a one-layer Llama (vLLM's converted form nests it under
`model`), `fc.weight` (and `fc.bias`), the layer under `layers.0.`, optional
`embed_tokens`. The speculators library's EAGLE-1 format (`speculators_model_type`
"eagle") is refused in one line, not run.

It drafts as eagle3 does (MtpProposer's catch-up and chain, on rank 0, its paged cache
on the target's block ids), fed the target's final hidden states as mtp is. Under
tensor parallelism the target's embedding and head are split over the ranks: rank 0
reads whole copies of them from the target's checkpoint."""

import json
from pathlib import Path

import torch
from torch import nn

from flagstop.executor.models.config import ConfigError, ModelConfig
from flagstop.executor.models.decoder import DecoderLayer
from flagstop.executor.models.onednn import Linear
from flagstop.executor.parallel import SINGLE
from flagstop.executor.speculative.eagle import (
    DraftHead,
    build_head,
    head_tensors,
    one_full_layer,
    whole_embedding,
    whole_target_tensor,
)
from flagstop.executor.speculative.mtp import MtpProposer
from flagstop.server import StartupError

# Where a target's checkpoint keeps its LM head: its own, else its tied embedding.
TARGET_HEAD = ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight")
OWN = {"fc.weight": "fc.weight", "fc.bias": "fc.bias", "embed_tokens.weight": "embed_tokens.weight"}


def layer_config(model_dir: Path, target: ModelConfig) -> ModelConfig:
    """The head's one-layer Llama config; ConfigError naming what does not fit."""
    hf = json.loads((model_dir / "config.json").read_text())
    if hf.get("speculators_model_type") == "eagle":
        raise ConfigError("an EAGLE-1 head in the speculators library's format is not run "
                          "yet (its original layout is)")  # fmt: skip
    hf = hf.get("model", hf) if hf.get("model_type") == "eagle" else hf  # vLLM's wrapping
    layer = one_full_layer(ModelConfig.from_hf({**hf, "architectures": ["LlamaForCausalLM"],
                                                 "num_hidden_layers": 1}))  # fmt: skip
    if layer.hidden_size != target.hidden_size:
        raise ConfigError(f"the head's hidden size is {layer.hidden_size}, the target's "
                          f"{target.hidden_size}: a head for another model")  # fmt: skip
    if layer.vocab_size != target.vocab_size:
        raise ConfigError(f"the head's vocabulary is {layer.vocab_size} tokens, the target's "
                          f"{target.vocab_size}: a head for another model")  # fmt: skip
    return layer


class Eagle1Model(DraftHead):
    """fc over [embedding, state], a Llama layer without its input norm; the target's
    LM head (or, under tensor parallelism, a whole copy of it) on its output."""

    def __init__(self, target: nn.Module, layer: ModelConfig, fc_bias: bool,
                 own_embed: bool) -> None:  # fmt: skip
        super().__init__(target, layer, own_embed)
        self.fc = Linear(2 * layer.hidden_size, layer.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(layer, SINGLE, 0)])
        self.layers[0].input_layernorm = nn.Identity()
        self.lm_head: torch.Tensor | None = None  # a whole copy, under tensor parallelism

    def forward(self, input_ids, positions, state, kv_cache_, meta) -> torch.Tensor:
        """The predicted final state of the next position, [tokens, hidden]."""
        embeds = self.embed(input_ids)
        x = self.fc(torch.cat((embeds, state.to(embeds.dtype)), dim=-1))
        ropes = tuple(table.lookup(positions) for table in self.rotary_tables)
        x, residual = self.layers[0](ropes, x, None, kv_cache_, meta)
        return x + residual

    def greedy(self, state: torch.Tensor) -> torch.Tensor:
        """The argmax token of each row under the target's head."""
        if self.lm_head is not None:
            logits = state @ self.lm_head.T
        else:
            logits = self._target[0].lm_head(state)
        return logits[:, : self.config.vocab_size].argmax(dim=-1)


def load_eagle1(runner, model_dir: str) -> Eagle1Model:
    """The head on rank 0's device; StartupError for one that does not fit."""
    stored = head_tensors(model_dir, "eagle")
    try:
        layer = layer_config(Path(model_dir), runner.model.config)
    except (ConfigError, KeyError, OSError, ValueError) as e:
        raise StartupError(f"speculative method eagle: {model_dir}: {e}") from None
    own_embed = "embed_tokens.weight" in stored
    with torch.device("meta"):
        model = Eagle1Model(runner.model, layer, "fc.bias" in stored, own_embed)
    model = build_head(runner, model, model_dir, "eagle", OWN)
    if runner.tp.size > 1:  # the target's embedding and head are split over the ranks
        model.lm_head = whole_target_tensor(runner, TARGET_HEAD, "eagle", "an LM head")
        if not own_embed:
            model.embed_tokens = whole_embedding(runner, "eagle")
    return model


class Eagle1Proposer(MtpProposer):
    """MTP's catch-up and chain with the head, fed the target's final hidden states."""

    def __init__(self, runner, model_dir: str) -> None:
        super().__init__(runner, load_eagle1(runner, model_dir))
