"""An EAGLE-3 draft head as a drafter: the speculative method `eagle3` (docs/speculative.md).

The head is one decoder layer. At position i it reads the embedding of token i+1 and
a state: for its first draft, the target's hidden states entering three of its layers
(low, middle, high: models/aux_hidden.py captures them in the target's own forward)
fused by `fc` to one hidden size; for each further draft, its own output before its
final norm. Its attention's q/k/v read [input_layernorm(embedding), hidden_norm(state)]
(twice the hidden size); the state is the residual stream. Its final norm and its own
head give logits over a reduced draft vocabulary, which `d2t` maps back to the
target's (target id = draft id + d2t[draft id]).

Both published layouts load (head_config, build_head): the original EAGLE-3 one (config.json of
a one-layer LlamaForCausalLMEagle3, the layer's tensors under `midlayer.`, optional
`eagle_config`) and the `speculators` library's (`Eagle3Speculator`, its layer config
in `transformer_layer_config`, the layer under `layers.0.`; its norm_before_fc, fc_norm
and norm_output variants: HeadConfig). A head that does not fit
the target (another hidden size, layers it does not have) is refused at start-up in
one line.

It runs as the `mtp` drafter does (MtpProposer: the catch-up after each step over
the positions the target kept, the chain at the next step), on its own paged cache on
the target's block ids of a full-attention group, on rank 0; under tensor parallelism
a head without an embedding of its own reads the target's whole there (the target's
is split over the ranks). DraftHead holds what this head and EAGLE-1's (eagle1.py)
share."""

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from flagstop.executor.models.aux_hidden import AuxHidden
from flagstop.executor.models.checkpoint_files import checkpoint_files, open_checkpoint
from flagstop.executor.models.config import ConfigError, ModelConfig
from flagstop.executor.models.decoder import DecoderLayer, VocabParallelEmbedding, use_backend
from flagstop.executor.models.layers import RotaryEmbedding
from flagstop.executor.models.loader import build
from flagstop.executor.models.onednn import Linear
from flagstop.executor.parallel import SINGLE
from flagstop.executor.speculative.mtp import MtpProposer, _stored_names
from flagstop.scheduler_svc.core.kv_groups import FULL_ATTENTION
from flagstop.server import StartupError

# The head's tensors by the layout's names -> ours (its layer as layer 0 of a model).
LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.")
OWN = {
    "fc.weight": "fc.weight", "norm.weight": "norm.weight",
    "lm_head.weight": "draft_head.weight", "embed_tokens.weight": "embed_tokens.weight",
}  # fmt: skip
# Where a target's checkpoint keeps its embedding (a vision-language model's text one).
TARGET_EMBED = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                "embed_tokens.weight")  # fmt: skip
# The decoder layer a head's config describes, by its model_type (speculators writes
# Qwen3 heads' layers as qwen3: their attention has q/k norms); Llama's otherwise.
LAYER_FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class HeadConfig:
    """What a head's config.json says, in either layout."""

    layer: ModelConfig  # its decoder layer's (a one-layer Llama)
    aux_layers: tuple[int, ...]  # the target layers whose inputs it reads
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool  # the state normed before it joins the residual stream
    # speculators' variants: one norm over the fused layers before fc (gpt-oss's heads),
    # or one per layer; the chained state normed (EAGLE-3.1), the head reading it as is
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False


def head_config(model_dir: Path, target: ModelConfig) -> HeadConfig:
    """Raises ConfigError naming what does not fit the target."""
    hf = json.loads((model_dir / "config.json").read_text())
    if "transformer_layer_config" in hf:  # speculators' Eagle3Speculator
        layer_hf, ids = hf["transformer_layer_config"], hf.get("eagle_aux_hidden_state_layer_ids")
    else:  # the original layout: a one-layer Llama config
        layer_hf, ids = hf, (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    family = LAYER_FAMILIES.get(layer_hf.get("model_type"), "LlamaForCausalLM")
    layer = ModelConfig.from_hf({**layer_hf, "architectures": [family],
                                 "num_hidden_layers": 1})  # fmt: skip
    layer = one_full_layer(layer)
    n = target.num_layers
    aux = tuple(ids) if ids else (2, n // 2, n - 3)  # vLLM's default for a Llama target
    if any(not 0 <= i < n for i in aux) or len(set(aux)) != len(aux):
        raise ConfigError(f"eagle_aux_hidden_state_layer_ids {list(aux)}: the target has "
                          f"layers 0..{n - 1}, each named once")  # fmt: skip
    target_hidden = hf.get("target_hidden_size") or layer_hf.get("target_hidden_size") \
        or layer.hidden_size  # fmt: skip
    if target_hidden != target.hidden_size:
        raise ConfigError(f"the head reads hidden states of {target_hidden}, the target's "
                          f"are {target.hidden_size}: a head for another model")  # fmt: skip
    if layer.vocab_size != target.vocab_size:
        raise ConfigError(f"the head's vocabulary is {layer.vocab_size} tokens, the target's "
                          f"{target.vocab_size}: a head for another model")  # fmt: skip
    draft_vocab = hf.get("draft_vocab_size") or layer.vocab_size
    flags = (bool(hf.get(k)) for k in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                       "norm_output"))  # fmt: skip
    return HeadConfig(layer, aux, draft_vocab, target_hidden, *flags)


def one_full_layer(config: ModelConfig) -> ModelConfig:
    return replace(config, layer_types=(FULL_ATTENTION,), sliding_window=0)


class Eagle3Layer(DecoderLayer):
    """A Llama decoder layer whose attention reads [embedding, state] (2 x hidden)."""

    def __init__(self, config: ModelConfig, norm_before_residual: bool) -> None:
        super().__init__(config, SINGLE, 0)
        size, eps = config.hidden_size, config.rms_norm_eps
        attention = self.self_attn
        attention.qkv_proj = Linear(2 * size, attention.q_size + 2 * attention.kv_size,
                                    bias=config.qkv_bias)  # fmt: skip
        self.hidden_norm = type(self.input_layernorm)(size, eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, ropes, embeds, state, kv_cache, meta):
        normed = self.hidden_norm(state)
        residual = normed if self.norm_before_residual else state
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        x = self.self_attn(ropes, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DraftHead(nn.Module):
    """What an EAGLE head shares, as the loader and mtp's drafting see a model: one
    layer's config on one rank, its rotary table, its own embedding or the target's."""

    def __init__(self, target: nn.Module, layer: ModelConfig, own_embed: bool) -> None:
        super().__init__()
        self.config, self.tp, c = layer, SINGLE, layer
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, SINGLE) \
            if own_embed else None  # fmt: skip
        self.rotary_tables = [RotaryEmbedding(c.rotary_dim, c.max_position_embeddings,
                                              c.rope_theta, c.rope_scaling)]  # fmt: skip
        self.checkpoint_kv_scales: dict[int, torch.Tensor] = {}  # the loader's; unused
        self._target = (target,)  # not a submodule: its weights are the target's

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self._target[0].embed_tokens)(input_ids)

    def tie_weights(self) -> None:
        pass

    def shared_weights(self) -> list[torch.Tensor]:
        return []

    def set_attention_backend(self, backend) -> None:
        use_backend(self, backend)


class Eagle3Model(DraftHead):
    """The head: fc, its layer, its norm and draft head, d2t; the target's embedding
    where it has none of its own."""

    def __init__(self, target: nn.Module, head: HeadConfig, own_embed: bool) -> None:
        super().__init__(target, head.layer, own_embed)
        self.head, c, n = head, head.layer, len(head.aux_layers)
        self.fc = Linear(n * head.target_hidden_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(c, head.norm_before_residual)])
        norm = type(self.layers[0].input_layernorm)
        self.norm = norm(c.hidden_size, c.rms_norm_eps)
        self.input_norm = norm(n * head.target_hidden_size, c.rms_norm_eps) \
            if head.norm_before_fc else nn.Identity()  # fmt: skip
        self.fc_norm = PerLayerNorm(norm, n, head.target_hidden_size, c.rms_norm_eps) \
            if head.fc_norm else nn.Identity()  # fmt: skip
        self.draft_head = Linear(c.hidden_size, head.draft_vocab_size, bias=False)
        self.d2t = torch.zeros(head.draft_vocab_size, dtype=torch.long)  # set by load

    def forward(self, input_ids, positions, state, kv_cache_, meta) -> torch.Tensor:
        """The state the next draft chains from, [tokens, hidden]: the layer's output
        before the final norm. A state of the fused width is the target's (fc first)."""
        embeds = self.embed(input_ids)
        if state.shape[-1] == self.fc.in_features:
            state = self.fc(self.fc_norm(self.input_norm(state.to(embeds.dtype))))
        ropes = tuple(table.lookup(positions) for table in self.rotary_tables)
        x, residual = self.layers[0](ropes, embeds, state, kv_cache_, meta)
        return self.norm(x + residual) if self.head.norm_output else x + residual

    def greedy(self, state: torch.Tensor) -> torch.Tensor:
        """The argmax token of each row's draft logits, as a target token id."""
        normed = state if self.head.norm_output else self.norm(state)
        draft = self.draft_head(normed).argmax(dim=-1)
        return draft + self.d2t.to(draft.device)[draft]


class PerLayerNorm(nn.ModuleList):
    """speculators' fc_norm: each target layer's slice of the fused states normed by
    its own weights."""

    def __init__(self, norm: type[nn.Module], n: int, size: int, eps: float) -> None:
        super().__init__([norm(size, eps) for _ in range(n)])

    def forward(self, fused: torch.Tensor) -> torch.Tensor:
        chunks = fused.chunk(len(self), dim=-1)
        return torch.cat([norm(chunk) for norm, chunk in zip(self, chunks, strict=True)], -1)


def own_names(head: HeadConfig) -> dict[str, str]:
    """The head's own tensors (beside its layer's) by their stored names -> ours."""
    names = OWN | ({"input_norm.weight": "input_norm.weight"} if head.norm_before_fc else {})
    if head.fc_norm:
        names |= {f"fc_norm.{i}.weight": f"fc_norm.{i}.weight"
                  for i in range(len(head.aux_layers))}  # fmt: skip
    return names


def head_tensors(model_dir: str, method: str) -> set[str]:
    """The names of the head's stored tensors; StartupError where it stores none."""
    if not (stored := _stored_names(model_dir)):
        raise StartupError(f"speculative method {method}: {model_dir} has no *.safetensors "
                           "or pytorch_model*.bin")  # fmt: skip
    return stored


def build_head(runner, model: DraftHead, model_dir: str, method: str,
               own: dict[str, str]) -> DraftHead:  # fmt: skip
    """The head made on meta, given its weights on rank 0's device: its layer's under
    any of LAYER_PREFIXES, its own tensors by `own`. StartupError for a tensor it
    lacks or has extra, or one of another shape."""

    def names(stored: str) -> str | None:
        for prefix in LAYER_PREFIXES:
            if stored.startswith(prefix):
                return "model.layers.0." + stored.removeprefix(prefix)
        return own.get(stored)

    try:
        model = build(model, model_dir, runner.dtype, runner.device,
                      runner.attention_backend, names)  # fmt: skip
    except (ValueError, RuntimeError) as e:
        raise StartupError(f"speculative method {method}: {model_dir}: {e}") from None
    for table in model.rotary_tables:
        table.build(runner.device)
    return model


def load_eagle3(runner, model_dir: str) -> Eagle3Model:
    """The head on rank 0's device; StartupError for one that does not fit."""
    path, target = Path(model_dir), runner.model
    stored = head_tensors(model_dir, "eagle3")
    try:
        head = head_config(path, target.config)
    except (ConfigError, KeyError, OSError, ValueError) as e:
        raise StartupError(f"speculative method eagle3: {model_dir}: {e}") from None
    own_embed = "embed_tokens.weight" in stored
    if not own_embed and head.layer.hidden_size != target.config.hidden_size:
        raise StartupError(f"speculative method eagle3: {model_dir}: a head of hidden size "
                           f"{head.layer.hidden_size} needs its own embed_tokens")  # fmt: skip
    with torch.device("meta"):
        model = Eagle3Model(target, head, own_embed)
    model = build_head(runner, model, model_dir, "eagle3", own_names(head))
    model.d2t = _d2t(path, head.draft_vocab_size).to(runner.device)
    if runner.tp.size > 1 and not own_embed:  # the target's is split over the ranks
        model.embed_tokens = whole_embedding(runner)
    return model


def whole_embedding(runner, method: str = "eagle3") -> VocabParallelEmbedding:
    """The target's embedding whole, read from its checkpoint, for the head on rank 0
    (as mtp copies a layer's under tensor parallelism): memory for one more vocabulary
    x hidden matrix, in place of an all-reduce a draft on every chained step."""
    weight = whole_target_tensor(runner, TARGET_EMBED, method, "embed_tokens")
    with torch.device("meta"):
        embedding = VocabParallelEmbedding(weight.shape[0], weight.shape[1], SINGLE)
    embedding.weight = nn.Parameter(weight, requires_grad=False)
    return embedding


def whole_target_tensor(runner, names: tuple[str, ...], method: str, what: str) -> torch.Tensor:
    """The first of `names` the target's checkpoint holds, whole, on the runner's
    device and dtype; StartupError where it holds none."""
    for file in checkpoint_files(Path(runner.config.model)):
        with open_checkpoint(file) as f:
            name = next((n for n in names if n in f.keys()), None)  # noqa: SIM118
            if name is not None:
                return f.get_tensor(name).to(runner.device, runner.dtype)
    raise StartupError(
        f"speculative method {method}: under tensor parallelism a head without {what} "
        f"takes the target's, and {runner.config.model} has no {' or '.join(names)}"
    )


def _d2t(model_dir: Path, draft_vocab_size: int) -> torch.Tensor:
    """The draft-to-target offsets (none stored: the two vocabularies are one)."""
    for file in checkpoint_files(model_dir):
        with open_checkpoint(file) as f:
            if "d2t" in f.keys():  # noqa: SIM118
                return f.get_tensor("d2t").long()
    return torch.zeros(draft_vocab_size, dtype=torch.long)


class Eagle3Proposer(MtpProposer):
    """MTP's catch-up and chain (speculative/mtp.py) with the head, fed the target's
    captured layers instead of its final hidden states."""

    def __init__(self, runner, model_dir: str) -> None:
        model = load_eagle3(runner, model_dir)
        runner.model.aux_hidden = AuxHidden(model.head.aux_layers)
        super().__init__(runner, model)

    def target_hidden(self, inputs) -> torch.Tensor:
        return inputs.aux_hidden
