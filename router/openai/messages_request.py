"""Anthropic's Messages API (POST /v1/messages), its requests: each becomes a chat
completion request (the system prompt as the system message, text blocks as content,
tool_use blocks as an assistant's calls, tool_result blocks as tool messages, tools
with their input_schema, tool_choice, stop_sequences, thinking as the template's
enable_thinking), so that it runs the chat path, validated once.
router/openai/messages.py turns the chat's output into Anthropic's message and events."""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from flagstop.router.openai.chat_request import chat_extras
from flagstop.router.openai.protocol import Count, EncodableText


class Block(BaseModel):
    """A content block: text, tool_use (an assistant's call), tool_result (the
    caller's answer to one), thinking (an assistant's reasoning, as it came back)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list["Block"] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    source: dict[str, Any] | None = None  # an image's: base64 data or a URL


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom", or a server tool's (refused)


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Count | None = None


class JsonOutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Anthropic's output_config: the effort (the template's reasoning_effort) and
    a JSON schema the output is held to (structured outputs)."""

    effort: Literal["low", "medium", "high", "xhigh"] | None = None
    format: JsonOutputFormat | None = None


class CacheControl(BaseModel):
    """The request's own cache_control: its whole prompt retained (docs/sessions.md),
    as a mark on its last block would."""

    type: Literal["ephemeral"]
    ttl: str | None = None


# The chat fields Messages has no place for, and what to send instead.
REFUSED_CHAT_FIELDS = {
    "n": "a Messages reply has one message; send one request per message",
    "logprobs": "the Messages API has no logprobs; use /v1/chat/completions",
    "top_logprobs": "the Messages API has no logprobs; use /v1/chat/completions",
    "prompt_logprobs": "the Messages API has no logprobs; use /v1/chat/completions",
    "return_tokens_as_token_ids": "the Messages API has no logprobs to name tokens in",
    "stream_options": "a Messages stream always ends with its usage (message_delta)",
    "max_completion_tokens": "send max_tokens",
    "response_format": "send output_config.format",
}


class MessagesRequest(EncodableText):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Count
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Tool] | None = Field(None, max_length=1024)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier: both are it
    speed: Literal["standard", "fast"] | None = None
    # Known, not served here: refused unless unset.
    container: Any = None
    mcp_servers: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def chat_body(self) -> dict[str, Any]:
        """The equivalent chat completion request's body. Raises ValueError."""
        self._refuse_unsupported()
        body: dict[str, Any] = {
            "model": self.model, "messages": self._messages(), "stream": self.stream,
            "max_completion_tokens": self.max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "stop": self.stop_sequences,
            "user": (self.metadata or {}).get("user_id"),
        }  # fmt: skip
        if self.tools:
            body["tools"] = [_chat_tool(t) for t in self.tools]
        if self.tool_choice is not None:
            body.update(_chat_tool_choice(self.tool_choice))
        if self.thinking is not None:  # what Qwen3's, DeepSeek-V3.1's and GLM's templates read
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
            if self.thinking.type == "enabled" and self.thinking.budget_tokens:
                body["thinking_token_budget"] = self.thinking.budget_tokens
        if (output := self.output_config) is not None:
            body["reasoning_effort"] = output.effort
            if output.format is not None:
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "output", "schema": output.format.schema_, "strict": True}}  # fmt: skip
        if (retention := self._retention()) is not None:
            body["retention"] = retention
        if self.messages[-1].role == "assistant" and "continue_final_message" not in (
            self.model_extra or {}
        ):  # Anthropic's prefill: the reply continues a last assistant message
            body["continue_final_message"] = True
        body = {k: v for k, v in body.items() if v is not None}
        extra = chat_extras(self.model_extra, REFUSED_CHAT_FIELDS, body)
        if "chat_template_kwargs" in extra and "chat_template_kwargs" in body:
            extra["chat_template_kwargs"] = {**body["chat_template_kwargs"],
                                             **extra["chat_template_kwargs"]}  # fmt: skip
        return {**body, **extra}

    def _refuse_unsupported(self) -> None:
        for name, why in (
            ("container", "flagstop runs no code containers"),
            ("mcp_servers", "flagstop connects to no MCP servers; send their tools as tools"),
            ("diagnostics", "flagstop reports no cache-miss reasons"),
            ("inference_geo", "flagstop serves where it runs"),
            ("user_profile_id", "flagstop has no user profiles; send metadata.user_id"),
            ("workspace_id", "flagstop has no workspaces"),
        ):  # fmt: skip
            if getattr(self, name):
                raise ValueError(f"{name} is not supported ({why}); leave it unset")
        if self.speed == "fast":
            raise ValueError('speed "fast" is not supported: flagstop serves one speed; '
                             'leave speed unset or "standard"')  # fmt: skip

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": _text(self.system, "system")})
        for i, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages.{i}")
        return messages

    def _retention(self) -> dict[str, Any] | None:
        """cache_control's breakpoints as chat's retention (docs/sessions.md): the
        prompt through the last marked block (the chat message it ends up in: a mark
        on the tools or the system prompt keeps the system message, or the first one;
        the request's own cache_control, the whole prompt), kept for the longest ttl
        marked ("5m" unless "1h")."""
        marks: list[tuple[int, str]] = []  # (chat message index, ttl)
        if self.cache_control is not None:  # the request's own: its whole prompt
            ttl = getattr(self.cache_control, "ttl", None) or "5m"
            if ttl not in TTLS:
                raise ValueError(f'cache_control.ttl {ttl!r}: "5m" or "1h"')
            marks.append((len(self._messages()) - 1, ttl))
        if self.tools and any(_marked(t) for t in self.tools):
            marks.append((0, _ttl(next(t for t in self.tools if _marked(t)))))
        system = self.system if isinstance(self.system, list) else []
        marks += [(0, _ttl(b)) for b in system if _marked(b)]
        index = int(bool(self.system)) - 1
        for message in self.messages:
            index += len(_chat_messages(message, "")) if isinstance(message.content, list) else 1
            if isinstance(message.content, list):
                marks += [(index, _ttl(b)) for b in message.content if _marked(b)]
        if not marks:
            return None
        ttl_s = max(TTLS[ttl] for _, ttl in marks)
        return {"ttl_s": ttl_s, "through_message": max(i for i, _ in marks)}


# cache_control's ttl: Anthropic's two, "5m" the default.
TTLS = {"5m": 300.0, "1h": 3600.0}


def _marked(part: BaseModel) -> bool:
    control = (part.model_extra or {}).get("cache_control")
    return isinstance(control, dict) and control.get("type") == "ephemeral"


def _ttl(part: BaseModel) -> str:
    ttl = (part.model_extra or {})["cache_control"].get("ttl", "5m")
    if ttl not in TTLS:
        raise ValueError(f'cache_control.ttl {ttl!r}: "5m" or "1h"')
    return ttl


def _chat_messages(message: Message, where: str) -> list[dict[str, Any]]:
    """A message's blocks as chat messages: tool results first (tool messages, in
    order), then the text and calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out, text, calls = [], [], []
    for j, block in enumerate(message.content):
        at = f"{where}.content.{j}"
        if block.type == "text":
            text.append(block.text or "")
        elif block.type == "image" and message.role == "user":
            text.append({"type": "image_url", "image_url": {"url": _image_url(block, at)}})
        elif block.type == "tool_use" and message.role == "assistant":
            if not block.id or not block.name:
                raise ValueError(f"{at}: a tool_use block needs its id and name")
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input or {})}})  # fmt: skip
        elif block.type == "tool_result" and message.role == "user":
            if not block.tool_use_id:
                raise ValueError(f"{at}: a tool_result block needs the tool_use_id it answers")
            content = _text(block.content or "", at)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"Error: {content}" if block.is_error else content})  # fmt: skip
        elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue  # earlier turns' reasoning: templates leave it out of the prompt
        else:
            raise ValueError(
                f"{at}: {message.role} content blocks of type {block.type!r} are "
                "not supported (text, image, tool_use, tool_result and thinking are)"
            )
    if text or calls or not out:
        chat: dict[str, Any] = {"role": message.role, "content": _content(text)}
        if calls:
            chat["tool_calls"] = calls
        out.append(chat)
    return out


def _image_url(block: Block, where: str) -> str:
    """An image block's source as a chat image_url: base64 data as a data: URL."""
    source = block.source or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ValueError(f"{where}: an image block's source is {{type: base64, media_type, data}} "
                     "or {type: url, url}")  # fmt: skip


def _content(parts: list) -> str | list[dict[str, Any]]:
    """Text blocks joined; with images, chat content parts in order."""
    if all(isinstance(p, str) for p in parts):
        return "".join(parts)
    return [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]


def _text(content: str | list[Block], where: str) -> str:
    if isinstance(content, str):
        return content
    if bad := [b.type for b in content if b.type != "text"]:
        raise ValueError(f"{where}: only text blocks are supported here, got {bad[0]!r}")
    return "".join(b.text or "" for b in content)


def _chat_tool(tool: Tool) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise ValueError(
            f"tools: {tool.name!r} is a server tool ({tool.type}), which flagstop "
            "does not run; send client tools (name, description, input_schema)"
        )
    function = {"name": tool.name, "description": tool.description,
                "parameters": tool.input_schema}  # fmt: skip
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _chat_tool_choice(choice: ToolChoice) -> dict[str, Any]:
    body: dict[str, Any] = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if choice.type == "tool":
        if not choice.name:
            raise ValueError("tool_choice of type tool needs the tool's name")
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return body
