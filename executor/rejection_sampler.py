"""Speculative decoding's verification: a step's drafts against the target's
distribution at each of their positions, keeping the output distribution exactly
that of sampling without drafts (Leviathan et al. 2023; Chen et al. 2023).

Each sampling request has 1 + d logits rows: row j is the distribution of the token
after its known tokens and drafts 1..j, processed as a plain step's would be (bans,
bias, penalties counting the drafts before it, a grammar's mask at that position;
then temperature, min_p, top-k, top-p). Draft j is checked against row j:
- drafts without a distribution (every proposer, and a draft model drafting
  greedily): each row draws its token as the plain sampler would at that position
  (greedy: the argmax; sampled: the exponential race with the request's noise there,
  seeded by (seed, position) when it has a seed), and a draft is accepted while it is
  that token. This is rejection sampling with a one-hot q (accepted with probability
  p(d), the rest resampled from p without d) realised with the plain sampler's own
  draws, so a seeded request emits the very tokens it would without drafts, however
  its steps were drafted, batched, preempted or moved to another replica;
- drafts sampled from a draft model's q: accepted with probability min(1, p(d) /
  q(d)), the first rejected position resampled from norm(max(p - q, 0)) (Leviathan
  et al.): more accepted than one-hot when q is close to p, but a seeded request's
  tokens then depend on where drafts were.
When all d are accepted, row d gives a bonus token. A request emits 1..d+1 tokens,
and logprobs are each emitted token's at its row, as a plain step reports them."""

import numpy as np
import torch

from flagstop.executor.sampling import (
    SamplingMetadata,
    logprobs,
    noise,
    probabilities,
    process_logits,
    seeded_generator,
)
from flagstop.executor.sampling_params import SampleOutput
from flagstop.executor.step_inputs import Drafts

_ACCEPT_SALT = 0x5DEECE66D  # a seeded request's acceptance draws: apart from its noise


def verify(logits: torch.Tensor, meta: SamplingMetadata, drafts: Drafts) -> SampleOutput:
    """logits [sum(1 + d), V] (in place), meta one row each -> the emitted tokens,
    flattened, num_sampled_tokens per request."""
    raw = process_logits(logits, meta)
    greedy = raw.argmax(dim=-1)
    num_rows = drafts.num_rows
    starts = np.cumsum(num_rows) - num_rows
    draft_rows = _draft_rows(starts, drafts.num_drafts)
    device = logits.device
    draft_ids = torch.from_numpy(drafts.token_ids.astype(np.int64)).to(device)
    rows_t = torch.from_numpy(draft_rows).to(device)
    if drafts.probs is None:  # the plain sampler's token at every row
        plain = greedy
        if not meta.all_greedy:
            probs = probabilities(raw, meta)
            sampled = (probs / noise(probs, meta.seeded)).argmax(dim=-1)
            plain = torch.where(meta.temperature == 0, greedy, sampled)
        num_accepted = _leading((plain[rows_t] == draft_ids).cpu().numpy(), drafts.num_drafts)
        final_rows = starts + num_accepted
        final = plain[torch.from_numpy(final_rows.astype(np.int64)).to(device)]
        return _output(raw, meta, drafts, starts, num_accepted, final)
    probs = None
    accepted = greedy[rows_t] == draft_ids
    if not meta.all_greedy:
        probs = probabilities(raw, meta)
        p = probs[rows_t, draft_ids]
        q = drafts.probs[torch.arange(len(draft_ids), device=device), draft_ids]
        by_ratio = (q > 0) & (_uniforms(meta, draft_rows, device) * q <= p)
        accepted = torch.where(meta.temperature[rows_t] == 0, accepted, by_ratio)
    num_accepted = _leading(accepted.cpu().numpy(), drafts.num_drafts)
    final_rows = starts + num_accepted
    final = _final_tokens(greedy, probs, meta, drafts, final_rows, num_accepted, draft_ids)
    return _output(raw, meta, drafts, starts, num_accepted, final)


def _output(raw, meta, drafts: Drafts, starts, num_accepted, final) -> SampleOutput:
    """Each request's accepted drafts and its last token, with their logprobs."""
    device = raw.device
    emitted_rows = np.concatenate(
        [s + np.arange(a + 1) for s, a in zip(starts, num_accepted, strict=True)]
    )
    tokens = _emitted(drafts, num_accepted, final)
    output = SampleOutput(tokens, num_sampled_tokens=(num_accepted + 1).tolist(),
                          num_draft_tokens=drafts.num_drafts.tolist())  # fmt: skip
    if meta.num_logprobs is not None:
        picked = torch.from_numpy(emitted_rows).to(device)
        wanted = [meta.num_logprobs[r] for r in emitted_rows.tolist()]
        output.logprobs = logprobs(raw[picked], torch.tensor(tokens, device=device), wanted)
    return output


def _draft_rows(starts: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """The logits row each draft is checked against: row j of its request."""
    offsets = np.arange(num_drafts.sum()) - np.repeat(np.cumsum(num_drafts) - num_drafts,
                                                      num_drafts)  # fmt: skip
    return (np.repeat(starts, num_drafts) + offsets).astype(np.int64)


def _leading(accepted: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Per request, how many of its drafts were accepted before the first rejection."""
    out = np.zeros(len(num_drafts), np.int64)
    start = 0
    for i, d in enumerate(num_drafts.tolist()):
        if d:
            segment = accepted[start : start + d]
            out[i] = d if segment.all() else int(np.argmin(segment))
            start += d
    return out


def _uniforms(meta: SamplingMetadata, draft_rows: np.ndarray, device) -> torch.Tensor:
    """U(0, 1) per draft; a seeded request's from its (seed, position) alone."""
    u = torch.rand(len(draft_rows), device=device)
    if meta.seeded:
        seeded = {row: (seed, pos) for row, seed, pos in meta.seeded}
        for i, row in enumerate(draft_rows.tolist()):
            if (entry := seeded.get(row)) is not None:
                generator = seeded_generator(*entry, device, _ACCEPT_SALT)
                u[i] = torch.rand(1, generator=generator, device=device)[0]
    return u


def _final_tokens(greedy, probs, meta, drafts, final_rows, num_accepted, draft_ids):
    """Each request's last token: at its first rejected position from the residual
    norm(max(p - q, 0)), after all its drafts from p (the bonus)."""
    device = greedy.device
    rows_t = torch.from_numpy(final_rows.astype(np.int64)).to(device)
    if probs is None:
        return greedy[rows_t]
    p = probs[rows_t].clone()
    rejected = np.flatnonzero(num_accepted < drafts.num_drafts)
    if len(rejected):
        draft_index = (np.cumsum(drafts.num_drafts) - drafts.num_drafts)[rejected] + num_accepted[
            rejected]  # fmt: skip
        which = torch.from_numpy(rejected).to(device)
        index = torch.from_numpy(draft_index.astype(np.int64)).to(device)
        residual = (p[which] - drafts.probs[index]).clamp(min=0)
        # p == q leaves nothing (the draft was rejected with probability 0 then).
        empty = residual.sum(dim=1, keepdim=True) <= 0
        p[which] = torch.where(empty, p[which], residual)
    seeded = [(i, seed, pos) for i, row in enumerate(final_rows.tolist())
              for r, seed, pos in meta.seeded if r == row]  # fmt: skip
    sampled = (p / noise(p, seeded)).argmax(dim=-1)
    return torch.where(meta.temperature[rows_t] == 0, greedy[rows_t], sampled)


def _emitted(drafts: Drafts, num_accepted: np.ndarray, final: torch.Tensor) -> list[int]:
    tokens, start, final_list = [], 0, final.tolist()
    draft_list = drafts.token_ids.tolist()
    for i, (d, a) in enumerate(zip(drafts.num_drafts.tolist(), num_accepted.tolist(),
                                   strict=True)):  # fmt: skip
        tokens.extend(draft_list[start : start + a])
        tokens.append(final_list[i])
        start += d
    return tokens
