"""The OpenAI API's requests, and their conversion to the router's GenerateRequest, so
that both fronts share one path (validation included: a range the gRPC API refuses,
this one refuses with the same words).

Unknown fields are ignored, as vLLM does and unlike OpenAI's own API (which answers
400): the field's clients send extras of other providers, and refusing them would
break LiteLLM, gateways and benchmark tools for nothing. But a field we know and do
not implement (penalties, logit_bias, tools, echo, suffix, best_of)
is refused when set to anything but its neutral value, rather than silently dropped:
its caller expects an output we would not produce."""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from flagstop.v1 import generation_pb2

MAX_N = 16  # choices per request: each one is a request of its own in the batch
# /v1/completions without max_tokens: OpenAI's default, and vLLM's.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


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


class OpenAIRequest(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions, where flagstop has the feature.
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    priority: int = 0
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields; at most one constraint.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _constraint: generation_pb2.StructuredOutputs | None = PrivateAttr(None)
    # Known, not implemented: refused unless neutral.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _refuse_what_we_would_drop(self) -> "OpenAIRequest":
        for name, value in self.unsupported().items():
            if value:
                raise ValueError(f"{name} is not supported by flagstop; leave it unset")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported by flagstop; leave it unset")
        self._constraint = self._structured_outputs()
        return self

    def _structured_outputs(self) -> generation_pb2.StructuredOutputs | None:
        """The one constraint the request sets, on the gRPC API's terms."""
        found: list[tuple[str, generation_pb2.StructuredOutputs]] = []
        rf, so = self.response_format, self.structured_outputs or StructuredOutputsParams()
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", generation_pb2.StructuredOutputs(json_object=True)))
        if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            schema = _schema_text(rf.json_schema.schema_)
            strict = bool(rf.json_schema.strict)
            found.append(("response_format", _so(json_schema=schema, strict=strict)))
        for name, value in (
            ("guided_json", self.guided_json), ("structured_outputs.json", so.json_),
        ):  # fmt: skip
            if value is not None:
                found.append((name, _so(json_schema=_schema_text(value), strict=True)))
        if so.json_object:
            found.append(("structured_outputs.json_object", _so(json_object=True)))
        for kind in ("regex", "choice", "grammar"):
            for name, value in ((f"guided_{kind}", getattr(self, f"guided_{kind}")),
                                (f"structured_outputs.{kind}", getattr(so, kind))):  # fmt: skip
                if value is not None:
                    if kind == "choice":
                        value = generation_pb2.Choices(choices=value)
                    found.append((name, _so(**{kind: value})))
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise ValueError(f"set at most one output constraint, got {names}")
        return found[0][1] if found else None

    def unsupported(self) -> dict[str, Any]:
        return {
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "logit_bias": self.logit_bias,
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

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
            labels={"user": self.user} if self.user else {},
        )  # fmt: skip
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
        return request


def _so(**fields) -> generation_pb2.StructuredOutputs:
    return generation_pb2.StructuredOutputs(**fields)


def _schema_text(schema: dict[str, Any] | bool | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


class CompletionRequest(OpenAIRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> dict[str, Any]:
        return {**super().unsupported(), "echo": self.echo, "suffix": self.suffix}

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

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
        request = self.generate_request(choice, max_tokens)
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.extend(prompt)
        if self.logprobs is not None:
            request.logprobs = self.logprobs
        return request


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None

    def unsupported(self) -> dict[str, Any]:
        return {
            **super().unsupported(), "tools": self.tools,
            "tool_choice": self.tool_choice not in (None, "none") and self.tool_choice,
        }  # fmt: skip

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    def choice_request(self, prompt_token_ids: list[int], choice: int):
        max_tokens = self.max_completion_tokens or self.max_tokens
        request = self.generate_request(choice, max_tokens)
        request.prompt_token_ids.extend(prompt_token_ids)
        if self.logprobs:
            request.logprobs = self.top_logprobs or 0
        return request
