"""The logits processing formulas written out one token at a time, as the oracle of
the vectorised sampler (executor/sampling.py)."""

import torch

from flagstop.executor.sampling_params import SamplingParams


def reference_processed(
    logits: list[float], prompt_ids: list[int], output_ids: list[int], p: SamplingParams
) -> list[float]:
    """Bias, then repetition (prompt and output tokens: a positive logit divided, a
    negative one multiplied), then frequency (per occurrence in the output) and
    presence (once)."""
    out = list(logits)
    for token, bias in p.logit_bias:
        out[token] += bias
    seen = set(prompt_ids) | set(output_ids)
    for token in range(len(out)):
        if token in seen:
            r = p.repetition_penalty
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        count = output_ids.count(token)
        out[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


@torch.no_grad()
def reference_greedy(reference, prompt_ids: list[int], n: int, p: SamplingParams) -> list[int]:
    """transformers' logits, processed by the formulas, argmax, n times."""
    tokens, outputs = list(prompt_ids), []
    for _ in range(n):
        raw = reference(torch.tensor([tokens])).logits[0, -1].float().tolist()
        token = int(torch.tensor(reference_processed(raw, prompt_ids, outputs, p)).argmax())
        tokens.append(token)
        outputs.append(token)
    return outputs
