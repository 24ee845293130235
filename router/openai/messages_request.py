"""Anthropic's Messages API (POST /v1/messages), its requests: each becomes a chat
completion request (the system prompt as the system message, text blocks as content,
tool_use blocks as an assistant's calls, tool_result blocks as tool messages, tools
with their input_schema, tool_choice, stop_sequences, thinking as the template's
enable_thinking), so that it runs the chat path, validated once.
router/openai/messages.py turns the chat's output into Anthropic's message and events."""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from flagstop.router.openai.chat_request import shared_with_chat
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
    # Known, not served here: refused unless unset.
    container: Any = None
    mcp_servers: Any = None

    def chat_body(self) -> dict[str, Any]:
        """The equivalent chat completion request's body. Raises ValueError."""
        for name in ("container", "mcp_servers"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by flagstop; leave it unset")
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
        extra = shared_with_chat(self.model_extra)
        if self.thinking is not None:  # what Qwen3's, DeepSeek-V3.1's and GLM's templates read
            switch = {"enable_thinking": self.thinking.type != "disabled"}
            extra["chat_template_kwargs"] = {**switch, **extra.get("chat_template_kwargs", {})}
            if self.thinking.type == "enabled" and self.thinking.budget_tokens:
                extra["thinking_token_budget"] = self.thinking.budget_tokens
        body = {k: v for k, v in body.items() if v is not None}
        return {**extra, **body}

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": _text(self.system, "system")})
        for i, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages.{i}")
        return messages


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
                "not supported (text, tool_use, tool_result and thinking are)"
            )
    if text or calls or not out:
        chat: dict[str, Any] = {"role": message.role, "content": "".join(text)}
        if calls:
            chat["tool_calls"] = calls
        out.append(chat)
    return out


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
