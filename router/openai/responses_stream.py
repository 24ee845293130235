"""The Responses API's output, from the chat builder's pieces of one choice (content,
tool calls): its output items and, streamed, its events in their order:

    response.created, response.in_progress,
    per item: response.output_item.added,
      reasoning: response.reasoning_text.delta.., response.reasoning_text.done
      message:  response.content_part.added, response.output_text.delta..,
                response.output_text.done, response.content_part.done
      function: response.function_call_arguments.delta..,
                response.function_call_arguments.done
    response.output_item.done (before the next item is added); then response.completed
    (or response.incomplete)."""

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from flagstop.router.openai.bodies import Choice, ResponseBuilder
from flagstop.router.openai.errors import OpenAIError, from_failure, internal_error, stream_error
from flagstop.router.openai.responses_request import NamedFunctionChoice, ResponsesRequest
from flagstop.router.openai.sse import json_line
from flagstop.router.pending import RequestFailed

Event = tuple[str, dict[str, Any]]  # (type, payload)


class ResponseEvents:
    """The Responses output of one choice: items opened and closed as the chat
    builder's pieces add content and tool calls, each change an event."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id, self.created_at = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.body, self.model = body, model
        self.items: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the open message item
        self.reasoning: dict[str, Any] | None = None  # the reasoning item
        self.calls: dict[int, dict[str, Any]] = {}  # tool call index -> its item
        self.sequence = 0

    def event(self, kind: str, **fields) -> Event:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return kind, payload

    def opening(self) -> list[Event]:
        response = self.response("in_progress", None)
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]  # fmt: skip

    def piece(self, piece: dict[str, Any]) -> list[Event]:
        delta, out = piece.get("delta", {}), []
        if reasoning := delta.get("reasoning"):
            out += self._reasoning(reasoning)
        logprobs = (piece.get("logprobs") or {}).get("content") or []
        if (content := delta.get("content")) or logprobs:
            out += self._text(content or "", logprobs)
        for call in delta.get("tool_calls", ()):
            out += self._call(call)
        return out

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[Event]:
        out = []
        if self.message is None or self.message["status"] == "completed":
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                    "role": "assistant", "content": []}  # fmt: skip
            self.message = self._open(item, out)
            out.append(self.event("response.content_part.added", **self._where(item),
                                  content_index=0, part=_part("")))  # fmt: skip
            item["_text"], item["_logprobs"] = "", []
        item = self.message
        item["_text"] += text
        item["_logprobs"] += logprobs
        out.append(self.event("response.output_text.delta", **self._where(item), content_index=0,
                              delta=text, logprobs=logprobs))  # fmt: skip
        return out

    def _reasoning(self, text: str) -> list[Event]:
        out = []
        if self.reasoning is None or self.reasoning["status"] == "completed":
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                    "content": [], "status": "in_progress", "_text": ""}  # fmt: skip
            self.reasoning = self._open(item, out)
        item = self.reasoning
        item["_text"] += text
        out.append(self.event("response.reasoning_text.delta", **self._where(item),
                              content_index=0, delta=text))  # fmt: skip
        return out

    def _call(self, call: dict[str, Any]) -> list[Event]:
        out, arguments = [], call.get("function", {}).get("arguments", "")
        if "id" in call:  # a new call
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                    "call_id": call["id"], "name": call["function"]["name"], "arguments": "",
                    "status": "in_progress"}  # fmt: skip
            self.calls[call["index"]] = self._open(item, out)
        item = self.calls[call["index"]]
        if arguments:
            item["arguments"] += arguments
            out.append(self.event("response.function_call_arguments.delta", **self._where(item),
                                  delta=arguments))  # fmt: skip
        return out

    def _open(self, item: dict[str, Any], out: list[Event]) -> dict[str, Any]:
        out += self._close()
        item["_index"] = len(self.items)
        self.items.append(item)
        out.append(self.event("response.output_item.added", output_index=item["_index"],
                              item=_public(item)))  # fmt: skip
        return item

    @staticmethod
    def _where(item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": item["_index"]}

    def _close(self) -> list[Event]:
        """The open item's done events (an item is done when the next one opens)."""
        if not self.items or self.items[-1]["status"] == "completed":
            return []
        item, out = self.items[-1], []
        item["status"] = "completed"
        if item["type"] == "reasoning":
            text = item["_text"]
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self.event("response.reasoning_text.done", **self._where(item),
                                  content_index=0, text=text))  # fmt: skip
        elif item["type"] == "message":
            text, logprobs = item["_text"], item["_logprobs"]
            item["content"] = [_part(text, logprobs)]
            out.append(self.event("response.output_text.done", **self._where(item),
                                  content_index=0, text=text, logprobs=logprobs))  # fmt: skip
            out.append(self.event("response.content_part.done", **self._where(item),
                                  content_index=0, part=_part(text, logprobs)))  # fmt: skip
        else:
            out.append(self.event("response.function_call_arguments.done", **self._where(item),
                                  arguments=item["arguments"]))  # fmt: skip
        out.append(self.event("response.output_item.done", output_index=item["_index"],
                              item=_public(item)))  # fmt: skip
        return out

    def closing(self, choice: Choice, builder: ResponseBuilder) -> list[Event]:
        out = self._close()
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        response = self.response(status, builder)
        out.append(self.event(f"response.{status}", response=response))
        return out

    def response(self, status: str, builder: ResponseBuilder | None) -> dict[str, Any]:
        body = self.body
        usage = None
        if builder is not None:
            u = builder.usage
            usage = {"input_tokens": u.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": u.cached_tokens},
                     "output_tokens": u.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                     "total_tokens": u.prompt_tokens + u.completion_tokens}  # fmt: skip
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "output": [_public(i) for i in self.items]
            if builder is not None else [],
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None,
            "store": False, "temperature": body.temperature, "top_p": body.top_p,
            "top_logprobs": body.top_logprobs or 0,
            "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                if body.text and body.text.format else {"type": "text"})},
            "tool_choice": _tool_choice(body), "tools": [t.model_dump(exclude_none=True)
                                                         for t in body.tools or ()],
            "truncation": "disabled", "usage": usage,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": None},
        }  # fmt: skip


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if isinstance(choice, NamedFunctionChoice):
        return choice.model_dump()
    return choice or "auto"


def _part(text: str, logprobs: list | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _public(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if not k.startswith("_")}


async def _events(builder: ResponseBuilder, choice: Choice, events: "ResponseEvents", chunks):
    """(event type, payload) of one request's chunks, in order. Raises RequestFailed."""
    for event in events.opening():
        yield event
    async for chunk in chunks:
        for event in events.piece(builder.apply(choice, chunk) or {}):
            yield event
    for event in events.closing(choice, builder):
        yield event


async def stream(engine, builder, choice, pending, events, chunks) -> AsyncIterator[bytes]:
    """Server-Sent Events, `event:` lines included; a failure is an error event."""
    try:
        async for kind, payload in _events(builder, choice, events, chunks):
            yield b"event: " + kind.encode() + b"\ndata: " + json_line(payload) + b"\n\n"
    except RequestFailed as e:
        yield _error_event(events, from_failure(e))
    except Exception as e:  # one request's bug: its stream ends, the process goes on
        yield _error_event(events, internal_error(e, pending.request_id))
    finally:
        engine.release(pending)


def _error_event(events: "ResponseEvents", failure: OpenAIError) -> bytes:
    _, payload = events.event("error", **stream_error(failure)["error"])
    return b"event: error\ndata: " + json_line(payload) + b"\n\n"


async def collect(engine, builder, choice, pending, events) -> dict[str, Any]:
    """The whole Responses object: the last event's."""
    last: dict[str, Any] = {}
    try:
        async for _, payload in _events(builder, choice, events, engine.stream(pending)):
            last = payload
    except RequestFailed as e:
        raise from_failure(e) from None
    finally:
        engine.release(pending)
    return last["response"]
