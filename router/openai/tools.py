"""Tool calls in a chat's output: the structured-output constraint that makes a
"required" or named call valid by construction, and the parsers that turn the
model's text into the API's tool_calls, streamed or whole.

Each parser takes the choice's text as it arrives and gives back (content to show,
tool-call deltas in the stream's shape); `calls` holds the complete calls, for the
whole response and finish_reason "tool_calls"."""

import json
import uuid
from typing import Any, Protocol

from flagstop.router.openai.chat_request import ChatCompletionRequest, ToolSpec
from flagstop.scheduler_svc.core.limits import RequestRejected

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_schema(tool: ToolSpec) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def required_schema(tools: list[ToolSpec], parallel: bool) -> dict[str, Any]:
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


class ToolParser(Protocol):
    calls: list[dict[str, Any]]

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]: ...


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def _delta(index: int, call: dict[str, Any]) -> dict[str, Any]:
    return {"index": index, **call}


class NamedCall:
    """A named tool_choice: the whole output is the call's arguments (constrained to
    its schema), streamed as argument deltas after a first delta naming the call."""

    def __init__(self, name: str) -> None:
        self.calls = [_call(name, "")]
        self.opened = False

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        call = self.calls[0]
        call["function"]["arguments"] += text
        if not self.opened:
            self.opened = True
            return "", [_delta(0, {**call, "function": {**call["function"], "arguments": text}})]
        return "", [{"index": 0, "function": {"arguments": text}}] if text else []


class RequiredCalls:
    """tool_choice "required": the output is a JSON array of calls, read whole at its
    end (its calls are sent then). Output cut short by max_tokens stays content."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.text = ""

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += text
        if not final:
            return "", []
        try:
            items = json.loads(self.text)
            self.calls = [_call(c["name"], _json(c["arguments"])) for c in items]
        except (ValueError, TypeError, KeyError):
            return self.text, []
        return "", [_delta(i, call) for i, call in enumerate(self.calls)]


class HermesParser:
    """tool_choice "auto" with --tool-call-parser hermes: text is content until
    <tool_call>, the JSON up to </tool_call> is a call ({"name", "arguments"}). A
    possible start of the tag at a chunk's end is held back, and so is trailing
    whitespace (dropped when a call follows; whitespace after a call is dropped too);
    a call whose JSON does not parse stays content."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.buffer, self.inside, self.space, self.after_call = "", False, "", False

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self._advance(content, deltas, final):
            pass
        if final and self.space and not self.calls:
            content.append(self.space)
        return "".join(content), deltas

    def _advance(self, content: list[str], deltas: list, final: bool) -> bool:
        """One tag found (True) or the buffer left as it must wait (False)."""
        buffer = self.buffer
        if not self.inside:
            start = buffer.find(HERMES_OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(buffer, HERMES_OPEN)
                self._emit(content, buffer[: len(buffer) - keep])
                self.buffer = buffer[len(buffer) - keep :]
                return False
            self._emit(content, buffer[:start], before_call=True)
            self.buffer, self.inside = buffer[start + len(HERMES_OPEN) :], True
            return True
        end = buffer.find(HERMES_CLOSE)
        if end < 0 and not final:
            return False
        body = buffer if end < 0 else buffer[:end]
        self.buffer = "" if end < 0 else buffer[end + len(HERMES_CLOSE) :]
        self.inside = False
        call = _hermes_call(body)
        if call is None:
            self._emit(content, HERMES_OPEN + body + ("" if end < 0 else HERMES_CLOSE))
        else:
            self.calls.append(call)
            deltas.append(_delta(len(self.calls) - 1, call))
            self.space, self.after_call = "", True
        return end >= 0

    def _emit(self, content: list[str], text: str, before_call: bool = False) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        text = self.space + text
        body = text.rstrip()
        self.space = "" if before_call else text[len(body) :]
        content.append(body)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _hermes_call(body: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    return _call(parsed["name"], _json(parsed.get("arguments", {})))


def _json(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def parser_factory(body: ChatCompletionRequest, configured: str | None):
    """What makes each choice's tool-call parser (or None), by the request's mode;
    configured: --tool-call-parser. Raises RequestRejected for "auto" without one."""
    mode = body.tool_mode
    if mode == "named":
        name = body.named_tool.function.name  # type: ignore[union-attr]
        return lambda: NamedCall(name)
    if mode == "required":
        return RequiredCalls
    if mode == "auto":
        if configured is None:
            message = (
                'tool_choice "auto" needs the router started with --tool-call-parser '
                '(hermes); or send tool_choice "required", a named function or "none"'
            )
            raise RequestRejected(message, "tool_choice")
        return HermesParser
    return lambda: None
