"""Checks a GenerateRequest against the model before anything is queued; each
failure says what to change."""

import math
from dataclasses import dataclass

from flagstop.v1 import executor_pb2, generation_pb2

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20


class InvalidRequest(ValueError):
    pass


@dataclass(slots=True, frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int  # num_blocks * block_size
    eos_token_ids: tuple[int, ...]


def validate(
    request: generation_pb2.GenerateRequest, prompt_token_ids: list[int], limits: ModelLimits
) -> executor_pb2.SamplingParams:
    """Raises InvalidRequest; returns the executor's sampling parameters."""
    _check_tokens(prompt_token_ids, limits)
    temperature = request.temperature if request.HasField("temperature") else 1.0
    top_p = request.top_p if request.HasField("top_p") else 1.0
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidRequest(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    if request.top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {request.top_k}")
    _check_lengths(request, len(prompt_token_ids), limits)
    _check_stops(request, limits)
    if request.HasField("logprobs") and not 0 <= request.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}], got {request.logprobs}")
    stops = set(request.stop_token_ids) | (
        set() if request.ignore_eos else set(limits.eos_token_ids)
    )
    params = executor_pb2.SamplingParams(
        temperature=temperature, top_p=top_p, top_k=request.top_k,
        min_tokens=request.min_tokens, stop_token_ids=sorted(stops),
    )  # fmt: skip
    if request.HasField("seed"):
        params.seed = request.seed
    if request.HasField("logprobs"):
        params.logprobs = request.logprobs
    return params


def _check_tokens(prompt_token_ids: list[int], limits: ModelLimits) -> None:
    if not prompt_token_ids:
        raise InvalidRequest("the prompt is empty: send a prompt or prompt_token_ids")
    bad = [t for t in prompt_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(
            f"token id {bad[0]} is outside the vocabulary (0..{limits.vocab_size - 1})"
        )


def _check_lengths(request, num_prompt: int, limits: ModelLimits) -> None:
    if request.HasField("max_tokens") and request.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be >= 1, got {request.max_tokens}")
    if request.min_tokens < 0:
        raise InvalidRequest(f"min_tokens must be >= 0, got {request.min_tokens}")
    if request.HasField("max_tokens") and request.min_tokens > request.max_tokens:
        raise InvalidRequest(
            f"min_tokens ({request.min_tokens}) exceeds max_tokens ({request.max_tokens})"
        )
    total = num_prompt + (request.max_tokens if request.HasField("max_tokens") else 1)
    what = f"prompt ({num_prompt} tokens) + max_tokens ({request.max_tokens or 1})"
    if total > limits.max_model_len:
        raise InvalidRequest(
            f"{what} exceeds the model's max_model_len of {limits.max_model_len}: "
            "shorten the prompt or lower max_tokens"
        )
    if total > limits.kv_capacity_tokens:
        raise InvalidRequest(
            f"{what} exceeds the whole KV cache ({limits.kv_capacity_tokens} tokens): "
            "shorten the prompt or lower max_tokens"
        )


def _check_stops(request, limits: ModelLimits) -> None:
    if len(request.stop) > MAX_STOP_STRINGS or any(not s for s in request.stop):
        raise InvalidRequest(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
    bad = [t for t in request.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(f"stop token id {bad[0]} is outside the vocabulary")


def prompt_ids(request: generation_pb2.GenerateRequest, tokenizer) -> list[int]:
    if request.prompt and request.prompt_token_ids:
        raise InvalidRequest("set either prompt or prompt_token_ids, not both")
    if request.prompt_token_ids:
        return list(request.prompt_token_ids)
    return tokenizer(request.prompt).input_ids if request.prompt else []
