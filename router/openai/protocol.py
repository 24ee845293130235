"""The OpenAI API's requests, and their conversion to the router's GenerateRequest, so
that both fronts share one path (validation included: a range the gRPC API refuses,
this one refuses with the same words).

Unknown fields are ignored, as vLLM does and unlike OpenAI's own API (which answers
400): the field's clients send extras of other providers, and refusing them would
break LiteLLM, gateways and benchmark tools for nothing. But a field we know and do
not implement (suffix, best_of, the legacy functions) is refused when set to
anything but its neutral value, rather than silently dropped: its caller expects an
output we would not produce."""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from flagstop.v1 import generation_pb2

MAX_N = 16  # choices per request: each one is a request of its own in the batch
# /v1/completions without max_tokens: OpenAI's default, and vLLM's.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# Integers as the wire takes them: a number past a protobuf field's range is the
# field's 400, not the conversion's 500.
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]


def first_unencodable(value: Any, path: str = "") -> str | None:
    """The path of the first string the body holds that UTF-8 cannot encode (JSON's
    "\\ud800" escapes decode to lone surrogates), or None. Keys count too."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode()
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        for item in value:  # a prompt's token ids: a type check each
            if type(item) is not int:
                break
        else:
            return None
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and first_unencodable(key) is not None:
            shown = key.encode("utf-8", "backslashreplace").decode()  # the message must encode
            return f"{path}.{shown}" if path else shown
        if isinstance(item, _CONTAINERS):
            where = f"{path}.{key}" if path else str(key)
            if (found := first_unencodable(item, where)) is not None:
                return found
    return None


_CONTAINERS = (str, dict, list)


class EncodableText(BaseModel):
    """A request body whose every string UTF-8 can encode: the tokenizer, the grammar
    engine and protobuf refuse the rest, each with an exception of its own."""

    @model_validator(mode="before")
    @classmethod
    def _utf8_only(cls, data: Any) -> Any:
        if (where := first_unencodable(data)) is not None:
            raise ValueError(
                f"{where} holds text that is not valid Unicode (a lone UTF-16 surrogate); "
                "send UTF-8 text"
            )
        return data


# vLLM's sampling extras that flagstop does not implement; they arrive as extra fields
# and are refused unless neutral (unset, false or empty), never dropped.
VLLM_UNSUPPORTED = (
    "use_beam_search", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
    "include_stop_str_in_output",
)  # fmt: skip


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = "response"
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs its json_schema")
        return self


class StructuredOutputsParams(BaseModel):
    """vLLM's structured_outputs object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# prompt_cache_retention's: OpenAI's in-memory retention lasts minutes (5-10), its
# extended one 24 hours; a retained prompt's priority (docs/sessions.md: 1-100).
IN_MEMORY_TTL_S, DAY_S, RETAINED_PRIORITY = 600.0, 86_400.0, 50


class OpenAIRequest(EncodableText):
    """What completions and chat share."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions, where flagstop has the feature.
    top_k: Int32 | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    priority: Int32 = 0
    # Service objectives (docs/policy.md): targets in ms, tenant and class; the
    # x-llm-d-slo-* and x-flagstop-tenant / -class headers say the same.
    slo_ttft_ms: float | None = Field(None, gt=0)
    slo_tpot_ms: float | None = Field(None, gt=0)
    tenant: str = ""
    request_class: str = ""
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    # Sessions (docs/sessions.md): vLLM's cache_salt (requests share cached KV only
    # under the same salt), OpenAI's prompt_cache_key (a session's turns to one
    # replica) and prompt_cache_retention (keep this prompt's KV: "in_memory" for
    # IN_MEMORY_TTL_S, "24h" clamped to the router's --max-cache-ttl-s).
    cache_salt: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=256)
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields; at most one constraint.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _constraint: generation_pb2.StructuredOutputs | None = PrivateAttr(None)
    _bias: dict[int, float] = PrivateAttr(default_factory=dict)  # logit_bias, by token id
    # Logits processing (OpenAI's penalties and logit_bias, vLLM's repetition_penalty
    # and min_p), and vLLM's prompt logprobs: their ranges are validate()'s, as on gRPC.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    min_p: float = 0.0
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: Int32 | None = None
    # vLLM's per-request cap on speculative draft tokens (0: off for the request).
    num_speculative_tokens: Int32 | None = None
    # Known, not implemented: refused unless neutral.
    best_of: int | None = None

    @model_validator(mode="after")
    def _refuse_what_we_would_drop(self) -> "OpenAIRequest":
        for name, value in self.unsupported().items():
            if value:
                raise ValueError(f"{name} is not supported by flagstop; leave it unset")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported by flagstop; leave it unset")
        self._bias = _token_biases(self.logit_bias or {})
        self._constraint = self._structured_outputs()
        return self

    def _structured_outputs(self) -> generation_pb2.StructuredOutputs | None:
        """The one constraint the request sets, on the gRPC API's terms."""
        found = self._constraints()
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise ValueError(f"set at most one output constraint, got {names}")
        return found[0][1] if found else None

    def _constraints(self) -> list[tuple[str, generation_pb2.StructuredOutputs]]:
        found: list[tuple[str, generation_pb2.StructuredOutputs]] = []
        rf, so = self.response_format, self.structured_outputs or StructuredOutputsParams()
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", generation_pb2.StructuredOutputs(json_object=True)))
        if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            schema = _schema_text(rf.json_schema.schema_)
            strict = bool(rf.json_schema.strict)
            found.append(("response_format", structured_outputs(json_schema=schema, strict=strict)))
        for name, value in (
            ("guided_json", self.guided_json), ("structured_outputs.json", so.json_),
        ):  # fmt: skip
            if value is not None:
                found.append(
                    (name, structured_outputs(json_schema=_schema_text(value), strict=True))
                )
        if so.json_object:
            found.append(("structured_outputs.json_object", structured_outputs(json_object=True)))
        for kind in ("regex", "choice", "grammar"):
            for name, value in ((f"guided_{kind}", getattr(self, f"guided_{kind}")),
                                (f"structured_outputs.{kind}", getattr(so, kind))):  # fmt: skip
                if value is not None:
                    if kind == "choice":
                        value = generation_pb2.Choices(choices=value)
                    found.append((name, structured_outputs(**{kind: value})))
        return found

    def unsupported(self) -> dict[str, Any]:
        """Known fields flagstop does not implement, by name: refused unless neutral."""
        extra = self.model_extra or {}
        return {name: extra.get(name) for name in VLLM_UNSUPPORTED}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        options = self.stream_options
        return options is not None and options.continuous_usage_stats

    def generate_request(
        self, choice: int, max_tokens: int | None
    ) -> generation_pb2.GenerateRequest:
        """The request of one choice. Seeded choices get seed + choice: distinct, and
        the same again for the same request."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        request = generation_pb2.GenerateRequest(
            stop=stop, stop_token_ids=self.stop_token_ids, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, priority=self.priority,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            labels={"user": self.user} if self.user else {}, tenant=self.tenant,
            request_class=self.request_class,
        )  # fmt: skip
        if self.slo_ttft_ms is not None:
            request.slo_ttft_ms = self.slo_ttft_ms
        if self.slo_tpot_ms is not None:
            request.slo_tpot_ms = self.slo_tpot_ms
        if max_tokens is not None:
            request.max_tokens = max_tokens
        if self.temperature is not None:
            request.temperature = self.temperature
        if self.top_p is not None:
            request.top_p = self.top_p
        if self.seed is not None:
            request.seed = self.seed + choice
        if self._constraint is not None:
            request.structured_outputs.CopyFrom(self._constraint)
        request.frequency_penalty = self.frequency_penalty
        request.presence_penalty = self.presence_penalty
        request.min_p = self.min_p
        if self.repetition_penalty is not None:
            request.repetition_penalty = self.repetition_penalty
        request.logit_bias.update(self._bias)
        if self.prompt_logprobs is not None:
            request.prompt_logprobs = self.prompt_logprobs
        if self.num_speculative_tokens is not None:
            request.num_speculative_tokens = self.num_speculative_tokens
        if self.cache_salt:
            request.cache_salt = self.cache_salt
        if self.prompt_cache_key:
            request.session_id = self.prompt_cache_key
        if self.prompt_cache_retention is not None:
            ttl_s = DAY_S if self.prompt_cache_retention == "24h" else IN_MEMORY_TTL_S
            request.retention.CopyFrom(generation_pb2.Retention(priority=RETAINED_PRIORITY,
                                                                ttl_s=ttl_s))  # fmt: skip
        return request


def _token_biases(logit_bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings."""
    biases = {}
    for key, value in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys are token ids, got {key!r}") from None
        if not 0 <= token_id <= INT32_MAX:
            raise ValueError(f"logit_bias keys are token ids, got {key!r}")
        biases[token_id] = value
    return biases


def structured_outputs(**fields) -> generation_pb2.StructuredOutputs:
    return generation_pb2.StructuredOutputs(**fields)


def _schema_text(schema: dict[str, Any] | bool | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


class CompletionRequest(OpenAIRequest):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: Int32 | None = None
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> dict[str, Any]:
        return {**super().unsupported(), "suffix": self.suffix}

    @model_validator(mode="after")
    def _zero_tokens_only_echoed(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo (the prompt, scored, with no output)")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs), nothing generated.
        The engine still runs one step (the prefill gives the logprobs): its token
        is dropped."""
        return self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """One prompt, or several: a choice each (times n)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        return list(prompt) or [""]  # type: ignore[arg-type]

    def choice_request(
        self, prompt: str | list[int], choice: int
    ) -> generation_pb2.GenerateRequest:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        request = self.generate_request(choice, max(1, max_tokens))
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.extend(prompt)
        if self.logprobs is not None:
            request.logprobs = self.logprobs
            if self.echo:  # the echoed prompt's tokens carry logprobs too
                request.prompt_logprobs = max(self.logprobs, request.prompt_logprobs)
        return request
