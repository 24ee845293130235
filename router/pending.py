"""One client stream's side of the router: the request as the router holds it
(Pending), which the fan-out fills, and the chunks built from it.

The fan-out (RouterEngine.fan_out) appends every token of a step to its request's
Pending (and, at the end, the finish reason or the scheduler's RequestError); the
client's stream takes whatever is new on each wake-up and ChunkBuilder turns it into
one GenerateResponse: text, token ids, logprobs and, at the end, finish reason and
usage."""

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """A refusal for load (a full queue, a policy's shed) tells the client when to
        retry: gRPC's retry pushback (HTTP: Retry-After)."""
        if self.code in RETRYABLE:
            return (("grpc-retry-pushback-ms", str(RETRY_AFTER_S * 1000)),)
        return ()


# Refused for load, not for the request: worth retrying, after RETRY_AFTER_S.
RETRYABLE = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})
RETRY_AFTER_S = 1


@dataclass(slots=True, eq=False)
class Pending:
    """One client stream's request, from submit() to release(): what the fan-out
    leaves for its stream. The fan-out appends each step's tokens to generated, sets
    finish_reason or error at the end and wakes the stream if it waits; the stream
    takes everything past what it sent at once. So a stream that fell behind (a slow
    client, a busy router) gets the tokens of several steps in one message, never
    reordered or dropped, and the router writes fewer messages exactly when it is
    short of time (vLLM's stream interval, adaptive). State, not a queue of items:
    the common step costs one append and, for a waiting stream, one wake-up."""

    request_id: str
    request: generation_pb2.GenerateRequest
    prompt_token_ids: list[int]
    trace: RequestTrace
    add: scheduler_pb2.AddRequest  # as first sent: kept to resubmit to a new scheduler
    replica: "Replica | None" = None  # where it is queued or served (its prefill, if split)
    # Split (prefill/decode disaggregation): where its decode goes after the prefill.
    decode_replica: "Replica | None" = None
    generated: list[int] = field(default_factory=list)  # every token, in order
    # With logprobs: generated's entries, index for index.
    logprobs: list[generation_pb2.TokenLogprob] | None = None
    finish_reason: int = 0  # the scheduler's, once it ended the request
    error: scheduler_pb2.RequestError | None = None  # a failure, after the tokens
    waiter: asyncio.Future | None = None  # the stream's, while it waits
    sent: bool = False  # released to the scheduler
    finished: bool = False  # the scheduler holds nothing of it any more
    num_cached_tokens: int = 0  # prefix-cache hits, told when it finishes
    # Its retention's ttl, where --max-cache-ttl-s cut it (the APIs' header says so).
    retention_clamped_s: float | None = None
    pooled: bytes = b""  # a pooling request's output (float32), told as it ends
    # With prompt_logprobs: prompt tokens 1.. as their chunks arrive.
    prompt_logprobs: list[generation_pb2.TokenLogprob | None] | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def end(self, finish_reason: int) -> None:
        """The scheduler ended it (after its last tokens, if any)."""
        self.finished, self.finish_reason = True, finish_reason
        self.wake()

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
        self.failed(
            scheduler_pb2.RequestError(request_id=self.request_id, code=code.value[0],
                                       message=message)
        )  # fmt: skip

    def failed(self, error: scheduler_pb2.RequestError) -> None:
        """The scheduler's (or the router's) failure ends the stream, once."""
        if not self.finished:
            self.finished, self.error = True, error
            self.wake()


class ChunkBuilder:
    """Turns what the fan-out left a stream into GenerateResponse chunks: text
    (detokenized, held back at a possible stop string), logprobs, and at the end the
    finish reason and usage."""

    __slots__ = ("detokenizer", "done", "num_sent", "pending", "stops")

    def __init__(self, pending: Pending, detokenizer, stops: StopStringMatcher) -> None:
        self.pending, self.detokenizer, self.stops = pending, detokenizer, stops
        self.num_sent, self.done = 0, False

    @property
    def has_news(self) -> bool:
        pending = self.pending
        return (len(pending.generated) > self.num_sent or pending.finished) and not self.done

    def build(self) -> tuple[generation_pb2.GenerateResponse | None, RequestFailed | None]:
        """(chunk or None, RequestFailed or None) for what arrived since the last."""
        pending = self.pending
        start, end = self.num_sent, len(pending.generated)
        self.num_sent = end
        if start and end > start:
            pending.trace.next_tokens()
        if not (pending.finished or self.stops.stop):  # the common chunk: tokens only
            return self._all(start, end, 0), None
        reason, failure = pending.finish_reason, self._failure(pending)
        if failure is not None:
            reason = 0  # the tokens before it go out; the stream ends in the failure
        if self.stops.stop:
            chunk = self._one_by_one(start, end, reason)
        else:
            chunk = self._all(start, end, reason)
        if failure is not None and not self.done:
            self.done = True
            return chunk, failure
        return chunk, None

    @staticmethod
    def _failure(pending: Pending) -> RequestFailed | None:
        if (error := pending.error) is not None:
            return RequestFailed(STATUS.get(error.code, grpc.StatusCode.UNKNOWN), error.message)
        reason = pending.finish_reason
        if reason and reason not in CLIENT_FINISH:
            return RequestFailed(grpc.StatusCode.INTERNAL, "the request failed in the engine")
        return None

    def _all(self, start: int, end: int, reason: int) -> generation_pb2.GenerateResponse | None:
        """No stop strings: the tokens of several steps in one go (one detokenizer call,
        the costly part per token otherwise)."""
        if start == end and not reason:
            return None
        token_ids = self.pending.generated[start:end]
        chunk = generation_pb2.GenerateResponse(
            token_ids=token_ids, text=self.detokenizer.add(token_ids, final=bool(reason))
        )
        if token_ids and (not start or self.pending.logprobs is not None):
            self._extras(chunk, start, end)
        if reason:
            self._finish(chunk, reason, end)
        return chunk

    def _extras(self, chunk, start: int, end: int) -> None:
        """What a chunk of tokens may carry beside them: the first token's facts, the
        tokens' logprobs."""
        if not start:
            self._first_token(chunk)
        if (logprobs := self.pending.logprobs) is not None:
            chunk.logprobs.extend(logprobs[start:end])

    def _one_by_one(self, start: int, end: int, reason: int):
        """With stop strings: token by token, the matcher cutting the text at a match."""
        pending, chunk, texts = self.pending, generation_pb2.GenerateResponse(), []
        logprobs = pending.logprobs
        for i in range(start, end):
            if not i:
                self._first_token(chunk)
            token_id, final = pending.generated[i], bool(reason) and i == end - 1
            chunk.token_ids.append(token_id)
            if logprobs is not None and i < len(logprobs):
                chunk.logprobs.append(logprobs[i])
            if self._feed(chunk, texts, self.detokenizer.add([token_id], final=final), final):
                self._finish(chunk, generation_pb2.FINISH_REASON_STOP, i + 1)
                break
        else:
            # A finish after the last token: what the detokenizer and the matcher held.
            if (
                reason
                and start == end
                and self._feed(chunk, texts, self.detokenizer.add([], final=True), True)
            ):
                reason = generation_pb2.FINISH_REASON_STOP
            if reason:
                self._finish(chunk, reason, end)
        chunk.text = "".join(texts)
        if not (chunk.token_ids or chunk.text or chunk.finish_reason):
            return None
        return chunk

    def _feed(self, chunk, texts: list[str], text: str, final: bool) -> bool:
        """The matcher's share of text; whether a stop string matched."""
        emitted, matched = self.stops.feed(text, final=final)
        texts.append(emitted)
        if matched is not None:
            chunk.stop_reason = matched
            return True
        return False

    def _first_token(self, chunk) -> None:
        """The first chunk with a token: by then its prefill's prompt logprobs are in
        (they come with the step that sampled it, or before)."""
        self.pending.trace.first_token()
        if (prompt_logprobs := self.pending.prompt_logprobs) is not None:
            empty = generation_pb2.TokenLogprob()
            chunk.prompt_logprobs.extend(lp or empty for lp in prompt_logprobs)

    def _finish(self, chunk, reason: int, num_generated: int) -> None:
        """The last chunk. A stop at a stop token names it (a stop string has)."""
        chunk.finish_reason = reason  # the same values (FinishReason)
        pending = self.pending
        stop = reason == generation_pb2.FINISH_REASON_STOP and num_generated
        if stop and not chunk.stop_reason:
            last = pending.generated[num_generated - 1]
            if last in pending.request.stop_token_ids:
                chunk.stop_reason = str(last)
        chunk.usage.prompt_tokens = len(pending.prompt_token_ids)
        chunk.usage.completion_tokens = num_generated
        chunk.usage.cached_tokens = pending.num_cached_tokens
        pending.trace.finish(chunk.finish_reason, num_generated)
        self.done = True
