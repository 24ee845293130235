"""One step's tensors: the persistent batch's rows turned into the flattened
forward's inputs (decodes first, so that each kind is one attention call) and the
sampling rows' metadata, on the device."""

from dataclasses import dataclass

import numpy as np
import torch

from flagstop.executor.attention import AttentionMetadata
from flagstop.executor.input_batch import InputBatch
from flagstop.executor.sampling import SamplingMetadata
from flagstop.scheduler_svc.core.output import SchedulerOutput
from flagstop.utils import cdiv


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states to sample from, plan order
    sampling: SamplingMetadata
    rows: np.ndarray  # batch row of each scheduled request, plan order
    num_scheduled: np.ndarray
    sampling_rows: np.ndarray


def prepare_inputs(batch: InputBatch, plan: SchedulerOutput, device: torch.device) -> StepInputs:
    """The flattened forward's tensors of one step, on the device."""
    rows, num_scheduled, seq_lens, samples = batch.schedule(plan)
    # Decodes first, so that each kind is one attention call; shortest first within
    # each, so that the torch kernels can group decodes of similar lengths.
    order = np.lexsort((seq_lens, num_scheduled != 1))
    o_rows, o_num = rows[order], num_scheduled[order]
    cu_tokens = np.cumsum(o_num)
    token_seq = np.repeat(np.arange(len(rows)), o_num)
    offsets = np.arange(cu_tokens[-1]) - (cu_tokens - o_num)[token_seq]
    positions = batch.num_computed_tokens[o_rows][token_seq] + offsets
    token_rows = o_rows[token_seq]
    block_ids = batch.block_table[token_rows, positions // batch.block_size].astype(np.int64)
    slots = block_ids * batch.block_size + positions % batch.block_size
    o_seq_lens = seq_lens[order]
    max_blocks = cdiv(int(o_seq_lens.max()), batch.block_size)
    # A sampling request's logits row is its last token in the reordered batch,
    # listed in plan order.
    position_in_order = np.empty_like(order)
    position_in_order[order] = np.arange(len(order))
    logits_indices = cu_tokens[position_in_order[samples]] - 1

    def t(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    return StepInputs(
        input_ids=t(batch.token_ids[token_rows, positions]),
        positions=t(positions),
        attention=AttentionMetadata(
            slot_mapping=t(slots),
            block_tables=t(batch.block_table[o_rows, :max_blocks]),
            seq_lens=t(o_seq_lens.astype(np.int32)),
            query_start_loc=t(np.concatenate(([0], cu_tokens)).astype(np.int32)),
            num_decodes=int((o_num == 1).sum()),
        ),
        logits_indices=t(logits_indices),
        sampling=sampling_metadata(batch, rows[samples], t),
        rows=rows,
        num_scheduled=num_scheduled,
        sampling_rows=rows[samples],
    )


def sampling_metadata(batch: InputBatch, rows: np.ndarray, t) -> SamplingMetadata:
    temperature, top_p, top_k = batch.temperature[rows], batch.top_p[rows], batch.top_k[rows]
    num_tokens, params = batch.num_tokens[rows], batch.sampling_params
    seeded = [
        (i, params[rows[i]].seed, int(num_tokens[i])) for i in np.flatnonzero(batch.seeded[rows])
    ]
    below_min = num_tokens - batch.num_prompt_tokens[rows] < batch.min_tokens[rows]
    banned = [(i, params[rows[i]].stop_token_ids) for i in np.flatnonzero(below_min)]
    num_logprobs = batch.num_logprobs[rows]
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
    )
