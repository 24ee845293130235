"""A draft model (vLLM's `draft_model`): a smaller checkpoint of the same tokenizer,
run on rank 0 with its own paged KV cache. Its cache shares the target's block
tables (the same block ids and positions, smaller blocks in bytes), so the
scheduler's allocation covers both and preemption or a finished request frees both.

Per request it keeps how many leading tokens its cache holds; each step it first
catches up on what it has not seen (the whole prompt on a request's first draft,
then the last step's correction or bonus token), then drafts one token per forward.
Verification keeps its cache where the drafts were accepted."""

import json
from pathlib import Path

import numpy as np
import torch

from flagstop.executor.input_batch import InputBatch
from flagstop.executor.models.loader import load_model
from flagstop.executor.parallel import SINGLE
from flagstop.executor.sampling import noise, probabilities, process_logits
from flagstop.executor.speculative.config import SpeculativeConfig
from flagstop.executor.step_inputs import flatten, sampling_metadata
from flagstop.server import StartupError

_DRAFT_SALT = 0x2545F4914F6CDD1D  # a seeded request's draft noise: apart from its own


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, runner) -> None:
        assert config.model is not None
        check_same_vocabulary(config.model, runner.config.model, runner.model_config.vocab_size)
        if runner.kv_groups[0].is_window:
            raise ValueError(
                "--speculative-model: a draft model attends to every token on the "
                "target's block table, and this model has no full-attention "
                "layer (every layer is windowed): use ngram or suffix drafts"
            )
        self.model = load_model(config.model, runner.dtype, runner.device, SINGLE,
                                runner.attention_backend)  # fmt: skip
        self.runner = runner
        self.probabilistic = config.draft_sample_method == "probabilistic"
        self.num_computed = np.zeros(runner.config.max_num_seqs, np.int64)
        self.kv_caches: list = []

    @property
    def block_bytes(self) -> int:
        mc, runner = self.model.config, self.runner
        return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * runner.dtype.itemsize * (
            runner.block_size)  # fmt: skip

    def allocate(self, num_blocks: int) -> None:
        mc, runner = self.model.config, self.runner
        shape = runner.attention_backend.kv_cache_shape(
            num_blocks, runner.block_size, mc.num_kv_heads, mc.head_dim
        )
        zeros = lambda: torch.zeros(shape, dtype=runner.dtype, device=runner.device)  # noqa: E731
        self.kv_caches = [(zeros(), zeros()) for _ in range(mc.num_layers)]

    def add(self, req_id: str, row: int, batch: InputBatch) -> None:
        # From the start: a prefix-cache hit's blocks hold the target's KV, and the
        # draft's only if some request drafted over them.
        self.num_computed[row] = 0

    def remove(self, req_id: str) -> None:
        pass

    def computed(self, batch, inputs) -> None:
        pass  # it runs its own forward over the tokens

    def reset(self) -> None:
        self.num_computed[:] = 0

    @torch.inference_mode()
    def propose(self, batch: InputBatch, rows: np.ndarray, slots: np.ndarray):
        """slots[i] drafts for rows[i], written after its tokens in the token table."""
        known = batch.num_tokens[rows]
        starts = np.minimum(self.num_computed[rows], known - 1)
        drafts = np.zeros((len(rows), int(slots.max())), np.int64)
        q_rows: list[torch.Tensor | None] = [None] * drafts.shape[1]
        active = np.arange(len(rows))
        for j in range(drafts.shape[1]):
            active = active[slots[active] > j]
            if j == 0:  # catch up, then the first draft after the last known token
                num_new = known - starts
            else:
                starts, num_new = known[active] + j - 1, np.ones(len(active), np.int64)
            tokens, q_rows[j] = self._next_tokens(batch, rows[active], starts, num_new, j)
            drafts[active, j] = tokens
            batch.token_ids[rows[active], known[active] + j] = tokens
        self.num_computed[rows] = known + slots - 1
        out = [drafts[i, :k] for i, k in enumerate(slots.tolist())]
        return out, self._flat_probs(q_rows, slots) if self.probabilistic else None

    def _next_tokens(self, batch, rows, starts, num_new, offset: int):
        device = self.runner.device
        flat = flatten(batch, rows, starts, num_new)

        def t(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)

        input_ids, positions, attention = flat.tensors(batch, t)
        hidden = self.model(input_ids, positions, self.kv_caches, attention)
        logits = self.model.compute_logits(hidden[t(flat.last_indices())])
        if not self.probabilistic:
            return logits.argmax(dim=-1).cpu().numpy(), None
        offsets = np.full(len(rows), offset, np.int64)
        meta = sampling_metadata(batch, rows, t, offsets)
        raw = process_logits(logits, meta)
        if meta.all_greedy:
            return raw.argmax(dim=-1).cpu().numpy(), None
        q = probabilities(raw, meta)
        sampled = (q / noise(q, meta.seeded, _DRAFT_SALT)).argmax(dim=-1)
        greedy = meta.temperature == 0
        tokens = torch.where(greedy, raw.argmax(dim=-1), sampled)
        # A greedy request's draft is one-hot in effect: its q is exactly that.
        q[greedy] = torch.nn.functional.one_hot(tokens[greedy], q.shape[1]).to(q.dtype)
        return tokens.cpu().numpy(), q

    @staticmethod
    def _flat_probs(q_rows: list, slots: np.ndarray) -> torch.Tensor | None:
        """Per round (draft position) the active rows' q, reordered request by request."""
        if any(q is None for q in q_rows):
            return None  # every request greedy: q is one-hot, the sampler's default
        parts, taken = [], [0] * len(q_rows)
        for k in slots.tolist():
            for j in range(k):
                parts.append(q_rows[j][taken[j]])
                taken[j] += 1
        return torch.stack(parts)

    def verified(self, batch, rows, num_known, num_sampled) -> None:
        # Its cache holds the drafts that were accepted; the next step's catch-up
        # feeds the token that replaced the first rejected one (or the bonus).
        self.num_computed[rows] = np.minimum(self.num_computed[rows], num_known + num_sampled - 1)


def check_same_vocabulary(draft_dir: str, target_dir: str, vocab_size: int) -> None:
    """A draft must speak the target's tokens: the same vocabulary size, and the same
    vocabulary where both checkpoints ship a tokenizer (StartupError otherwise)."""
    try:
        draft_config = json.loads((Path(draft_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise StartupError(
            f"speculative_config.model: cannot read {draft_dir}/config.json: {e}"
        ) from None
    if draft_config.get("vocab_size") != vocab_size:
        raise StartupError(
            f"speculative_config.model {draft_dir} has vocab_size "
            f"{draft_config.get('vocab_size')}, the target {vocab_size}: a draft needs the "
            "target's tokenizer"
        )
    draft_tok, target_tok = Path(draft_dir) / "tokenizer.json", Path(target_dir) / "tokenizer.json"
    if draft_tok.is_file() and target_tok.is_file():
        vocab = [
            json.loads(p.read_text()).get("model", {}).get("vocab") for p in (draft_tok, target_tok)
        ]
        if vocab[0] != vocab[1]:
            raise StartupError(
                f"speculative_config.model {draft_dir} has another tokenizer than {target_dir}: "
                "a draft needs the target's"
            )
