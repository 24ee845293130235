"""The chat completions request (and its messages, tools and tool choice), as the
OpenAI API defines it; its conversion to GenerateRequests is the shared
OpenAIRequest's (protocol.py), the tool choice a constraint of its own."""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flagstop.router.media.inputs import ImageRef
from flagstop.router.openai.errors import OpenAIError
from flagstop.router.openai.protocol import (
    VLLM_UNSUPPORTED,
    Count,
    Int32,
    OpenAIRequest,
    structured_outputs,
)
from flagstop.v1 import generation_pb2


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str = Field(min_length=1)  # data:, http(s): or file: (docs/multimodal.md)
    detail: Literal["auto", "low", "high"] | None = None  # accepted, not used


class ImageURLPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as the API carries it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's reply to one

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates read it (Hugging Face's convention: a call's
        arguments as an object, where the API sends JSON text)."""
        content: Any = self.content
        if isinstance(content, list):
            content = _template_parts(content) if self.images() else \
                "".join(part.text for part in content if isinstance(part, TextPart))  # fmt: skip
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments(c)}}
                for c in self.tool_calls
            ]  # fmt: skip
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def images(self) -> list[ImageURLPart]:
        content = self.content
        return [p for p in content if isinstance(p, ImageURLPart)] if isinstance(content, list) \
            else []  # fmt: skip


def _template_parts(parts: list) -> list[dict[str, str]]:
    """Content with images as chat templates read it (Hugging Face's convention): text
    parts, and an {"type": "image"} where each image goes (its placeholder)."""
    return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
            for p in parts]  # fmt: skip


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:  # /tokenize renders what it is given; chat refused it already
        return call.function.arguments


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def chat_extras(extra: dict[str, Any] | None, refused: dict[str, str],
                own: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """The chat fields another chat-shaped API's request (Responses, Messages) sets
    beside its own, passed to chat, which honours or refuses each as it does its own
    (docs/openai.md, "Fields by route"). refused: the chat fields the route has no
    place for, each with what to send instead; own: the chat body the route's own
    fields make (a field set both ways is refused). Fields chat does not know are
    ignored, as on every route. Raises ValueError naming the field."""
    passed = {}
    for name, value in (extra or {}).items():
        if name not in CHAT_FIELDS or value is None:
            continue
        if name in refused:
            if _neutral(name, value):
                continue
            raise ValueError(f"{name}: {refused[name]}")
        if own.get(name) is not None and name not in MERGED:
            raise ValueError(f"{name} is set by this API's own field too: leave one of them")
        passed[name] = value
    return passed


def _neutral(name: str, value: Any) -> bool:
    """A refused field set to what it is when unset (clients send defaults)."""
    return value is False or (name == "n" and value == 1)


# apply_chat_template's own arguments: the request sets them by their own fields.
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "chat_template", "tokenize", "documents")


class TemplateParams(BaseModel):
    """How the messages become a prompt (vLLM's chat fields): variables the template
    reads (chat_template_kwargs: a thinking switch, reasoning_effort), the generation
    prompt, an assistant message to continue, a template of the request's own."""

    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    add_generation_prompt: bool | None = None  # default: true, false when continuing
    continue_final_message: bool = False
    chat_template: str | None = Field(None, max_length=1 << 17)

    def template_options(self, defaults: dict[str, Any] | None) -> dict[str, Any]:
        """render_text's keyword arguments; defaults: --default-chat-template-kwargs.
        Raises ValueError."""
        variables = {**(defaults or {}), **(self.chat_template_kwargs or {})}
        if reserved := [k for k in RESERVED_TEMPLATE_VARIABLES if k in variables]:
            raise ValueError(f"chat_template_kwargs.{reserved[0]} is the request's own "
                             f"field: send {reserved[0]} beside the messages")  # fmt: skip
        if self.reasoning_effort is not None:
            variables.setdefault("reasoning_effort", self.reasoning_effort)
        # Inside chat_template_kwargs as vLLM's clients send them, or as fields.
        go_on = bool(variables.pop("continue_final_message", self.continue_final_message))
        generation_prompt = variables.pop("add_generation_prompt", self.add_generation_prompt)
        if generation_prompt and go_on:
            raise ValueError("continue_final_message continues the last message, "
                             "add_generation_prompt opens a new one: set one of them")  # fmt: skip
        return {"add_generation_prompt": not go_on if generation_prompt is None
                else bool(generation_prompt), "continue_final_message": go_on,
                "template": self.chat_template, "variables": variables}  # fmt: skip


class RetentionHint(BaseModel):
    """flagstop's chat extension (what Anthropic's cache_control becomes): keep the
    prompt's KV through message through_message (None: all of it) for ttl_s."""

    ttl_s: float = Field(gt=0)
    priority: int = Field(50, ge=1, le=100)
    through_message: int | None = Field(None, ge=0)


class ChatCompletionRequest(TemplateParams, OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    retention: RetentionHint | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=1024)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the reply
    # vLLM's: the reasoning's tokens at most; then its end is forced (a reasoning parser).
    thinking_token_budget: Count | None = None
    # The legacy function calling: refused, with what to send instead.
    functions: list[Any] | None = None
    function_call: Any = None

    def unsupported(self) -> dict[str, Any]:
        # vLLM's chat echo (the last message repeated): not implemented.
        return {**super().unsupported(), "echo": (self.model_extra or {}).get("echo")}

    @model_validator(mode="after")
    def _tools_known(self) -> "ChatCompletionRequest":
        if self.functions is not None or self.function_call is not None:
            raise ValueError("functions and function_call are the deprecated form of tools "
                             "and are not supported: send tools and tool_choice")  # fmt: skip
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and self.named_tool is None:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        return self

    @model_validator(mode="after")
    def _tool_history_valid(self) -> "ChatCompletionRequest":
        """The history's calls and results checked as OpenAI checks them: a result
        answers a call made before it, and a call's arguments are JSON."""
        called: set[str] = set()
        for i, message in enumerate(self.messages):
            for call in message.tool_calls or ():
                try:
                    json.loads(call.function.arguments)
                except ValueError:
                    raise ValueError(f"messages.{i}.tool_calls: the arguments of call "
                                     f"{call.id!r} are not JSON") from None  # fmt: skip
                called.add(call.id)
            if message.role != "tool":
                continue
            if message.tool_call_id is None:
                raise ValueError(f"messages.{i}: a tool message needs tool_call_id, the id of "
                                 "the call it answers")  # fmt: skip
            if message.tool_call_id not in called:
                raise ValueError(f"messages.{i}.tool_call_id: {message.tool_call_id!r} answers "
                                 "no call of an assistant message before it")  # fmt: skip
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto (the model may call; a parser reads its calls), required or
        named (the output is constrained to calls)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def named_tool(self) -> ToolDefinition | None:
        choice = self.tool_choice
        if not isinstance(choice, NamedToolChoice):
            return None
        return next((t for t in self.tools or () if t.function.name == choice.function.name),
                    None)  # fmt: skip

    def _constraints(self) -> list[tuple[str, generation_pb2.StructuredOutputs]]:
        found = super()._constraints()
        if (tool := self.named_tool) is not None:
            schema = arguments_schema(tool)
        elif self.tool_choice == "required" and self.tools:
            schema = required_schema(self.tools, self.parallel_tool_calls)
        else:
            return found
        return [
            *found,
            ("tool_choice", structured_outputs(json_schema=json.dumps(schema), strict=True)),
        ]

    def image_refs(self) -> list[ImageRef]:
        """Its images in prompt order, each named by where it is in the request."""
        return [ImageRef(f"messages[{i}].content[{j}]", url=part.image_url.url)
                for i, m in enumerate(self.messages) if isinstance(m.content, list)
                for j, part in enumerate(m.content) if isinstance(part, ImageURLPart)]  # fmt: skip

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them; none when tool_choice is none."""
        if self.tool_mode == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

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


# Every field a chat request takes, the ones it refuses by name included.
CHAT_FIELDS = frozenset({*ChatCompletionRequest.model_fields, *VLLM_UNSUPPORTED, "echo"})
# Merged with what the route's own fields set (Messages' thinking switch goes in it).
MERGED = frozenset({"chat_template_kwargs"})


def as_chat(body) -> ChatCompletionRequest:
    """The chat completion request another chat-shaped API's request (Responses,
    Messages) stands for, from its chat_body(); validated as chat validates. Raises
    OpenAIError (400) naming the field."""
    try:
        return ChatCompletionRequest(**body.chat_body())
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = f"{where}: {first['msg'].removeprefix('Value error, ')}"
    except ValueError as e:  # chat_body()'s own refusals
        message = str(e)
    raise OpenAIError(400, message)


def arguments_schema(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def required_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": a JSON array of one or more {name, arguments}, each
    call one of the tools with arguments of its schema."""
    calls = [{"type": "object", "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "arguments": arguments_schema(t)},
              "required": ["name", "arguments"]} for t in tools]  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
