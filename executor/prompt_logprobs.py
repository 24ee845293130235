"""Prompt logprobs: the model's own logprobs of the prompt tokens a step's prefill
chunks score, and the top n of each position (no penalties, no temperature: what
transformers' log-softmax gives). Computed in the prefill, so a request that asks for
them recomputes its prompt instead of hitting cached blocks."""

import numpy as np
import torch

from flagstop.executor.input_batch import InputBatch
from flagstop.executor.sampling_params import PromptLogprobs
from flagstop.executor.step_inputs import StepInputs
from flagstop.scheduler_svc.core.output import SchedulerOutput


def prompt_logprobs(
    logits: torch.Tensor, inputs: StepInputs, plan: SchedulerOutput, batch: InputBatch
) -> list[PromptLogprobs]:
    """logits: the rows of inputs.prompt_chunks' tokens, in order."""
    req_ids = list(plan.num_scheduled_tokens)
    chunks = [(req_ids[i], int(inputs.rows[i]), first, n)
              for i, first, n in inputs.prompt_chunks or ()]  # fmt: skip
    targets = np.concatenate([batch.token_ids[row, first : first + n]
                              for _, row, first, n in chunks])  # fmt: skip
    logprobs = logits.float().log_softmax(dim=-1)
    target_ids = torch.from_numpy(targets.astype(np.int64)).to(logprobs.device)
    chosen = logprobs.gather(1, target_ids.unsqueeze(1)).squeeze(1).tolist()
    num_top = int(max(batch.num_prompt_logprobs[row] for _, row, _, _ in chunks))
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    top_v = top_values.tolist() if top_values is not None else None
    top_i = top_ids.tolist() if top_ids is not None else None
    out, start = [], 0
    for req_id, row, first, n in chunks:
        k = int(batch.num_prompt_logprobs[row])
        entries = [(chosen[j], top_i[j][:k] if k else [], top_v[j][:k] if k else [])
                   for j in range(start, start + n)]  # fmt: skip
        out.append(PromptLogprobs(req_id, first, targets[start : start + n].tolist(), entries))
        start += n
    return out
