"""Checks a GenerateRequest against the model before anything is queued; each
failure says what to change."""

import math
from dataclasses import dataclass

from flagstop.pooling_tasks import task_name
from flagstop.scheduler_svc.core.limits import RequestRejected, check_request_length
from flagstop.scheduler_svc.core.request import stop_token_ids
from flagstop.structured import (
    NONE,
    GrammarError,
    check,
    constraint_from_proto,
    constraint_to_proto,
)
from flagstop.v1 import executor_pb2, generation_pb2

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries; OpenAI's bound is 300
MAX_BIAS = 100.0
MAX_PENALTY = 2.0  # frequency and presence, as OpenAI bounds them
# What each pooling task makes, and where each is asked.
POOLING_OUTPUTS = {"embed": "embeddings", "classify": "classes", "score": "scores",
                   "": "pooled outputs"}  # fmt: skip
POOLING_ROUTES = {
    "embed": "embeddings (/v1/embeddings, gRPC Embed)",
    "classify": "classes (/classify, gRPC Classify)",
    "score": "scores (/score, /rerank, gRPC Score)",
}


@dataclass(slots=True, frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int  # the scheduler's (its KV cache groups), else the pool's
    eos_token_ids: tuple[int, ...]
    # A pooling model's (docs/pooling.md): its tasks (none: it generates), its
    # embedding's size and the sizes it may be cut to (any below it, or those listed).
    pooling_tasks: tuple[str, ...] = ()
    embedding_size: int = 0
    matryoshka_dimensions: tuple[int, ...] = ()
    matryoshka_any: bool = False
    labels: tuple[str, ...] = ()  # a classification model's classes, by index

    @classmethod
    def of(cls, info: generation_pb2.ModelInfo) -> "ModelLimits":
        return cls(
            vocab_size=info.vocab_size, max_model_len=info.max_model_len,
            kv_capacity_tokens=info.kv_capacity_tokens or info.num_blocks * info.block_size,
            eos_token_ids=tuple(info.eos_token_ids), pooling_tasks=tuple(info.pooling_tasks),
            embedding_size=info.embedding_size,
            matryoshka_dimensions=tuple(info.matryoshka_dimensions),
            matryoshka_any=info.matryoshka_any, labels=tuple(info.labels),
        )  # fmt: skip

    @property
    def pooling_kind(self) -> str:
        """What the model is, for a refusal: an embedding model, a classifier."""
        if "embed" in self.pooling_tasks:
            return "an embedding model"
        if "score" in self.pooling_tasks:
            return "a scoring model (a reranker or cross-encoder)"
        return f"a classification model of {len(self.labels)} classes"

    @property
    def pooling_routes(self) -> str:
        """Where its requests go."""
        return ", or ".join(POOLING_ROUTES[task] for task in self.pooling_tasks)

    def dimensions_refusal(self, dimensions: int) -> str | None:
        """Why an embedding cannot be cut to `dimensions` (0: uncut), None: it can."""
        size = self.embedding_size
        if dimensions in (0, size) or dimensions in self.matryoshka_dimensions:
            return None
        if self.matryoshka_any and 0 < dimensions < size:
            return None
        sizes = ", ".join(map(str, (*self.matryoshka_dimensions, size)))
        if self.matryoshka_any:
            sizes = f"any number from 1 to {size}"
        return f"dimensions={dimensions}: this model's embeddings can have {sizes}"


def validate(
    request: generation_pb2.GenerateRequest, prompt_token_ids: list[int], limits: ModelLimits
) -> executor_pb2.SamplingParams:
    """Raises RequestRejected; returns the executor's sampling parameters."""
    _check_tokens(prompt_token_ids, limits)
    if request.HasField("pooling") or limits.pooling_tasks:
        return _pooling(request, len(prompt_token_ids), limits)
    temperature = request.temperature if request.HasField("temperature") else 1.0
    top_p = request.top_p if request.HasField("top_p") else 1.0
    if not (math.isfinite(temperature) and temperature >= 0):
        raise RequestRejected(
            f"temperature must be >= 0 (0 is greedy), got {temperature}", "temperature"
        )
    if not 0 < top_p <= 1:
        raise RequestRejected(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if request.top_k < 0:
        raise RequestRejected(f"top_k must be >= 0 (0 disables it), got {request.top_k}", "top_k")
    _check_lengths(request, len(prompt_token_ids), limits)
    _check_stops(request, limits)
    for name in ("logprobs", "prompt_logprobs"):
        if request.HasField(name) and not 0 <= getattr(request, name) <= MAX_LOGPROBS:
            value = getattr(request, name)
            raise RequestRejected(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", name)
    _check_processing(request, limits)
    _check_salt(request.cache_salt)
    if request.HasField("num_speculative_tokens") and request.num_speculative_tokens < 0:
        raise RequestRejected(
            f"num_speculative_tokens must be >= 0 (0 turns speculation off), got "
            f"{request.num_speculative_tokens}", "num_speculative_tokens",
        )  # fmt: skip
    stops = stop_token_ids(request.stop_token_ids, limits.eos_token_ids, request.ignore_eos)
    params = executor_pb2.SamplingParams(
        temperature=temperature, top_p=top_p, top_k=request.top_k,
        min_tokens=request.min_tokens, stop_token_ids=sorted(stops),
        repetition_penalty=request.repetition_penalty if request.HasField("repetition_penalty")
        else 1.0,
        frequency_penalty=request.frequency_penalty, presence_penalty=request.presence_penalty,
        min_p=request.min_p, logit_bias=request.logit_bias,
    )  # fmt: skip
    if request.HasField("seed"):
        params.seed = request.seed
    if request.HasField("logprobs"):
        params.logprobs = request.logprobs
    if request.HasField("prompt_logprobs"):
        params.prompt_logprobs = request.prompt_logprobs
    if request.HasField("structured_outputs"):
        params.structured_outputs.CopyFrom(_structured(request))
    return params


def _check_processing(request: generation_pb2.GenerateRequest, limits: ModelLimits) -> None:
    """The penalties, min_p and logit_bias: each in its range."""
    if request.HasField("repetition_penalty"):
        value = request.repetition_penalty
        if not (math.isfinite(value) and value > 0):
            raise RequestRejected(
                f"repetition_penalty must be > 0 (1 is off), got {value}", "repetition_penalty"
            )
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(request, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise RequestRejected(f"{name} must be in [-2, 2], got {value}", name)
    if not 0 <= request.min_p <= 1:
        raise RequestRejected(f"min_p must be in [0, 1], got {request.min_p}", "min_p")
    bias = request.logit_bias
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestRejected(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    for token_id, value in bias.items():
        if not 0 <= token_id < limits.vocab_size:
            raise RequestRejected(
                f"logit_bias token id {token_id} is outside the vocabulary "
                f"(0..{limits.vocab_size - 1})", "logit_bias",
            )  # fmt: skip
        if not -MAX_BIAS <= value <= MAX_BIAS:
            raise RequestRejected(f"logit_bias values must be in [-100, 100], got {value}",
                                  "logit_bias")  # fmt: skip


def _structured(request: generation_pb2.GenerateRequest) -> generation_pb2.StructuredOutputs:
    """The constraint's canonical form, once the grammar engine has parsed it."""
    try:
        constraint = constraint_from_proto(request.structured_outputs)
    except GrammarError as e:
        raise RequestRejected(str(e), "structured_outputs") from None
    if constraint.kind != NONE and (request.ignore_eos or request.min_tokens):
        raise RequestRejected(
            "ignore_eos and min_tokens cannot be combined with structured outputs: the "
            "grammar decides where the output ends", "structured_outputs",
        )  # fmt: skip
    if refusal := check(constraint):
        raise RequestRejected(refusal, "structured_outputs")
    return constraint_to_proto(constraint)


def _pooling(request, num_prompt: int, limits: ModelLimits) -> executor_pb2.SamplingParams:
    """A pooling request's parameters; a request of the other kind than the model's is
    refused, saying where to send it."""
    kind, routes = limits.pooling_kind, limits.pooling_routes
    if not request.HasField("pooling"):
        raise RequestRejected(f"this is {kind}: it generates no text; ask it for {routes}",
                              "model")  # fmt: skip
    task = task_name(request.pooling.task)
    outputs = POOLING_OUTPUTS[task]
    if not limits.pooling_tasks:
        raise RequestRejected(f"this model generates text; it makes no {outputs}: serve a "
                              "pooling model for them (docs/pooling.md)", "model")  # fmt: skip
    if task not in limits.pooling_tasks:
        raise RequestRejected(f"this is {kind}: it makes no {outputs}; ask it for {routes}",
                              "model")  # fmt: skip
    check_request_length(num_prompt, None, limits.max_model_len, limits.kv_capacity_tokens,
                         pools=True)  # fmt: skip
    if refusal := limits.dimensions_refusal(request.pooling.dimensions):
        raise RequestRejected(refusal, "dimensions")
    _check_salt(request.cache_salt)
    return executor_pb2.SamplingParams(pooling=request.pooling)


def _check_tokens(prompt_token_ids: list[int], limits: ModelLimits) -> None:
    bad = [t for t in prompt_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestRejected(
            f"token id {bad[0]} is outside the vocabulary (0..{limits.vocab_size - 1})", "prompt"
        )


def _check_lengths(request, num_prompt: int, limits: ModelLimits) -> None:
    max_tokens = request.max_tokens if request.HasField("max_tokens") else None
    check_request_length(num_prompt, max_tokens, limits.max_model_len, limits.kv_capacity_tokens)
    if request.min_tokens < 0:
        raise RequestRejected(f"min_tokens must be >= 0, got {request.min_tokens}", "min_tokens")
    if max_tokens is not None and request.min_tokens > max_tokens:
        raise RequestRejected(
            f"min_tokens ({request.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens"
        )


def _check_stops(request, limits: ModelLimits) -> None:
    if len(request.stop) > MAX_STOP_STRINGS or any(not s for s in request.stop):
        raise RequestRejected(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    bad = [t for t in request.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestRejected(f"stop token id {bad[0]} is outside the vocabulary", "stop_token_ids")


def prompt_ids(request: generation_pb2.GenerateRequest, tokenizer) -> list[int]:
    if request.prompt and request.prompt_token_ids:
        raise RequestRejected("set either prompt or prompt_token_ids, not both", "prompt")
    if request.prompt_token_ids:
        return list(request.prompt_token_ids)
    return tokenizer(request.prompt).input_ids if request.prompt else []


MAX_SALT_CHARS = 256


def _check_salt(cache_salt: str) -> None:
    """A cache salt is printable (a tenant's key salts with a control character:
    router/auth.py) and short (it is hashed into every block's key)."""
    if len(cache_salt) > MAX_SALT_CHARS or not cache_salt.isprintable():
        raise RequestRejected(f"cache_salt must be printable and at most {MAX_SALT_CHARS} "
                              f"characters, got {cache_salt[:40]!r}", "cache_salt")  # fmt: skip
