"""A checkpoint's multi-token prediction layer as a drafter: the speculative method
`mtp` (vLLM's name; its older qwen3_next_mtp and deepseek_mtp are taken too), in
either layout a checkpoint writes it (`Layout`):
- DeepSeek's (DeepSeek-V3/R1, Kimi-K2, GLM-4.5): `model.layers.{num_hidden_layers}.*`,
  with enorm, hnorm, eh_proj and shared_head (the DeepSeek-V3 report, section 2.2);
- Qwen's (Qwen3-Next, Qwen3.5): `mtp.*`, with pre_fc_norm_embedding, pre_fc_norm_hidden,
  fc, layers.0 and norm, the embedding and head the model's; its decoder layer is a
  full-attention one of the model's (gated attention, the model's MLP kind).
The main model skips both (as transformers does).

The layer at position i reads the token after it, token i+1, and the main model's
final hidden state at i: x = eh_proj([enorm(embed(token i+1)), hnorm(hidden i)]), one
decoder layer of the model's own kind, then the final norm and the head give the
logits of token i+2. Where vLLM's models differ, each layout keeps vLLM's choice:
DeepSeek's zeroes the embedding at position 0 and chains the layer's output before its
norm into the next draft; Qwen's zeroes nothing and chains the normed output.

Run on rank 0, with its own paged cache on the target's block ids of a full-attention
group (as a draft model's):
- after each step (`computed`) it catches up over every position the target computed
  and kept, with the hidden states of that forward, which yields each request's first
  draft (the token after the one just sampled);
- at the next step (`propose`) the same layer is chained for the further drafts, each
  fed the draft before it and its own output hidden state.
Under tensor parallelism the model's embedding and head are split over the ranks, so
a layer that has none of its own loads whole copies of them on rank 0.
A position the target took from the prefix cache was never seen here: the blocks hold
what the request that computed them wrote (the next token of that request, which may
differ at a block's last slot), so drafts there may be worse, never wrong: verification
is lossless."""

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from flagstop.executor import kv_cache
from flagstop.executor.input_batch import InputBatch
from flagstop.executor.models.checkpoint_files import checkpoint_files, open_checkpoint
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.decoder import (
    DecoderLayer,
    VocabParallelEmbedding,
    norm_class,
    use_backend,
)
from flagstop.executor.models.loader import Names, build
from flagstop.executor.models.onednn import Linear
from flagstop.executor.parallel import SINGLE
from flagstop.executor.speculative.proposer import NoProposer
from flagstop.executor.step_inputs import StepInputs, flatten
from flagstop.scheduler_svc.core.kv_groups import FULL_ATTENTION
from flagstop.server import StartupError


@dataclass(frozen=True, slots=True)
class Layout:
    """How a checkpoint writes its first prediction layer: `names` gives each of its
    tensors the name it loads as (model.layers.{L}.<ours>, DeepSeek's), None for the
    others."""

    names: Names
    zero_first_embedding: bool  # DeepSeek's: position 0's embedding is zeroed
    chain_normed: bool  # Qwen's: the normed output feeds the next draft

    @staticmethod
    def of(stored: set[str], index: int) -> "Layout | None":
        prefix = f"model.layers.{index}."
        if "mtp.fc.weight" in stored:
            return Layout(_qwen_names(prefix), zero_first_embedding=False, chain_normed=True)
        if prefix + "eh_proj.weight" in stored:
            return Layout(lambda n: n if n.startswith(prefix) else None,
                          zero_first_embedding=True, chain_normed=False)  # fmt: skip
        return None


# Qwen's mtp.* names -> ours (DeepSeek's, after model.layers.{L}.).
QWEN_NAMES = {
    "mtp.fc.": "eh_proj.",
    "mtp.pre_fc_norm_embedding.": "enorm.",
    "mtp.pre_fc_norm_hidden.": "hnorm.",
    "mtp.norm.": "shared_head.norm.",
    "mtp.layers.0.": "",  # the first layer; further ones are not run (nor by vLLM's k > 1)
}


def _qwen_names(prefix: str) -> Names:
    def name(stored: str) -> str | None:
        for theirs, ours in QWEN_NAMES.items():
            if stored.startswith(theirs):
                return prefix + ours + stored.removeprefix(theirs)
        return None

    return name


def _copies(prefix: str, embed: bool, head: bool, tied: bool) -> dict[str, str]:
    """The model's embedding and head as the layer's own tensors (tensor parallelism:
    the model's are split over the ranks). Tied: one tensor, the layer's head, which
    its embedding is tied to (MtpModel.tie_weights)."""
    if tied:
        return {"model.embed_tokens.weight": prefix + "shared_head.head.weight"}
    copies = {"model.embed_tokens.weight": prefix + "embed_tokens.weight"} if embed else {}
    return copies | ({"lm_head.weight": prefix + "shared_head.head.weight"} if head else {})


def _also(copies: dict[str, str], names: Names) -> Names:
    return lambda stored: copies.get(stored) or names(stored)


def _stored_names(model_dir: str) -> set[str]:
    names: set[str] = set()
    for file in checkpoint_files(model_dir):
        with open_checkpoint(file) as f:
            names |= set(f.keys())
    return names


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, own_head: bool) -> None:
        super().__init__()
        self.norm = norm_class(config)(config.hidden_size, config.rms_norm_eps)
        self.head = Linear(config.hidden_size, config.vocab_size, bias=False) if own_head else None


class MtpLayer(DecoderLayer):
    """`model.layers.{index}`: a decoder layer (attention, MLP, their norms) with the
    prediction layer's enorm, hnorm, eh_proj and shared_head; embed_tokens and
    shared_head.head are its own when the checkpoint has them (or tensor parallelism
    copies the model's), else the model's. Its norms are the model's kind."""

    def __init__(self, config: ModelConfig, index: int, own_embed: bool, own_head: bool):
        super().__init__(config, SINGLE, index)
        size, eps, norm = config.hidden_size, config.rms_norm_eps, norm_class(config)
        self.enorm, self.hnorm = norm(size, eps), norm(size, eps)
        self.eh_proj = Linear(2 * size, size, bias=False)
        self.shared_head = SharedHead(config, own_head)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, size, SINGLE) \
            if own_embed else None  # fmt: skip


def _with_one_more_layer(config: ModelConfig, sparse: bool) -> ModelConfig:
    """The model's config with the prediction layer as its last layer (a full-attention
    one, sparse if its tensors are experts)."""
    moe = config.moe
    if moe is not None:
        moe = dataclasses.replace(moe, sparse_layers=(*moe.sparse_layers, sparse))
    return dataclasses.replace(config, num_layers=config.num_layers + 1, moe=moe,
                               layer_types=(*config.layer_types, FULL_ATTENTION))  # fmt: skip


class MtpModel(nn.Module):
    """The first prediction layer, named as DeepSeek names it (layers.{index}),
    reading the target model's rotary tables (and embedding, head if it has none)."""

    def __init__(self, target: nn.Module, layout: Layout, sparse: bool, own_embed: bool,
                 own_head: bool, tied: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.config = _with_one_more_layer(target.config, sparse)
        self.tp, self.index, self.layout = SINGLE, target.config.num_layers, layout
        self.tied = tied  # its embedding is its head (copies of a tied model's)
        self.layers = nn.ModuleDict({str(self.index): MtpLayer(
            self.config, self.index, own_embed, own_head)})  # fmt: skip
        self.checkpoint_kv_scales: dict[int, torch.Tensor] = {}  # the loader's; unused
        self._target = (target,)  # not a submodule: its weights are the target's

    @property
    def layer(self) -> MtpLayer:
        return self.layers[str(self.index)]

    @property
    def norm(self) -> nn.Module:  # the loader reads the model's dtype from it
        return self.layer.enorm

    def tie_weights(self) -> None:
        if self.tied:
            self.layer.embed_tokens.weight = self.layer.shared_head.head.weight

    def shared_weights(self) -> list[torch.Tensor]:
        return []

    def set_attention_backend(self, backend) -> None:
        use_backend(self, backend)

    def forward(self, input_ids, positions, hidden, kv_cache_, meta) -> torch.Tensor:
        """The state the next draft chains from, [tokens, hidden]: the layer's output
        (normed in Qwen's layout)."""
        target, layer = self._target[0], self.layer
        x = (layer.embed_tokens or target.embed_tokens)(input_ids)
        if self.layout.zero_first_embedding:
            x = x.masked_fill((positions == 0)[:, None], 0)
        x = layer.eh_proj(torch.cat((layer.enorm(x), layer.hnorm(hidden)), dim=-1))
        ropes = tuple(table.lookup(positions) for table in target.rotary_tables)
        x, residual = DecoderLayer.forward(layer, ropes, x, None, kv_cache_, meta)
        return layer.shared_head.norm(x, residual)[0] if self.layout.chain_normed else x + residual

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token of each row's logits."""
        head = self.layer.shared_head.head or self._target[0].lm_head
        if not self.layout.chain_normed:
            hidden = self.layer.shared_head.norm(hidden)
        return head(hidden)[:, : self.config.vocab_size].argmax(dim=-1)


def load_mtp(runner) -> MtpModel:
    target, model_dir = runner.model, runner.config.model
    index = target.config.num_layers
    stored = _stored_names(model_dir)
    layout = Layout.of(stored, index)
    if layout is None:
        raise StartupError(
            f"speculative method mtp: {model_dir} has no prediction layer (DeepSeek's "
            f"model.layers.{index}.eh_proj or Qwen's mtp.fc tensors)"
        )
    prefix = f"model.layers.{index}."
    ours = {name for n in stored if (name := layout.names(n)) is not None}
    own_embed, own_head = (prefix + n in ours for n in ("embed_tokens.weight",
                                                         "shared_head.head.weight"))  # fmt: skip
    names, tied = layout.names, False
    if runner.tp.size > 1 and not (own_embed and own_head):
        tied = target.config.tie_word_embeddings
        if tied and (own_embed or own_head):
            raise StartupError("speculative method mtp: under tensor parallelism a "
                               "prediction layer of a tied model needs both or neither of "
                               "embed_tokens and shared_head.head")  # fmt: skip
        names = _also(_copies(prefix, not own_embed, not own_head, tied), names)
        own_embed = own_head = True
    sparse = any(n.startswith(prefix + "mlp.experts.") for n in ours)
    with torch.device("meta"):
        model = MtpModel(target, layout, sparse, own_embed, own_head, tied)
    return build(model, model_dir, runner.dtype, runner.device, runner.attention_backend, names)


class MtpProposer(NoProposer):
    def __init__(self, runner, model: nn.Module | None = None) -> None:
        """model: a head that runs as this layer does (EAGLE-3's); default the
        checkpoint's prediction layer."""
        self.runner = runner
        self.model = model if model is not None else load_mtp(runner)
        # The layer attends to every earlier position: its cache is on the block ids of
        # a full-attention group (the model has one beside its window or recurrent ones).
        self.group = next(g for g, group in enumerate(runner.kv_groups)
                          if not group.is_window and not group.is_recurrent)  # fmt: skip
        rows = runner.config.max_num_seqs
        # Each row's first draft and the hidden state it came from, for num_tokens
        # tokens (ready): a row that has gained tokens since has none.
        self.first_draft = np.zeros(rows, np.int64)
        self.ready = np.full(rows, -1, np.int64)
        self.last_hidden: dict[int, torch.Tensor] = {}
        self.kv_caches: list = []

    @property
    def block_bytes(self) -> int:
        mc, runner = self.model.config, self.runner
        kv_layers = mc.kv_layers(mc.num_kv_heads, runner.dtype.itemsize)
        return kv_layers[-1].kv_bytes_per_token * runner.block_size

    def allocate(self, num_blocks: int) -> None:
        mc, runner = self.model.config, self.runner
        shapes = kv_cache.layer_shapes(runner.attention_backend, mc, mc.num_kv_heads, num_blocks,
                                       runner.block_size)  # fmt: skip
        self.kv_caches = [tuple(torch.zeros(s, dtype=runner.dtype, device=runner.device)
                                for s in shapes)]  # fmt: skip

    def add(self, req_id: str, row: int, batch: InputBatch) -> None:
        self.ready[row] = -1
        self.last_hidden.pop(row, None)

    def reset(self) -> None:
        self.ready[:] = -1
        self.last_hidden.clear()

    def _forward(self, batch, rows, starts, num_new, input_ids_by_token, hidden):
        """The layer over rows[i]'s positions starts[i] .. + num_new[i]; the inputs are
        given per flattened token by input_ids_by_token(flat) and hidden(flat).
        Returns (flat, its output)."""
        device = self.runner.device
        flat = flatten(batch, rows, starts, num_new)

        def t(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)

        positions = t(flat.positions)
        out = self.model(t(input_ids_by_token(flat)), positions, hidden(flat),
                         self.kv_caches[0], flat.attention(batch, self.group, t))  # fmt: skip
        return flat, out

    def target_hidden(self, inputs: StepInputs) -> torch.Tensor:
        """What the layer reads of the target's forward: its final hidden states."""
        return inputs.hidden

    @torch.inference_mode()
    def computed(self, batch: InputBatch, inputs: StepInputs) -> None:
        """After a step: its forward computed each token's position with the final
        hidden state inputs.hidden[j]; the positions the target kept (below the row's
        computed count) are caught up on, and each row's first draft taken."""
        token_rows, hidden = inputs.token_rows, self.target_hidden(inputs)
        positions = inputs.positions.cpu().numpy()
        kept = positions < batch.num_computed_tokens[token_rows]
        if not kept.any():
            return
        index = np.flatnonzero(kept)
        token_rows, positions = token_rows[index], positions[index]
        rows, first = np.unique(token_rows, return_index=True)
        starts, counts = positions[first], np.bincount(token_rows, minlength=len(batch.num_tokens))
        source_start = np.zeros(len(batch.num_tokens), np.int64)
        source_start[rows] = first
        start_of = np.zeros_like(source_start)
        start_of[rows] = starts
        kept_hidden = hidden[torch.from_numpy(index).to(hidden.device)]

        def source(flat) -> torch.Tensor:
            at = source_start[flat.token_rows] + flat.positions - start_of[flat.token_rows]
            return kept_hidden[torch.from_numpy(at).to(hidden.device)]

        flat, out = self._forward(
            batch, rows, starts, counts[rows],
            lambda flat: batch.token_ids[flat.token_rows, flat.positions + 1], source,
        )  # fmt: skip
        last = torch.from_numpy(flat.last_indices()).to(out.device)
        drafts = self.model.greedy(out[last]).cpu().numpy()
        # Rows whose last position is the last known token's predecessor: the layer's
        # output there predicts the token after the known ones, the first draft.
        caught_up = starts + counts[rows] == batch.num_tokens[rows] - 1
        for i in np.flatnonzero(caught_up):
            row = int(rows[i])
            self.first_draft[row], self.ready[row] = drafts[i], batch.num_tokens[row]
            self.last_hidden[row] = out[last[i]]

    @torch.inference_mode()
    def propose(self, batch: InputBatch, rows: np.ndarray, slots: np.ndarray):
        """The first draft from the catch-up, then the layer chained for the rest."""
        known = batch.num_tokens[rows]
        ready = self.ready[rows] == known
        drafts = np.zeros((len(rows), int(slots.max())), np.int64)
        drafts[:, 0] = self.first_draft[rows]
        hidden = {int(r): self.last_hidden[int(r)] for r in rows[ready]}
        active = np.flatnonzero(ready & (slots > 1))
        for j in range(1, drafts.shape[1]):
            active = active[slots[active] > j]
            if not len(active):
                break
            by_row = np.zeros(len(batch.num_tokens), np.int64)
            by_row[rows[active]] = drafts[active, j - 1]
            flat, out = self._forward(
                batch, rows[active], known[active] + j - 2, np.ones(len(active), np.int64),
                lambda flat, by_row=by_row: by_row[flat.token_rows],
                lambda flat: torch.stack([hidden[int(r)] for r in flat.token_rows]),
            )  # fmt: skip
            order = flat.last_indices()  # rows[active] as given
            drafts[active, j] = self.model.greedy(out[torch.from_numpy(order)]).cpu().numpy()
            for i, k in zip(active.tolist(), order.tolist(), strict=True):
                hidden[int(rows[i])] = out[k]
        counts = np.where(ready, slots, 0)
        return [drafts[i, :k] for i, k in enumerate(counts.tolist())], None
