"""One client stream's side of the router: the request as the router holds it
(Pending), the mailbox the fan-out fills, and the chunks built from it.

The fan-out (RouterEngine.fan_out) leaves a StepToken (or the scheduler's
RequestError) in the request's Mailbox for every token of a step; the client's stream
takes whatever is there on each wake-up and ChunkBuilder turns it into one
GenerateResponse: text, token ids, logprobs and, at the end, finish reason and usage."""

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import grpc

from flagstop.router.detokenizer import StopStringMatcher
from flagstop.router.telemetry import RequestTrace
from flagstop.scheduler_svc.core.request import FinishReason
from flagstop.v1 import generation_pb2, scheduler_pb2

if TYPE_CHECKING:
    from flagstop.router.replica import Replica

STATUS = {code.value[0]: code for code in grpc.StatusCode}
# What a client stream can end with; the scheduler's other reasons are failures.
CLIENT_FINISH = {FinishReason.STOP, FinishReason.LENGTH}


class RequestFailed(Exception):
    """A request that is refused or ends in failure; code says which (gRPC's codes are
    the vocabulary of both fronts), param the request field to change, if one."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


class StepToken(NamedTuple):
    """What one step brought one stream: a token (None when the request ended without
    one), the scheduler's finish reason (0 while it runs) and the token's logprob
    entry, if asked for. A tuple: the fan-out makes one per token per step."""

    token_id: int | None
    finish_reason: int
    logprob: generation_pb2.TokenLogprob | None


MailboxItem = StepToken | scheduler_pb2.RequestError


class Mailbox:
    """What the fan-out leaves for one client stream. The stream takes everything there
    at once: a stream that fell behind (a slow client, a busy router) gets the tokens
    of several steps in one message, never reordered or dropped, and the router writes
    fewer messages exactly when it is short of time (vLLM's stream interval, adaptive)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: list[MailboxItem] = []
        self.waiter: asyncio.Future | None = None

    def put(self, item: MailboxItem) -> None:
        self.items.append(item)
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[MailboxItem]:
        if not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        items, self.items = self.items, []
        return items


@dataclass(slots=True, eq=False)
class Pending:
    """One client stream's request, from submit() to release(): what the fan-out
    hands its stream."""

    request_id: str
    request: generation_pb2.GenerateRequest
    prompt_token_ids: list[int]
    trace: RequestTrace
    add: scheduler_pb2.AddRequest  # as first sent: kept to resubmit to a new scheduler
    replica: "Replica"  # where it is queued or served
    mailbox: Mailbox = field(default_factory=Mailbox)
    generated: list[int] = field(default_factory=list)
    sent: bool = False  # released to the scheduler
    finished: bool = False  # the scheduler holds nothing of it any more
    num_cached_tokens: int = 0  # prefix-cache hits, told when it finishes
    # With prompt_logprobs: prompt tokens 1.. as their chunks arrive.
    prompt_logprobs: list[generation_pb2.TokenLogprob | None] | None = None

    def add_prompt_logprobs(self, first_token: int, entries) -> None:
        """A prefill chunk's prompt logprobs. A recomputed prefill (preemption, a new
        scheduler) sends them again: they land where they were."""
        num_scored = len(self.prompt_token_ids) - 1
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * num_scored
        for i, entry in enumerate(entries, first_token - 1):
            if i >= num_scored:
                break
            self.prompt_logprobs[i] = entry

    def remainder(self) -> scheduler_pb2.AddRequest:
        """What is left to do, for a scheduler that never saw this request: prompt +
        the tokens already streamed, with the limits counted down by them."""
        add, done = scheduler_pb2.AddRequest(), len(self.generated)
        add.CopyFrom(self.add)
        add.prompt_token_ids.extend(self.generated)
        add.min_tokens = max(0, add.min_tokens - done)
        if add.HasField("max_tokens"):
            add.max_tokens -= done
        if add.sampling.HasField("structured_outputs"):  # the grammar replays them
            add.sampling.structured_outputs.num_prompt_tokens_constrained += done
        return add

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """End the stream with an error the client can act on (once)."""
        if not self.finished:
            self.finished = True
            self.mailbox.put(
                scheduler_pb2.RequestError(
                    request_id=self.request_id, code=code.value[0], message=message
                )
            )


class ChunkBuilder:
    """Turns a stream's tokens into GenerateResponse chunks: text (detokenized, held
    back at a possible stop string), logprobs, and at the end the finish reason and
    usage."""

    __slots__ = ("detokenizer", "done", "num_generated", "pending", "stops")

    def __init__(self, pending: Pending, detokenizer, stops: StopStringMatcher) -> None:
        self.pending, self.detokenizer, self.stops = pending, detokenizer, stops
        self.num_generated, self.done = 0, False

    def build(self, items: list[MailboxItem]):
        """(chunk or None, RequestFailed or None) for what the mailbox held."""
        failure, end = None, len(items)
        for i, item in enumerate(items):
            failure = self._failure(item)
            if failure is not None:
                end = i
                break
        chunk = generation_pb2.GenerateResponse()
        if self.stops.stop:
            self._add_one_by_one(chunk, items[:end])
        else:
            self._add_all(chunk, items[:end])
        if self.done:  # ended by a stop string before the failure: it happened after
            failure = None
        if not (chunk.token_ids or chunk.text or chunk.finish_reason):
            return None, failure
        return chunk, failure

    @staticmethod
    def _failure(item: MailboxItem) -> RequestFailed | None:
        if isinstance(item, scheduler_pb2.RequestError):
            return RequestFailed(STATUS.get(item.code, grpc.StatusCode.UNKNOWN), item.message)
        reason = item.finish_reason
        if reason and reason not in CLIENT_FINISH:
            return RequestFailed(grpc.StatusCode.INTERNAL, "the request failed in the engine")
        return None

    def _add_all(self, chunk, items: list[StepToken]) -> None:
        """No stop strings: the tokens of several steps in one go (one detokenizer call,
        the costly part per token otherwise)."""
        token_ids = [item.token_id for item in items if item.token_id is not None]
        reason = items[-1].finish_reason if items else 0
        if token_ids:
            if not self.num_generated:
                self._first_token(chunk)
            self.num_generated += len(token_ids)
            chunk.token_ids.extend(token_ids)
            chunk.logprobs.extend(item.logprob for item in items if item.logprob is not None)
        chunk.text = self.detokenizer.add(token_ids, final=bool(reason))
        if reason:
            last = items[-1].token_id
            self._finish(chunk, reason, last if token_ids and last is not None else None)

    def _add_one_by_one(self, chunk, items: list[StepToken]) -> None:
        texts: list[str] = []
        for item in items:
            if self._add(chunk, texts, item):
                break
        chunk.text = "".join(texts)

    def _add(self, chunk, texts: list[str], item: StepToken) -> bool:
        """Add one token (or a bare finish); whether the stream ended."""
        token_id, reason, logprob = item
        text = ""
        if token_id is not None:
            if not self.num_generated:
                self._first_token(chunk)
            self.num_generated += 1
            chunk.token_ids.append(token_id)
            text = self.detokenizer.add([token_id], final=bool(reason))
            if logprob is not None:
                chunk.logprobs.append(logprob)
        emitted, matched = self.stops.feed(text, final=bool(reason))
        texts.append(emitted)
        if matched is not None:
            chunk.stop_reason = matched
            self._finish(chunk, generation_pb2.FINISH_REASON_STOP, None)
        elif reason:
            self._finish(chunk, reason, token_id)
        return self.done

    def _first_token(self, chunk) -> None:
        """The first chunk with a token: by then its prefill's prompt logprobs are in
        (they come with the step that sampled it, or before)."""
        self.pending.trace.first_token()
        if (prompt_logprobs := self.pending.prompt_logprobs) is not None:
            empty = generation_pb2.TokenLogprob()
            chunk.prompt_logprobs.extend(lp or empty for lp in prompt_logprobs)

    def _finish(self, chunk, reason: int, last_token: int | None) -> None:
        chunk.finish_reason = reason  # the same values (FinishReason)
        if last_token is not None and last_token in self.pending.request.stop_token_ids:
            chunk.stop_reason = str(last_token)
        chunk.usage.prompt_tokens = len(self.pending.prompt_token_ids)
        chunk.usage.completion_tokens = self.num_generated
        chunk.usage.cached_tokens = self.pending.num_cached_tokens
        self.pending.trace.finish(chunk.finish_reason, self.num_generated)
        self.done = True
