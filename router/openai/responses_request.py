"""OpenAI's Responses API (POST /v1/responses), its requests: each becomes a chat
completion request (instructions as the system message, input items as messages,
text.format as response_format, flat function tools as chat tools, the sampling
fields chat shares as they are), so that it runs the chat path and every field is
validated once; router/openai/responses_stream.py turns the chat's output into the
Responses object and events. Nothing is stored: previous_response_id, background and
conversation are refused, like every other field we know and do not implement."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from flagstop.router.openai.chat_request import chat_extras
from flagstop.router.openai.protocol import Count, EncodableText


class InputPart(BaseModel):
    type: Literal["input_text", "output_text", "text", "input_image"]
    text: str = ""
    image_url: str | None = None  # input_image: a data:, http(s): or file: URL
    detail: str | None = None  # accepted, not used


def _text(content: "str | list[InputPart] | None") -> str:
    if isinstance(content, list):
        if any(part.type == "input_image" for part in content):
            raise ValueError("input_image parts go in a message's content only")
        return "".join(part.text for part in content)
    return content or ""


def _content(content: "str | list[InputPart] | None") -> str | list[dict[str, Any]]:
    """A message's content as chat's: its text, or with images its parts in order."""
    if not isinstance(content, list) or all(p.type != "input_image" for p in content):
        return _text(content)
    parts: list[dict[str, Any]] = []
    for part in content:
        if part.type != "input_image":
            parts.append({"type": "text", "text": part.text})
        elif not part.image_url:
            raise ValueError("an input_image part needs its image_url (file_id is not "
                             "supported)")  # fmt: skip
        else:
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
    return parts


class InputItem(BaseModel):
    """A message, a function call the model made, or its output."""

    model_config = ConfigDict(extra="allow")

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None  # a function's output: text, or its parts


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    format: TextFormat | None = None


LOGPROBS_INCLUDE = "message.output_text.logprobs"


class Reasoning(BaseModel):
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; no summarizer


class StreamOptions(BaseModel):
    include_obfuscation: bool | None = None  # true refused: no padding is added


# The chat fields the Responses API has no place for, and what to send instead.
REFUSED_CHAT_FIELDS = {
    "n": "a response has one output; send one request per output",
    "logprobs": f"send top_logprobs with include [{LOGPROBS_INCLUDE!r}]",
    "prompt_logprobs": "the Responses API has no prompt logprobs; use /v1/chat/completions",
    "max_tokens": "send max_output_tokens",
    "max_completion_tokens": "send max_output_tokens",
    "response_format": "send text.format",
}


class ResponsesRequest(EncodableText):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None
    store: bool | None = None  # accepted; nothing is stored (the response says store false)
    top_logprobs: Count | None = None
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["disabled", "auto"] | None = None
    user: str | None = None  # the scheduling policy's user label (as chat's)
    safety_identifier: str | None = None  # the same label, OpenAI's newer name
    # Sessions (docs/sessions.md): passed to chat as they are.
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    stream_options: StreamOptions | None = None
    # Known, not implemented: refused unless neutral.
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None  # a stored prompt template
    max_tool_calls: int | None = None
    prompt_cache_options: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None

    def chat_body(self) -> dict[str, Any]:
        """The equivalent chat completion request's body. Raises ValueError."""
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id: flagstop stores no responses; send the "
                             "conversation in input")  # fmt: skip
        self._refuse_unsupported()
        body: dict[str, Any] = {
            "model": self.model, "messages": self._messages(), "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
        }  # fmt: skip
        if self.tools:
            body["tools"] = [_chat_tool(t) for t in self.tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            body["response_format"] = _response_format(self.text.format)
        if LOGPROBS_INCLUDE in (self.include or ()) or self.top_logprobs is not None:
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        body["user"] = self.safety_identifier or self.user
        body["prompt_cache_key"] = self.prompt_cache_key
        body["prompt_cache_retention"] = self.prompt_cache_retention
        body = {k: v for k, v in body.items() if v is not None}
        return {**body, **chat_extras(self.model_extra, REFUSED_CHAT_FIELDS, body)}

    def _refuse_unsupported(self) -> None:
        if self.background:
            raise ValueError("background responses are not supported; leave background unset")
        if self.conversation is not None:
            raise ValueError("conversation: flagstop stores no conversations; send it in input")
        if self.prompt is not None:
            raise ValueError("prompt: stored prompt templates are not supported; send input")
        if self.max_tool_calls is not None:
            raise ValueError("max_tool_calls is not supported; leave it unset")
        if self.truncation == "auto":
            raise ValueError('truncation "auto" is not supported: an input past the model\'s '
                             'length is refused; leave truncation "disabled"')  # fmt: skip
        for name, why in (
            ("prompt_cache_options", "explicit cache breakpoints and lifetimes"),
            ("context_management", "server-side context compaction"),
            ("moderation", "moderation"), ("image", "image generation"),
            ("access_programs", "access programs"),
        ):  # fmt: skip
            if getattr(self, name):
                raise ValueError(f"{name}: flagstop has no {why}; leave it unset")
        if self.service_tier not in (None, "auto", "default"):
            raise ValueError(f"service_tier {self.service_tier!r} is not supported: flagstop "
                             'serves one tier; leave it unset, "auto" or "default"')  # fmt: skip
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise ValueError("stream_options.include_obfuscation: flagstop pads no stream "
                             "events; leave it unset or false")  # fmt: skip
        if unknown := [i for i in self.include or () if i != LOGPROBS_INCLUDE]:
            raise ValueError(f"include: {unknown[0]!r} is not supported; only "
                             f"{LOGPROBS_INCLUDE!r} is")  # fmt: skip

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            messages.append(_message(item, messages))
        return [m for m in messages if m]


def _message(item: InputItem, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One input item as a chat message; a function call joins the assistant message
    before it (returning {}, dropped) when there is one."""
    if item.type == "function_call":
        if not (item.call_id and item.name and item.arguments is not None):
            raise ValueError("a function_call input item needs call_id, name and arguments")
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            return {}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if item.type == "function_call_output":
        if item.call_id is None or item.output is None:
            raise ValueError("a function_call_output input item needs call_id and output")
        return {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
    if item.role is None:
        raise ValueError("a message input item needs its role")
    return {"role": item.role, "content": _content(item.content)}


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    if tool.type != "function" or not tool.name:
        raise ValueError(f"tools: only function tools (with a name) are supported, got "
                         f"{tool.type!r}")  # fmt: skip
    function = {"name": tool.name, "description": tool.description,
                "parameters": tool.parameters, "strict": tool.strict}  # fmt: skip
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.schema_ is None:
        raise ValueError("text.format of type json_schema needs its schema")
    return {
        "type": "json_schema",
        "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict},
    }
