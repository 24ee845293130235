"""Anthropic's Messages API, as vLLM and SGLang serve it: POST /v1/messages (whole, or
streamed as Anthropic's events) and /v1/messages/count_tokens. A request runs the chat
path (router/openai/messages_request.py); its output comes back as content blocks:
thinking (the reasoning parser's), text, tool_use. The API key is taken as
`x-api-key`, as Anthropic's clients send it, or as a bearer token; errors come in
Anthropic's shape (router/openai/errors.py).

A stream's events, in Anthropic's order:

    message_start, then per block: content_block_start, content_block_delta..
    (thinking_delta, text_delta, input_json_delta), content_block_stop;
    message_delta (stop_reason, usage), message_stop."""

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from flagstop.router.auth import REFUSAL
from flagstop.router.openai.bodies import Choice, ResponseBuilder
from flagstop.router.openai.chat_request import as_chat
from flagstop.router.openai.errors import (
    OpenAIError,
    anthropic_error,
    from_failure,
    internal_error,
    json_response,
)
from flagstop.router.openai.front import Front, cache_ttl_header, until_disconnected
from flagstop.router.openai.messages_request import MessagesRequest
from flagstop.router.openai.sse import json_line
from flagstop.router.pending import RequestFailed


def authorized_by_key(request: Request) -> None:
    """The API key as x-api-key (Anthropic's clients) or a bearer token."""
    headers = request.headers
    given = headers.get("authorization") or f"Bearer {headers.get('x-api-key', '')}"
    if not request.app.state.front.engine.keys.matches(given):
        raise OpenAIError(401, REFUSAL, code="invalid_api_key")


api = APIRouter(dependencies=[Depends(authorized_by_key)])


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 0  # count_tokens takes none


@api.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, front: Front) -> Response:
    front.check_model(body.model)
    return json_response({"input_tokens": len(front.chat_path.render(as_chat(body)).token_ids)})


@api.post("/v1/messages")
async def messages(body: MessagesRequest, http: Request, front: Front) -> Response:
    front.check_model(body.model)
    builder, choice, pending = await front.start_one(http, as_chat(body), "chat")
    events = MessageEvents(body.model, builder, retained_tokens(pending))
    if body.stream:
        chunks = await front.started(http, front.engine.stream(pending), [pending])
        return StreamingResponse(stream(front.engine, choice, pending, events, chunks),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          **cache_ttl_header([pending])})  # fmt: skip
    await until_disconnected(http, collect(front.engine, choice, pending, events))
    return json_response(events.message(choice), headers=cache_ttl_header([pending]))


def retained_tokens(pending) -> int:
    """The prompt tokens its cache_control keeps (0: none)."""
    add = pending.add
    if not add.HasField("retention"):
        return 0
    return add.retention.num_tokens or len(add.prompt_token_ids)


STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


class MessageEvents:
    """One choice's output as Anthropic's content blocks, opened and closed as the chat
    builder's deltas come (one block open at a time), each change an event. The whole
    message is made of the same blocks (collect): it is the stream, folded."""

    def __init__(self, model: str, builder: ResponseBuilder, retained: int = 0) -> None:
        """retained: the prompt tokens its cache_control keeps."""
        self.id, self.model, self.builder = f"msg_{uuid.uuid4().hex}", model, builder
        self.retained = retained
        self.blocks: list[dict[str, Any]] = []
        self.open_kind = ""  # the open block's: thinking, text, or a call's index

    def message(self, choice: Choice | None) -> dict[str, Any]:
        reason, sequence = _stop_reason(choice) if choice else (None, None)
        content = [_finished(block) for block in self.blocks] if choice else []
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self.usage(),
        }

    def usage(self) -> dict[str, int]:
        """With cache_control, Anthropic's split of the prompt: read from the cache,
        written to it (the marked prefix past what was read), and the rest. Without,
        input_tokens is the whole prompt (Anthropic caches nothing unmarked; flagstop's
        own prefix hits are told in cache_read_input_tokens all the same)."""
        usage = self.builder.usage
        read = usage.cached_tokens
        created = max(0, min(self.retained, usage.prompt_tokens) - read)
        uncached = usage.prompt_tokens - read - created if self.retained else usage.prompt_tokens
        return {
            "input_tokens": uncached,
            "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": read,
            "cache_creation_input_tokens": created,
        }

    def opening(self) -> list[bytes]:
        return [event("message_start", message=self.message(None))]

    def piece(self, piece: dict[str, Any]) -> list[bytes]:
        delta, out = piece.get("delta", {}), []
        if text := delta.get("reasoning"):
            out += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                               {"type": "thinking_delta", "thinking": text})  # fmt: skip
        if text := delta.get("content"):
            out += self._block("text", {"type": "text", "text": ""},
                               {"type": "text_delta", "text": text})  # fmt: skip
        for call in delta.get("tool_calls", ()):
            arguments = call.get("function", {}).get("arguments", "")
            start = None
            if "id" in call:
                start = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                         "input": {}}  # fmt: skip
            out += self._block(
                f"call {call['index']}",
                start,
                {"type": "input_json_delta", "partial_json": arguments},
            )
        return out

    def _block(self, kind: str, start: dict | None, delta: dict[str, Any]) -> list[bytes]:
        out = []
        if kind != self.open_kind:
            out += self._close()
            self.open_kind = kind
            self.blocks.append(dict(start or {}))
            out.append(event("content_block_start", index=len(self.blocks) - 1,
                             content_block=start))  # fmt: skip
        if text := next(iter(v for k, v in delta.items() if k != "type")):
            block = self.blocks[-1]
            field = _DELTA_FIELDS[delta["type"]]
            block[field] = block.get(field, "") + text
            out.append(event("content_block_delta", index=len(self.blocks) - 1, delta=delta))
        return out

    def _close(self) -> list[bytes]:
        if not self.open_kind:
            return []
        self.open_kind = ""
        return [event("content_block_stop", index=len(self.blocks) - 1)]

    def closing(self, choice: Choice) -> list[bytes]:
        reason, sequence = _stop_reason(choice)
        usage = self.builder.usage
        return [*self._close(),
                event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                      usage={"output_tokens": usage.completion_tokens}),
                event("message_stop")]  # fmt: skip


def event(kind: str, **fields) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json_line({"type": kind, **fields}) + b"\n\n"


def _stop_reason(choice: Choice) -> tuple[str, str | None]:
    """Anthropic's stop_reason, and the stop sequence that ended the output."""
    reason = STOP_REASONS.get(choice.finish_reason or "", "end_turn")
    if reason == "end_turn" and isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return reason, None


# Which field of its block each delta adds to (a call's input: JSON text, until done).
_DELTA_FIELDS = {"thinking_delta": "thinking", "text_delta": "text", "input_json_delta": "_input"}


def _finished(block: dict[str, Any]) -> dict[str, Any]:
    """A block as the whole message shows it: a call's input parsed (the tool-call
    parsers give out a call's arguments as a JSON object, whole)."""
    block = dict(block)
    if (arguments := block.pop("_input", None)) is not None:
        block["input"] = json.loads(arguments or "{}")
    return block


async def collect(engine, choice: Choice, pending, events: MessageEvents) -> None:
    """The whole message's blocks, from the events a stream would send."""
    try:
        async for chunk in engine.stream(pending):
            events.piece(events.builder.apply(choice, chunk) or {})
    except RequestFailed as e:
        raise from_failure(e) from None
    finally:
        engine.release(pending)


async def stream(engine, choice: Choice, pending, events: MessageEvents,
                 chunks) -> AsyncIterator[bytes]:  # fmt: skip
    """The events; a failure after the first is an error event."""
    try:
        for item in events.opening():
            yield item
        async for chunk in chunks:
            for item in events.piece(events.builder.apply(choice, chunk) or {}):
                yield item
        for item in events.closing(choice):
            yield item
    except RequestFailed as e:
        yield event("error", error=anthropic_error(from_failure(e)))
    except Exception as e:  # one request's bug: its stream ends, the process goes on
        yield event("error", error=anthropic_error(internal_error(e, pending.request_id)))
    finally:
        engine.release(pending)
