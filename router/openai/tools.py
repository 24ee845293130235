"""Tool calls in a chat's output: the structured-output constraint that makes a
"required" or named call valid by construction, and which parser turns the model's
text into the API's tool_calls, streamed or whole (the families' formats:
router/openai/tool_parsers/).

Each parser takes the choice's text as it arrives, and its finish reason once it
ended, and gives back (content to show, tool-call deltas in the stream's shape: a call
whole, once it is complete); `calls` holds the complete calls, for the whole response
and finish_reason "tool_calls"."""

from typing import Any, Protocol

from flagstop.router.openai.chat_request import ChatCompletionRequest
from flagstop.router.openai.tool_parsers import PARSERS, NamedCall, RequiredCalls
from flagstop.scheduler_svc.core.limits import RequestRejected


class ToolParser(Protocol):
    calls: list[dict[str, Any]]

    def feed(self, text: str, finish: str | None) -> tuple[str, list[dict[str, Any]]]: ...


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
                "(the model family's: hermes, qwen3_coder, llama3_json, mistral, deepseek_v3, "
                'kimi_k2, glm45, openai); or send tool_choice "required", a named function or '
                '"none"'
            )  # fmt: skip
            raise RequestRejected(message, "tool_choice")
        parser, tools = PARSERS[configured], body.tools
        return lambda: parser(tools)
    return lambda: None
