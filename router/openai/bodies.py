"""The OpenAI API's response objects and stream chunks (completions and chat), built
from the router's GenerateResponse chunks of each choice: text or content and tool
calls, logprobs, echo, vLLM's prompt_logprobs, usage with cached tokens."""

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flagstop.router.openai.outputs import ChatOutput
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
    """What one choice has streamed so far, and how its chunks are read."""

    index: int
    prompt_token_ids: list[int] = field(default_factory=list)
    counts_prompt: bool = True  # the first choice of its prompt: usage counts it
    echo: str | None = None  # completions' echo: the prompt text, until sent
    prompt_only: bool = False  # echo with max_tokens 0: the generated token is dropped
    output: ChatOutput | None = None  # chat: reasoning, content and tool calls
    text: str = ""  # completions: the text; chat: the content
    reasoning: str = ""  # chat: the reasoning, when a parser split it off
    num_tokens: int = 0
    num_reasoning_tokens: int = 0  # of the chunks that carried reasoning
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: Any = None  # the API's shape, grown chunk by chunk
    prompt_logprobs: list | None = None  # vLLM's shape: None, then {id: entry} per token


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of the completion tokens, those of the reasoning

    def as_dict(self) -> dict[str, Any]:
        usage = {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }  # fmt: skip
        if self.reasoning_tokens:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage


@dataclass(slots=True)
class ResponseBuilder:
    """One response: `completion` (text_completion) or `chat` (chat.completion)."""

    kind: str
    model: str
    texts: Callable[[int], str]  # a token id's text in logprobs
    with_logprobs: bool
    continuous_usage: bool = False  # usage so far on every stream chunk
    id: str = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))
    usage: Usage = field(default_factory=Usage)

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def apply(
        self, choice: Choice, chunk: generation_pb2.GenerateResponse
    ) -> dict[str, Any] | None:
        """Fold a chunk into its choice; returns the chunk's own part of the choice for
        a stream (text or delta, logprobs, finish reason), None when it adds nothing."""
        final = bool(chunk.finish_reason)
        if chunk.prompt_logprobs:
            choice.prompt_logprobs = self._prompt_logprobs(choice, chunk.prompt_logprobs)
        token_ids, text, logprob_entries = chunk.token_ids, chunk.text, chunk.logprobs
        if choice.prompt_only:
            token_ids, text, logprob_entries = (), "", ()
        choice.num_tokens += len(token_ids)
        self.usage.completion_tokens += len(token_ids)
        logprobs = None
        if self.with_logprobs:
            logprobs = self._logprobs(logprob_entries, len(choice.text) + len(choice.echo or ""))
        if choice.echo is not None:
            text, logprobs = choice.echo + text, self._echoed(choice, chunk, logprobs)
            choice.echo = None
        piece: dict[str, Any] = {"index": choice.index}
        if self.kind == "chat":
            finish = FinishReason(chunk.finish_reason).label if final else None
            piece["delta"] = self._delta(choice, token_ids, text, finish)
        else:
            piece["text"] = text
            choice.text += text
        if logprobs is not None:
            choice.logprobs = _extend(choice.logprobs, logprobs)
        piece["logprobs"] = logprobs
        if final:
            self._finish(choice, chunk)
            piece["stop_reason"] = choice.stop_reason
        piece["finish_reason"] = choice.finish_reason
        if not (final or logprobs or piece.get("text") or piece.get("delta")):
            return None
        return piece

    def _delta(self, choice: Choice, token_ids, text: str, finish: str | None) -> dict[str, Any]:
        """A chat chunk's delta: its reasoning (under vLLM's `reasoning`, and the older
        `reasoning_content` that DeepSeek's API named and LiteLLM and chat UIs read),
        content and tool-call deltas."""
        output = choice.output
        reasoning, content, calls = output.feed(token_ids, text, finish)
        delta: dict[str, Any] = {"content": content} if content else {}
        if content:
            choice.text += content
        if reasoning or output.in_reasoning:
            choice.num_reasoning_tokens += len(token_ids)
            self.usage.reasoning_tokens += len(token_ids)
            if reasoning:
                delta["reasoning"] = delta["reasoning_content"] = reasoning
                choice.reasoning += reasoning
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _finish(self, choice: Choice, chunk: generation_pb2.GenerateResponse) -> None:
        reason = FinishReason(chunk.finish_reason).label
        if choice.output is not None and choice.output.calls and reason == "stop":
            reason = "tool_calls"
        stop_reason = chunk.stop_reason or None
        if choice.prompt_only:
            # max_tokens 0 is reached before any output: the one token the engine ran
            # for (EOS or a stop string, as it may be) is dropped, and with it its reason.
            reason, stop_reason = "length", None
        choice.finish_reason = reason
        choice.stop_reason = stop_reason
        if choice.counts_prompt:
            self.usage.cached_tokens += chunk.usage.cached_tokens

    def _logprobs(self, entries, start: int) -> dict | None:
        if not entries:
            return None
        text = self.texts
        if self.kind == "chat":
            return {"content": [
                {**_token(text(lp.token_id), lp.logprob),
                 "top_logprobs": [_token(text(t.token_id), t.logprob) for t in lp.top]}
                for lp in entries
            ]}  # fmt: skip
        tokens = [text(lp.token_id) for lp in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in entries],
            "top_logprobs": [{text(t.token_id): t.logprob for t in lp.top} for lp in entries],
            "text_offset": _offsets(tokens, start),
        }

    def _echoed(self, choice: Choice, chunk, logprobs: dict | None) -> dict | None:
        """Completions' echo with logprobs: the prompt's tokens lead, the first one
        with none (nothing precedes it)."""
        if not self.with_logprobs:
            return logprobs
        text, ids = self.texts, choice.prompt_token_ids
        tokens = [text(t) for t in ids]
        scored = list(chunk.prompt_logprobs)
        prompt = {
            "tokens": tokens,
            "token_logprobs": [None] + [lp.logprob for lp in scored],
            "top_logprobs": [
                None,
                *({text(t.token_id): t.logprob for t in lp.top} for lp in scored),
            ],
            "text_offset": _offsets(tokens, 0),
        }
        return prompt if logprobs is None else _extend(prompt, logprobs)

    def _prompt_logprobs(self, choice: Choice, entries) -> list:
        """vLLM's prompt_logprobs: None for the first token, then per prompt token
        {token id: {logprob, rank, decoded_token}} of it and the top n (rank: the
        place among the top n; None for the prompt token outside them)."""
        text, out = self.texts, [None]
        for token_id, lp in zip(choice.prompt_token_ids[1:], entries, strict=False):
            position = {
                t.token_id: {"logprob": t.logprob, "rank": rank, "decoded_token": text(t.token_id)}
                for rank, t in enumerate(lp.top, 1)
            }
            position.setdefault(token_id, {"logprob": lp.logprob, "rank": None,
                                           "decoded_token": text(token_id)})  # fmt: skip
            out.append({str(k): v for k, v in position.items()})
        return out

    # -- streams -------------------------------------------------------------

    def chunk(self, pieces: list[dict[str, Any]]) -> dict[str, Any]:
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = {**self._head(name), "choices": pieces}
        if self.continuous_usage:
            body["usage"] = self.usage.as_dict()
        return body

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
            body = [{"index": c.index, "message": _message(c), "logprobs": c.logprobs,
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    for c in choices]  # fmt: skip
            head = self._head("chat.completion")
            if choices and choices[0].prompt_logprobs is not None:
                head["prompt_logprobs"] = choices[0].prompt_logprobs
        else:
            body = [{"index": c.index, "text": c.text, "logprobs": c.logprobs,
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                     "prompt_logprobs": c.prompt_logprobs} for c in choices]  # fmt: skip
            head = self._head("text_completion")
        return {**head, "choices": body, "usage": self.usage.as_dict()}


def _message(choice: Choice) -> dict[str, Any]:
    calls = choice.output.calls if choice.output is not None else []
    message: dict[str, Any] = {"role": "assistant", "content": choice.text or None}
    if choice.reasoning:
        message["reasoning"] = message["reasoning_content"] = choice.reasoning
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _offsets(tokens: list[str], start: int) -> list[int]:
    offsets = []
    for token in tokens:
        offsets.append(start)
        start += len(token)
    return offsets


def _extend(total: dict | None, more: dict) -> dict:
    if total is None:
        return {key: list(value) for key, value in more.items()}
    for key, value in more.items():
        total[key].extend(value)
    return total
