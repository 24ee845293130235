"""The OpenAI API's response objects and stream chunks, built from the router's
GenerateResponse chunks of each choice."""

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flagstop.scheduler_svc.core.request import FinishReason
from flagstop.v1 import generation_pb2


class TokenTexts:
    """Each token id's text, as the logprobs report it (decoded alone), cached."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


@dataclass(slots=True)
class Choice:
    """What one choice has streamed so far."""

    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: Any = None  # the API's shape, grown chunk by chunk


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }  # fmt: skip


@dataclass(slots=True)
class ResponseBuilder:
    """One response: `completion` (text_completion) or `chat` (chat.completion)."""

    kind: str
    model: str
    texts: Callable[[int], str]  # a token id's text in logprobs
    with_logprobs: bool
    id: str = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))
    usage: Usage = field(default_factory=Usage)

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def apply(self, choice: Choice, chunk: generation_pb2.GenerateResponse) -> dict[str, Any]:
        """Fold a chunk into its choice; returns the chunk's own part of the choice (for
        a stream): text or delta, logprobs, finish reason."""
        piece: dict[str, Any] = {"index": choice.index}
        start = len(choice.text)
        choice.text += chunk.text
        choice.num_tokens += len(chunk.token_ids)
        self.usage.completion_tokens += len(chunk.token_ids)
        if self.kind == "chat":
            piece["delta"] = {"content": chunk.text} if chunk.text else {}
        else:
            piece["text"] = chunk.text
        logprobs = self._logprobs(chunk, start) if self.with_logprobs else None
        if logprobs is not None:
            choice.logprobs = _extend(choice.logprobs, logprobs)
        piece["logprobs"] = logprobs
        if chunk.finish_reason:
            choice.finish_reason = FinishReason(chunk.finish_reason).label
            choice.stop_reason = chunk.stop_reason or None
        piece["finish_reason"] = choice.finish_reason
        if chunk.finish_reason:
            piece["stop_reason"] = choice.stop_reason
        return piece

    def _logprobs(self, chunk: generation_pb2.GenerateResponse, start: int) -> dict | None:
        if not chunk.logprobs:
            return None
        text = self.texts
        if self.kind == "chat":
            return {"content": [
                {**_token(text(lp.token_id), lp.logprob),
                 "top_logprobs": [_token(text(t.token_id), t.logprob) for t in lp.top]}
                for lp in chunk.logprobs
            ]}  # fmt: skip
        return {
            "tokens": [text(lp.token_id) for lp in chunk.logprobs],
            "token_logprobs": [lp.logprob for lp in chunk.logprobs],
            "top_logprobs": [
                {text(t.token_id): t.logprob for t in lp.top} for lp in chunk.logprobs
            ],
            "text_offset": [start] * len(chunk.logprobs),
        }

    # -- streams -------------------------------------------------------------

    def chunk(self, pieces: list[dict[str, Any]]) -> dict[str, Any]:
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(name), "choices": pieces}

    def role_chunk(self, indexes: range) -> dict[str, Any]:
        """A chat stream opens each choice with the assistant's role."""
        pieces = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None} for i in indexes]  # fmt: skip
        return self.chunk(pieces)

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.chunk([]), "usage": self.usage.as_dict()}

    # -- whole responses -----------------------------------------------------

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        if self.kind == "chat":
            body = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                     "stop_reason": c.stop_reason} for c in choices]  # fmt: skip
            head = self._head("chat.completion")
        else:
            body = [{"index": c.index, "text": c.text, "logprobs": c.logprobs,
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    for c in choices]  # fmt: skip
            head = self._head("text_completion")
        return {**head, "choices": body, "usage": self.usage.as_dict()}


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _extend(total: dict | None, more: dict) -> dict:
    if total is None:
        return {key: list(value) for key, value in more.items()}
    for key, value in more.items():
        total[key].extend(value)
    return total
