"""The OpenAI API's requests, and their conversion to the router's GenerateRequest, so
that both fronts share one path (validation included: a range the gRPC API refuses,
this one refuses with the same words).

Unknown fields are ignored, as vLLM does and unlike OpenAI's own API (which answers
400): the field's clients send extras of other providers, and refusing them would
break LiteLLM, gateways and benchmark tools for nothing. But a field we know and do
not implement (penalties, logit_bias, tools, response_format, echo, suffix, best_of)
is refused when set to anything but its neutral value, rather than silently dropped:
its caller expects an output we would not produce."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flagstop.v1 import generation_pb2

MAX_N = 16  # choices per request: each one is a request of its own in the batch
# /v1/completions without max_tokens: OpenAI's default, and vLLM's.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


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
        return self

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
        return request


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
    response_format: Any = None

    def unsupported(self) -> dict[str, Any]:
        return {
            **super().unsupported(), "tools": self.tools, "response_format": self.response_format,
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
