"""Sampling on the device, vectorised over the batch: the logits processing
(min_tokens bans, logit_bias, repetition/frequency/presence penalties), then greedy at
temperature 0, temperature, min_p, top-k, top-p, per-request seeds and optional top-n
logprobs.

process_logits() is its own step on purpose: it makes the distribution a request is
sampled from, which speculative decoding's rejection sampler needs for the target's
probabilities of each draft position as well. Logprobs are those of the processed
logits (after bans, biases, penalties and a grammar's mask; before temperature)."""

from dataclasses import dataclass

import torch

from flagstop.executor.sampling_params import SampleOutput

_MIX = 0x9E3779B97F4A7C15  # splitmix64's increment: spreads (seed, position) pairs apart


@dataclass(slots=True)
class SamplingMetadata:
    """One step's sampling rows, as device tensors (row i = the i-th sampling request)."""

    temperature: torch.Tensor  # [S] float32
    top_p: torch.Tensor  # [S] float32
    top_k: torch.Tensor  # [S] int64, vocab size where off
    all_greedy: bool
    needs_top_k_top_p: bool
    # (row, seed, position of the token being sampled): the noise of a seeded request
    # depends on these alone, so its tokens do not depend on the rest of the batch.
    seeded: list[tuple[int, int, int]]
    # (row, token ids to forbid) while a request is below min_tokens.
    banned: list[tuple[int, tuple[int, ...]]]
    # Per row: None, or how many top logprobs to return; None for all when nobody asked.
    num_logprobs: list[int | None] | None
    # [S] float32; None when no row sets min_p.
    min_p: torch.Tensor | None = None
    penalties: "Penalties | None" = None
    # (rows, token ids, biases), flattened over the rows that set logit_bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class Penalties:
    """The rows that set a penalty, and what they count: output_counts[i, t] is how
    often token t occurs in row i's output so far, prompt_mask[i, t] whether in its
    prompt (the repetition penalty covers both, as vLLM's does; None when no row sets
    one: the prompts are not scanned)."""

    rows: torch.Tensor  # [P] int64, into the step's sampling rows
    repetition: torch.Tensor  # [P] float32, 1.0: off
    frequency: torch.Tensor  # [P]
    presence: torch.Tensor  # [P]
    output_counts: torch.Tensor  # [P, V] float32
    prompt_mask: torch.Tensor | None  # [P, V] bool


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The logits each row is sampled from, in place: min_tokens bans, logit_bias,
    then the penalties (vLLM's order)."""
    for row, token_ids in meta.banned:
        logits[row, list(token_ids)] = float("-inf")
    if meta.logit_bias is not None:
        rows, token_ids, biases = meta.logit_bias
        logits.index_put_((rows, token_ids), biases, accumulate=True)
    if meta.penalties is not None:
        apply_penalties(logits, meta.penalties)
    return logits


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    rows = logits[p.rows]
    counts = p.output_counts
    in_output = counts > 0
    if p.prompt_mask is not None:
        repetition = p.repetition.unsqueeze(1)
        penalized = torch.where(rows > 0, rows / repetition, rows * repetition)
        rows = torch.where(in_output | p.prompt_mask, penalized, rows)
    rows -= p.frequency.unsqueeze(1) * counts + p.presence.unsqueeze(1) * in_output
    logits[p.rows] = rows


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SampleOutput:
    """logits [S, V] float32 -> one token per row."""
    raw = process_logits(logits, meta)
    greedy = logits.argmax(dim=-1)
    if meta.all_greedy:
        tokens = greedy
    else:
        probs = probabilities(logits, meta)
        # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) samples from p.
        sampled = (probs / noise(probs, meta.seeded)).argmax(dim=-1)
        tokens = torch.where(meta.temperature == 0, greedy, sampled)
    token_list = tokens.tolist()
    if meta.num_logprobs is None:
        return SampleOutput(token_list)
    return SampleOutput(token_list, logprobs=logprobs(raw, tokens, meta.num_logprobs))


def probabilities(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each row samples from: its processed logits after temperature,
    min_p, top-k and top-p (what speculative decoding's losslessness is about)."""
    scaled = logits / meta.temperature.clamp(min=1e-6).unsqueeze(1)
    if meta.min_p is not None:
        scaled = apply_min_p(scaled, meta.min_p)
    if meta.needs_top_k_top_p:
        scaled = apply_top_k_top_p(scaled, meta.top_k, meta.top_p)
    return scaled.softmax(dim=-1)


def noise(probs: torch.Tensor, seeded: list[tuple[int, int, int]], salt: int = 0) -> torch.Tensor:
    """Exp(1) noise per row and token; a seeded row's depends on (seed, position) only
    (salt: for another use than the request's own sampling)."""
    out = torch.empty_like(probs).exponential_()
    for row, seed, position in seeded:
        generator = seeded_generator(seed, position, probs.device, salt)
        out[row] = torch.empty(probs.shape[1], device=probs.device).exponential_(
            generator=generator
        )
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf the tokens less likely than min_p times the row's likeliest."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < floor, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask to -inf what top-k (per-row k) and then top-p (per-row p) exclude."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(1, (top_k - 1).clamp(0, logits.shape[1] - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the tokens ranked above it already reach p (the top one stays).
    outside = probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def seeded_generator(seed: int, position: int, device: torch.device, salt: int = 0):
    """A request's random stream at one position (salt: another use of it)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(((seed * _MIX + position) ^ salt) % (1 << 63))
    return generator


def logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]
) -> list[tuple[float, list[int], list[float]] | None]:
    """Each row's token's logprob and its top num_logprobs[i] (None: not asked)."""
    log_probs = logits.log_softmax(dim=-1)
    chosen = log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    num_top = max(n or 0 for n in num_logprobs)
    top_values, top_ids = log_probs.topk(num_top, dim=-1)
    top_ids_list, top_values_list = top_ids.tolist(), top_values.tolist()
    return [
        None if n is None else _top(chosen[i], top_ids_list[i][:n], top_values_list[i][:n])
        for i, n in enumerate(num_logprobs)
    ]


def _top(chosen: float, ids: list[int], values: list[float]):
    # A grammar's mask leaves -inf tokens: they are no alternatives (and JSON has
    # no -inf).
    if values and values[-1] == float("-inf"):
        kept = [k for k, v in enumerate(values) if v != float("-inf")]
        ids, values = [ids[k] for k in kept], [values[k] for k in kept]
    return chosen, ids, values
