"""The one request path behind both fronts (gRPC and OpenAI HTTP): validation, the
admission queue, the stream to the scheduler, the fan-out of each step's tokens,
detokenizing, stop strings and the request's telemetry.

Requests wait in a bounded admission queue here and are released to the scheduler
against the credits it grants, in batches; each engine step comes back as one
message whose tokens are fanned out to the client streams. A client stream is
`generate()`: GenerateResponse chunks in, whichever front turns them into its own
shape; a request that cannot be served raises RequestFailed with a gRPC status code,
which the HTTP front maps to its own."""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from flagstop.health import Health
from flagstop.reconnect import Reconnect
from flagstop.router.admission import AdmissionQueue
from flagstop.router.detokenizer import StopStringMatcher, new_detokenizer
from flagstop.router.settings import RouterSettings
from flagstop.router.telemetry import RequestTrace
from flagstop.router.validation import ModelLimits, prompt_ids, validate
from flagstop.scheduler_svc.core.limits import RequestRejected
from flagstop.scheduler_svc.core.request import FinishReason
from flagstop.server import TLSConfig, channel
from flagstop.telemetry import Telemetry
from flagstop.v1 import generation_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("flagstop.router")
STATUS = {code.value[0]: code for code in grpc.StatusCode}
# What a client stream can end with; the scheduler's other reasons are failures.
CLIENT_FINISH = {FinishReason.STOP, FinishReason.LENGTH}


class RequestFailed(Exception):
    """A request that is refused or ends in failure; code says which (gRPC's codes are
    the vocabulary of both fronts), param the request field to change, if one."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


class Mailbox:
    """What the fan-out leaves for one client stream. The stream takes everything there
    at once: a stream that fell behind (a slow client, a busy router) gets the tokens
    of several steps in one message, never reordered or dropped, and the router writes
    fewer messages exactly when it is short of time (vLLM's stream interval, adaptive)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: list = []
        self.waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self.items.append(item)
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list:
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
    # What the fan-out delivers to the client stream: (token id or None, scheduler
    # finish reason, logprob entry or None), or a RequestError.
    mailbox: Mailbox = field(default_factory=Mailbox)
    generated: list[int] = field(default_factory=list)
    sent: bool = False  # released to the scheduler
    finished: bool = False  # the scheduler holds nothing of it any more

    def remainder(self) -> scheduler_pb2.AddRequest:
        """What is left to do, for a scheduler that never saw this request: prompt +
        the tokens already streamed, with the limits counted down by them."""
        add, done = scheduler_pb2.AddRequest(), len(self.generated)
        add.CopyFrom(self.add)
        add.prompt_token_ids.extend(self.generated)
        add.min_tokens = max(0, add.min_tokens - done)
        if add.HasField("max_tokens"):
            add.max_tokens -= done
        return add


class RouterEngine:
    def __init__(
        self, tokenizer, settings: RouterSettings, health: Health, telemetry: Telemetry
    ) -> None:
        self.tokenizer = tokenizer
        self.tracer = telemetry.tracer
        self.settings = settings
        self.tls = TLSConfig.from_settings(settings)
        self.health = health
        self.model_info = generation_pb2.GetModelInfoResponse()
        self.limits: ModelLimits | None = None
        self.requests: dict[str, Pending] = {}
        self.admission = AdmissionQueue(settings.max_queued_requests, settings.max_queued_tokens)
        self.aborts: list[str] = []
        self.credits = 0
        self.flush = asyncio.Event()
        self.connected = False
        self.reconnect = Reconnect(give_up_after_s=settings.scheduler_timeout)
        self.accepting = True

    # -- the scheduler stream ------------------------------------------------

    async def run(self) -> None:
        stub = scheduler_pb2_grpc.SchedulerStub(channel(self.settings.scheduler, self.tls))
        while True:
            try:
                await self._connect(stub)
            except grpc.aio.AioRpcError as e:
                log.warning("scheduler %s: %s", self.settings.scheduler, e.code())
            self._lost_scheduler()
            if self.reconnect.gave_up:
                self._fail_all(f"no scheduler for {self.settings.scheduler_timeout:g}s")
            await self.reconnect.wait()

    async def _connect(self, stub) -> None:
        info = await stub.Describe(scheduler_pb2.DescribeSchedulerRequest(), timeout=5)
        self.model_info = generation_pb2.GetModelInfoResponse(
            model_name=info.model_name, vocab_size=info.vocab_size,
            max_model_len=info.max_model_len, eos_token_ids=info.eos_token_ids,
            block_size=info.block_size, num_blocks=info.num_blocks,
        )  # fmt: skip
        self.limits = ModelLimits(
            vocab_size=info.vocab_size, max_model_len=info.max_model_len,
            kv_capacity_tokens=info.num_blocks * info.block_size,
            eos_token_ids=tuple(info.eos_token_ids),
        )  # fmt: skip
        call = stub.Connect()
        await call.write(scheduler_pb2.RouterMessage(router_id=self.settings.router_id))
        self.connected, self.credits = True, 0
        self.reconnect.connected()
        self.flush.set()  # tell the scheduler what is queued (resubmissions included)
        self.health.set_ready(self.accepting)
        log.info("connected to scheduler %s (%s)", self.settings.scheduler, info.model_name)
        writer = asyncio.create_task(self._write(call))
        try:
            await self._read(call)
        finally:
            writer.cancel()
            call.cancel()

    async def _write(self, call) -> None:
        """One message per wake-up: every abort and every release the credits allow."""
        last_queued = -1
        while True:
            await self.flush.wait()
            self.flush.clear()
            msg = scheduler_pb2.RouterMessage(aborts=self.aborts)
            self.aborts = []
            while self.credits and self.admission:
                add = self.admission.pop()
                msg.adds.append(add)
                self.requests[add.request_id].sent = True
                self.credits -= 1
            msg.num_queued = len(self.admission)
            if msg.adds or msg.aborts or msg.num_queued != last_queued:
                last_queued = msg.num_queued
                await call.write(msg)

    async def _read(self, call) -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return
            self._fan_out(msg)
            if msg.credits:
                self.credits += msg.credits
                self.flush.set()

    def _fan_out(self, msg: scheduler_pb2.SchedulerMessage) -> None:
        requests = self.requests
        finished = dict(zip(msg.finished_ids, msg.finish_reasons, strict=True))
        logprobs = msg.logprobs
        for i, (request_id, token_id) in enumerate(
            zip(msg.request_ids, msg.token_ids, strict=True)
        ):
            pending = requests.get(request_id)
            if pending is None:
                continue
            reason = finished.pop(request_id, 0) if finished else 0
            pending.finished = bool(reason)
            pending.generated.append(token_id)
            pending.mailbox.put((token_id, reason, logprobs[i] if logprobs else None))
        for request_id, reason in finished.items():  # ended without a token
            if (pending := requests.get(request_id)) is not None:
                pending.finished = True
                pending.mailbox.put((None, reason, None))
        for error in msg.errors:
            if (pending := requests.get(error.request_id)) is not None:
                pending.finished = True
                pending.mailbox.put(error)

    def _lost_scheduler(self) -> None:
        """The scheduler and all it held are gone. Every request it was serving goes
        back to the head of the admission queue as its remainder, for the next
        scheduler: its client sees a pause, then the rest of its tokens."""
        if not self.connected:
            return
        log.error("lost the scheduler at %s", self.settings.scheduler)
        self.connected = False
        self.reconnect.lost()
        self.health.set_ready(False)  # still live: the queue waits for the scheduler
        self.aborts = []  # the new scheduler never knew them
        resubmit = []
        for pending in self.requests.values():
            if pending.sent and not pending.finished:
                pending.sent = False
                resubmit.append(pending.remainder())
        self.admission.push_front(resubmit)

    def _fail_all(self, why: str) -> None:
        for pending in self.requests.values():
            if not pending.finished:
                pending.finished = True
                pending.mailbox.put(scheduler_pb2.RequestError(
                    request_id=pending.request_id, code=grpc.StatusCode.UNAVAILABLE.value[0],
                    message=f"{why}; retry the request",
                ))  # fmt: skip
        self.admission.clear()

    # -- clients ---------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Readiness, as the health entries report it: connected and admitting."""
        return self.connected and self.accepting

    @property
    def serving(self) -> bool:
        """Taking requests: while a lost scheduler may still come back, new requests
        queue up here."""
        return self.accepting and self.limits is not None and not self.reconnect.gave_up

    def check_serving(self) -> ModelLimits:
        if not self.serving or self.limits is None:
            raise RequestFailed(
                grpc.StatusCode.UNAVAILABLE, "the router is not serving; retry later"
            )
        return self.limits

    def submit(
        self,
        request: generation_pb2.GenerateRequest,
        metadata=(),
        operation: str = "text_completion",
    ) -> Pending:
        """Validate and queue one request; stream() it, then release() it. metadata:
        the call's headers (a W3C traceparent makes the request part of the client's
        trace). Raises RequestFailed."""
        limits = self.check_serving()
        try:
            token_ids = prompt_ids(request, self.tokenizer)
            sampling = validate(request, token_ids, limits)
        except RequestRejected as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.param) from None
        if refusal := self.admission.refusal(len(token_ids)):
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        trace = RequestTrace(
            self.tracer, self.model_info.model_name, request, len(token_ids), metadata, operation
        )
        request_id = uuid.uuid4().hex
        add = scheduler_pb2.AddRequest(
            request_id=request_id, prompt_token_ids=token_ids, sampling=sampling,
            min_tokens=request.min_tokens, ignore_eos=request.ignore_eos,
            stop_token_ids=request.stop_token_ids, priority=request.priority,
            arrival_time=time.time(), traceparent=trace.traceparent(), labels=request.labels,
        )  # fmt: skip
        if request.HasField("max_tokens"):
            add.max_tokens = request.max_tokens
        pending = Pending(request_id, request, token_ids, trace, add)
        self.requests[request_id] = pending
        self.admission.push(add)
        self.flush.set()
        return pending

    def release(self, pending: Pending) -> None:
        """The client stream ended: done, cancelled, past its deadline or stopped by a
        stop string. Whatever the scheduler still holds of it is aborted there.
        Idempotent."""
        pending.trace.abort("the stream ended before the request finished")
        if self.requests.pop(pending.request_id, None) is None:
            return
        if self.admission.cancel(pending.request_id):
            return  # never reached the scheduler
        if pending.sent and not pending.finished:
            self.aborts.append(pending.request_id)
            self.flush.set()

    async def stream(self, pending: Pending) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The request's chunks, the last with its finish reason and usage; released
        when the stream ends, however it ends. Raises RequestFailed."""
        try:
            async for chunk in self._chunks(pending):
                yield chunk
        finally:
            self.release(pending)

    async def _chunks(self, pending: Pending):
        """One chunk per wake-up, holding every token the mailbox had."""
        detokenizer = new_detokenizer(self.tokenizer, pending.prompt_token_ids)
        stream = ChunkBuilder(pending, detokenizer, StopStringMatcher(list(pending.request.stop)))
        interval = self.settings.stream_interval_ms / 1000
        while True:
            chunk, failure = stream.build(await pending.mailbox.take())
            if chunk is not None:
                yield chunk
            if failure is not None:
                raise failure
            if stream.done:
                return
            if interval:
                # At most a message per interval after the first: the tokens of the
                # steps meanwhile go out together (fewer, larger writes).
                await asyncio.sleep(interval)

    # -- shutdown --------------------------------------------------------------

    async def drain(self) -> None:
        self.accepting = False
        self.health.set_ready(False)
        deadline = asyncio.get_running_loop().time() + self.settings.drain_timeout
        while self.requests and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)


class ChunkBuilder:
    """Turns a stream's tokens into GenerateResponse chunks: text (detokenized, held
    back at a possible stop string), logprobs, and at the end the finish reason and
    usage."""

    __slots__ = ("detokenizer", "done", "num_generated", "pending", "stops")

    def __init__(self, pending: Pending, detokenizer, stops: StopStringMatcher) -> None:
        self.pending, self.detokenizer, self.stops = pending, detokenizer, stops
        self.num_generated, self.done = 0, False

    def build(self, items: list):
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
    def _failure(item) -> RequestFailed | None:
        if isinstance(item, scheduler_pb2.RequestError):
            return RequestFailed(STATUS.get(item.code, grpc.StatusCode.UNKNOWN), item.message)
        reason = item[1]
        if reason and reason not in CLIENT_FINISH:
            return RequestFailed(grpc.StatusCode.INTERNAL, "the request failed in the engine")
        return None

    def _add_all(self, chunk, items: list) -> None:
        """No stop strings: the tokens of several steps in one go (one detokenizer call,
        the costly part per token otherwise)."""
        token_ids = [item[0] for item in items if item[0] is not None]
        reason = items[-1][1] if items else 0
        if token_ids:
            if not self.num_generated:
                self.pending.trace.first_token()
            self.num_generated += len(token_ids)
            chunk.token_ids.extend(token_ids)
            chunk.logprobs.extend(item[2] for item in items if item[2] is not None)
        chunk.text = self.detokenizer.add(token_ids, final=bool(reason))
        if reason:
            last_token = token_ids[-1] if token_ids and items[-1][0] is not None else None
            self._finish(chunk, reason, last_token)

    def _add_one_by_one(self, chunk, items: list) -> None:
        texts: list[str] = []
        for token_id, reason, logprob in items:
            if self._add(chunk, texts, token_id, reason, logprob):
                break
        chunk.text = "".join(texts)

    def _add(self, chunk, texts: list[str], token_id, reason, logprob) -> bool:
        """Add one token (or a bare finish); whether the stream ended."""
        text = ""
        if token_id is not None:
            if not self.num_generated:
                self.pending.trace.first_token()
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

    def _finish(self, chunk, reason: int, last_token: int | None) -> None:
        chunk.finish_reason = reason  # the same values (FinishReason)
        if last_token is not None and last_token in self.pending.request.stop_token_ids:
            chunk.stop_reason = str(last_token)
        chunk.usage.prompt_tokens = len(self.pending.prompt_token_ids)
        chunk.usage.completion_tokens = self.num_generated
        self.pending.trace.finish(chunk.finish_reason, self.num_generated)
        self.done = True
