"""One step's tensors: the persistent batch's rows turned into the flattened
forward's inputs (decodes first, so that each kind is one attention call) and the
sampling rows' metadata, on the device."""

from dataclasses import dataclass

import numpy as np
import torch

from flagstop.executor.attention import AttentionMetadata
from flagstop.executor.input_batch import BatchDesync, InputBatch, ScheduledRows
from flagstop.executor.models.gdn import RecurrentMetadata
from flagstop.executor.sampling import Penalties, SamplingMetadata
from flagstop.utils import cdiv

# A KV cache group's part of a step: attention's, or a recurrent group's.
GroupMetadata = AttentionMetadata | RecurrentMetadata


@dataclass(slots=True)
class Drafts:
    """One step's drafts, decided once (rank 0): per sampling request, in plan order,
    how many, and their tokens flattened; with probabilistic drafting the draft's
    distribution q of each ([sum, V])."""

    num_drafts: np.ndarray  # [S] int64
    token_ids: np.ndarray  # [sum(num_drafts)] int64
    probs: torch.Tensor | None = None

    @property
    def num_rows(self) -> np.ndarray:
        return self.num_drafts + 1


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: list["GroupMetadata"]  # per KV cache group
    logits_indices: torch.Tensor  # rows of the hidden states to sample from, plan order
    sampling: SamplingMetadata
    rows: np.ndarray  # batch row of each scheduled request, plan order
    token_rows: np.ndarray  # batch row of each token of the forward, in its order
    token_positions: np.ndarray  # and its position in its request
    num_scheduled: np.ndarray
    sampling_rows: np.ndarray
    # Prompt logprobs: the rows of the hidden states to score after logits_indices,
    # and per request (plan index, first prompt token scored, how many).
    prompt_indices: np.ndarray | None = None
    prompt_chunks: list[tuple[int, int, int]] | None = None
    # Speculative decoding: this step's drafts; logits_indices then has 1 + drafts
    # rows per sampling request (its last token's, then each draft's), and sampling
    # one row each (the distribution at that position).
    drafts: "Drafts | None" = None
    # The forward's final hidden states [tokens, hidden], once it ran (the mtp drafter
    # catches up on them; the pooler reads the pooling requests' last tokens').
    hidden: torch.Tensor | None = None
    # The target's layers' inputs an EAGLE-3 drafter reads, [tokens, 3 * hidden] (None
    # without one: models/aux_hidden.py).
    aux_hidden: torch.Tensor | None = None
    # Pooling requests whose prompt ends this step: their rows and their last token's
    # place in the hidden states, plan order.
    pooling_rows: np.ndarray | None = None
    pool_indices: np.ndarray | None = None

    @property
    def all_logits_indices(self) -> torch.Tensor:
        if self.prompt_indices is None:
            return self.logits_indices
        extra = torch.from_numpy(self.prompt_indices).to(self.logits_indices.device)
        return torch.cat((self.logits_indices, extra))


def prepare_inputs(
    batch: InputBatch, scheduled: ScheduledRows, device: torch.device,
    drafts: Drafts | None = None,
) -> StepInputs:  # fmt: skip
    """The flattened forward's tensors of one step (InputBatch.scheduled_rows, with
    the drafts already written after their requests' tokens), on the device."""
    rows, num_scheduled, seq_lens, samples, _, pooled = scheduled
    extra = None
    if drafts is not None:
        extra = np.zeros(len(rows), np.int64)
        extra[samples] = drafts.num_drafts
        num_scheduled, seq_lens = num_scheduled + extra, seq_lens + extra
        if (seq_lens > batch.num_blocks[rows] * batch.block_size).any():
            raise BatchDesync("drafts past their request's blocks")
    flat = flatten(batch, rows, batch.num_computed_tokens[rows], num_scheduled)
    cu_tokens, position_in_order = flat.cu_tokens, flat.position_in_order
    # A sampling request's logits row is its last token in the reordered batch,
    # listed in plan order.
    logits_indices = cu_tokens[position_in_order[samples]] - 1
    sampling_rows, offsets = rows[samples], None
    if drafts is not None:  # 1 + drafts rows each, the last token's first
        num_rows = drafts.num_rows
        offsets = np.arange(num_rows.sum()) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
        logits_indices = np.repeat(logits_indices - drafts.num_drafts, num_rows) + offsets
        sampling_rows = np.repeat(sampling_rows, num_rows)

    def t(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    prompt_indices, prompt_chunks = None, None
    if (batch.num_prompt_logprobs[rows] >= 0).any():
        flat_starts = (cu_tokens - flat.num_new)[position_in_order]
        prompt_indices, prompt_chunks = prompt_positions(batch, rows, num_scheduled, flat_starts)
    input_ids, positions, attention = flat.tensors(batch, t, extra, samples)
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        attention=attention,
        logits_indices=t(logits_indices),
        sampling=sampling_metadata(batch, sampling_rows, t, offsets),
        rows=rows,
        token_rows=flat.token_rows,
        token_positions=flat.positions,
        num_scheduled=num_scheduled,
        sampling_rows=rows[samples],
        prompt_indices=prompt_indices,
        prompt_chunks=prompt_chunks,
        drafts=drafts,
        pooling_rows=rows[pooled],
        pool_indices=cu_tokens[position_in_order[pooled]] - 1,
    )


@dataclass(slots=True)
class Flattened:
    """Requests' new tokens laid out for one forward, in attention order (numpy)."""

    num_new: np.ndarray  # per request, attention order
    cu_tokens: np.ndarray
    positions: np.ndarray  # per token
    token_rows: np.ndarray
    seq_lens: np.ndarray  # per request, attention order
    rows: np.ndarray  # per request, attention order
    position_in_order: np.ndarray  # request i (as given) is at this place
    order: np.ndarray  # the request (as given) at each place

    def last_indices(self) -> np.ndarray:
        """The flat index of each request's last new token, requests as given."""
        return self.cu_tokens[self.position_in_order] - 1

    def tensors(
        self, batch: InputBatch, t, num_drafts: np.ndarray | None = None,
        samples: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[GroupMetadata]]:  # fmt: skip
        """(input ids, positions, metadata per KV cache group) on the device, from the
        batch's token table and block tables (num_drafts: per request as given, the
        drafts after its tokens; samples: the sampling requests, in their order)."""
        common = self._common(t)
        num_decodes = common[2]
        metadata: list[GroupMetadata] = [
            self.recurrent(table, batch.block_size, num_decodes, num_drafts, samples, t)
            if g in batch.recurrent_groups else self._attention(batch, g, t, common)
            for g, table in enumerate(batch.block_tables)
        ]  # fmt: skip
        input_ids = t(batch.token_ids[self.token_rows, self.positions])
        return input_ids, t(self.positions), metadata

    def _common(self, t) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(seq_lens, query_start_loc on the device, the decodes): every group's."""
        query_start_loc = np.concatenate(([0], self.cu_tokens)).astype(np.int32)
        num_decodes = int((self.num_new == 1).sum())
        return t(self.seq_lens.astype(np.int32)), t(query_start_loc), num_decodes

    def attention(self, batch: InputBatch, g: int, t) -> AttentionMetadata:
        """Attention group g's metadata alone (the mtp drafter's layer reads one)."""
        return self._attention(batch, g, t, self._common(t))

    def _attention(self, batch: InputBatch, g: int, t, common) -> AttentionMetadata:
        bs, table = batch.block_size, batch.block_tables[g]
        slots = table[self.token_rows, self.positions // bs].astype(np.int64) * bs
        seq_lens, query_start_loc, num_decodes = common
        return AttentionMetadata(
            slot_mapping=t(slots + self.positions % bs),
            block_tables=t(table[self.rows, : cdiv(int(self.seq_lens.max()), bs)]),
            seq_lens=seq_lens, query_start_loc=query_start_loc, num_decodes=num_decodes,
        )  # fmt: skip

    def recurrent(self, table: np.ndarray, bs: int, num_decodes: int,
                  num_drafts: np.ndarray | None, samples: np.ndarray | None,
                  t) -> RecurrentMetadata:  # fmt: skip
        """A recurrent group's metadata (kv_groups.py): each sequence reads the state in
        its last computed token's block and writes the state at each block end it passes
        and after its last token; one with drafts keeps a state a token until the
        verification says which it keeps."""
        computed = self.seq_lens - self.num_new
        rows = self.rows
        src = np.where(computed > 0, table[rows, np.maximum(computed - 1, 0) // bs], -1)
        decode_blocks = table[rows[:num_decodes], (self.seq_lens[:num_decodes] - 1) // bs]
        drafted = np.zeros(len(rows), np.int64) if num_drafts is None else \
            num_drafts[self.order]  # fmt: skip
        sample_row = np.full(len(rows), -1)
        if samples is not None:
            sample_row[samples] = np.arange(len(samples))
        snapshots, blocks, drafts = [], [], []
        for i in range(num_decodes, len(rows)):
            row, start, end = rows[i], int(computed[i]), int(self.seq_lens[i])
            if drafted[i]:
                counts = list(range(1, end - start + 1))
                blocks += [-1] * len(counts)
                targets = [int(table[row, (start + c - 1) // bs]) for c in counts]
                drafts.append((i, int(sample_row[self.order[i]]), start, targets))
            else:
                counts = [b - start for b in range((start // bs + 1) * bs, end, bs)]
                counts.append(end - start)
                blocks += [int(table[row, (start + c - 1) // bs]) for c in counts]
            snapshots.append(counts)
        return RecurrentMetadata(
            query_start_loc=[0, *self.cu_tokens.tolist()],
            num_decodes=num_decodes,
            src_blocks=t(src.astype(np.int64)),
            decode_blocks=t(decode_blocks.astype(np.int64)),
            snapshots=snapshots,
            snapshot_blocks=t(np.array(blocks, np.int64)),
            drafts=drafts,
        )


def flatten(
    batch: InputBatch, rows: np.ndarray, starts: np.ndarray, num_new: np.ndarray
) -> Flattened:
    """rows[i]'s tokens starts[i] .. starts[i] + num_new[i] as one forward's inputs.
    Decodes first, so that each kind is one attention call; shortest first within
    each, so that the torch kernels can group decodes of similar lengths."""
    seq_lens = starts + num_new
    order = np.lexsort((seq_lens, num_new != 1))
    o_num = num_new[order]
    cu_tokens = np.cumsum(o_num)
    token_seq = np.repeat(np.arange(len(rows)), o_num)
    offsets = np.arange(cu_tokens[-1]) - (cu_tokens - o_num)[token_seq]
    positions = starts[order][token_seq] + offsets
    position_in_order = np.empty_like(order)
    position_in_order[order] = np.arange(len(order))
    return Flattened(o_num, cu_tokens, positions, rows[order][token_seq], seq_lens[order],
                     rows[order], position_in_order, order)  # fmt: skip


def prompt_positions(batch: InputBatch, rows, num_scheduled, flat_starts):
    """The flattened positions whose logits score a prompt token: position p scores
    prompt token p + 1, for p below the prompt's last token (whose logits sample
    the first output token). Per request in plan order (plan index, first token,
    count)."""
    starts = batch.num_computed_tokens[rows]
    ends = np.minimum(starts + num_scheduled, batch.num_prompt_tokens[rows] - 1)
    counts = np.where(batch.num_prompt_logprobs[rows] >= 0, np.maximum(ends - starts, 0), 0)
    chunks = [(int(i), int(starts[i]) + 1, int(counts[i])) for i in np.flatnonzero(counts)]
    if not chunks:
        return None, None
    indices = np.concatenate([flat_starts[i] + np.arange(n) for i, _, n in chunks])
    return indices.astype(np.int64), chunks


def sampling_metadata(
    batch: InputBatch, rows: np.ndarray, t, offsets: np.ndarray | None = None
) -> SamplingMetadata:
    """offsets: a draft position's row samples the token that many past its request's
    known ones (the drafts before it are in the token table: the penalties count
    them, min_tokens and seeds see that position)."""
    temperature, top_p, top_k = batch.temperature[rows], batch.top_p[rows], batch.top_k[rows]
    num_tokens, params = batch.num_tokens[rows], batch.sampling_params
    if offsets is not None:
        num_tokens = num_tokens + offsets
    seeded = [
        (i, params[rows[i]].seed, int(num_tokens[i])) for i in np.flatnonzero(batch.seeded[rows])
    ]
    below_min = num_tokens - batch.num_prompt_tokens[rows] < batch.min_tokens[rows]
    banned = [(i, params[rows[i]].stop_token_ids) for i in np.flatnonzero(below_min)]
    num_logprobs = batch.num_logprobs[rows]
    min_p = batch.min_p[rows]
    return SamplingMetadata(
        temperature=t(temperature),
        top_p=t(top_p),
        top_k=t(top_k),
        all_greedy=not temperature.any(),
        needs_top_k_top_p=bool((top_k < batch.vocab_size).any() or (top_p < 1).any()),
        seeded=seeded,
        banned=banned,
        num_logprobs=[None if n < 0 else int(n) for n in num_logprobs]
        if (num_logprobs >= 0).any()
        else None,
        min_p=t(min_p) if min_p.any() else None,
        penalties=penalties(batch, rows, num_tokens, t) if batch.penalized[rows].any() else None,
        logit_bias=logit_bias(batch, rows, t) if batch.biased[rows].any() else None,
    )


def penalties(batch: InputBatch, rows: np.ndarray, num_tokens: np.ndarray, t) -> Penalties:
    """Token counts of the penalized rows (each up to its num_tokens), scattered on the
    device from their token ids (padded with an id one past the vocabulary, whose
    column is dropped)."""
    which = np.flatnonzero(batch.penalized[rows])
    p_rows, params = rows[which], [batch.sampling_params[r] for r in rows[which]]
    num_prompt, num_tokens = batch.num_prompt_tokens[p_rows], num_tokens[which]
    vocab = batch.vocab_size
    out_ids = t(_padded(batch.token_ids, p_rows, num_prompt, num_tokens, vocab))
    counts = torch.zeros(len(which), vocab + 1, device=out_ids.device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
    repetition = np.array([p.repetition_penalty for p in params], np.float32)
    mask = None
    if (repetition != 1.0).any():  # only the repetition penalty reads the prompts
        prompts = _padded(batch.token_ids, p_rows, np.zeros_like(num_prompt), num_prompt, vocab)
        mask = torch.zeros(len(which), vocab + 1, dtype=torch.bool, device=out_ids.device)
        mask.scatter_(1, t(prompts), True)
        mask = mask[:, :vocab]
    return Penalties(
        rows=t(which.astype(np.int64)), repetition=t(repetition),
        frequency=t(np.array([p.frequency_penalty for p in params], np.float32)),
        presence=t(np.array([p.presence_penalty for p in params], np.float32)),
        output_counts=counts[:, :vocab], prompt_mask=mask,
    )  # fmt: skip


def _padded(token_ids: np.ndarray, rows, starts, ends, pad: int) -> np.ndarray:
    """token_ids[row, start:end] of each row, right-padded with pad ([R, max len])."""
    width = max(1, int((ends - starts).max()))
    columns = starts[:, None] + np.arange(width)
    inside = columns < ends[:, None]
    picked = token_ids[rows[:, None], np.minimum(columns, token_ids.shape[1] - 1)]
    return np.where(inside, picked, pad).astype(np.int64)


def logit_bias(batch: InputBatch, rows: np.ndarray, t):
    entries = [(i, token, bias) for i, row in enumerate(rows.tolist())
               for token, bias in batch.sampling_params[row].logit_bias]  # fmt: skip
    i, tokens, biases = zip(*entries, strict=True)
    return (t(np.array(i, np.int64)), t(np.array(tokens, np.int64)),
            t(np.array(biases, np.float32)))  # fmt: skip
