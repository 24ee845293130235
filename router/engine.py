"""The one request path behind both fronts (gRPC and OpenAI HTTP): validation, the
choice of a replica, the admission queues, the streams to the replicas' schedulers,
the fan-out of each step's tokens, detokenizing, stop strings and the request's
telemetry.

Each request goes to one replica (router/routing.py), waits in that replica's
admission queue here and is released to its scheduler against the credits it grants,
in batches; each engine step comes back as one message whose tokens are fanned out
to the client streams. A replica that is lost for good hands its requests, as their
remainders, to the others. A client stream is
`generate()`: GenerateResponse chunks in, whichever front turns them into its own
shape; a request that cannot be served raises RequestFailed with a gRPC status code,
which the HTTP front maps to its own."""

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from flagstop.health import Health
from flagstop.router.admission import AdmissionBudget
from flagstop.router.detokenizer import StopStringMatcher, new_detokenizer
from flagstop.router.discovery import Resolver, has_names, parse_targets
from flagstop.router.replica import Replica, ReplicaMismatch
from flagstop.router.routing import (
    PrefixIndex,
    ReplicaChooser,
    ReplicaView,
    RoutingConfig,
)
from flagstop.router.settings import RouterSettings
from flagstop.router.telemetry import ROUTED, RequestTrace
from flagstop.router.validation import ModelLimits, prompt_ids, validate
from flagstop.scheduler_svc.core.kv_cache_manager import chain_hashes
from flagstop.scheduler_svc.core.limits import RequestRejected
from flagstop.scheduler_svc.core.request import FinishReason
from flagstop.server import TLSConfig
from flagstop.telemetry import Telemetry
from flagstop.v1 import generation_pb2, scheduler_pb2

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
    replica: "Replica"  # where it is queued or served
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
        if add.sampling.HasField("structured_outputs"):  # the grammar replays them
            add.sampling.structured_outputs.num_prompt_tokens_constrained += done
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
        self.replicas: dict[str, Replica] = {}
        self.leaving: list[Replica] = []  # left the scheduler list, requests not moved yet
        self.budget = AdmissionBudget(settings.max_queued_requests, settings.max_queued_tokens)
        self.chooser = ReplicaChooser(
            RoutingConfig(
                settings.routing, settings.prefix_match_threshold,
                settings.balance_abs_threshold, settings.balance_rel_threshold,
            ),
            PrefixIndex(settings.prefix_index_blocks),
        )  # fmt: skip
        self.targets = parse_targets(settings.scheduler)
        self.resolver = Resolver()
        self.rediscover = asyncio.Event()
        self.accepting = True

    # -- the replicas ----------------------------------------------------------

    async def run(self) -> None:
        try:
            await asyncio.gather(self._discover_forever(), self._rebalance_forever())
        finally:
            for replica in self.replicas.values():
                await replica.stop()

    def reload(self, scheduler: str) -> None:
        """A new scheduler list (SIGHUP): replicas not in it leave, new ones join."""
        self.targets = parse_targets(scheduler)
        log.info("scheduler list: %s", ", ".join(self.targets))
        self.rediscover.set()

    async def _discover_forever(self) -> None:
        while True:
            await self._discover()
            interval = self.settings.resolve_interval_s if has_names(self.targets) else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.rediscover.wait(), interval)
            self.rediscover.clear()

    async def _discover(self) -> None:
        addresses = await self.resolver.addresses(self.targets)
        for address in addresses - self.replicas.keys():
            log.info("replica %s joins", address)
            self.replicas[address] = replica = Replica(address, self)
            replica.start()
        for address in self.replicas.keys() - addresses:
            log.info("replica %s leaves", address)
            replica = self.replicas.pop(address)
            self.leaving.append(replica)  # until its requests have moved on
            await replica.stop()

    def described(self, replica: Replica, info: scheduler_pb2.DescribeSchedulerResponse) -> None:
        """The replica's model must be the one the router already serves."""
        served = self.model_info.model_name
        if served and info.model_name != served:
            raise ReplicaMismatch(f"serves {info.model_name!r}, the other replicas {served!r}")
        if served and (self.limits.kv_capacity_tokens <= info.num_blocks * info.block_size):
            return  # the smallest replica bounds what a request may ask
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

    def connected(self, replica: Replica) -> None:
        self.health.set_ready(self.ready)

    def lost(self, replica: Replica) -> None:
        """The replica and all it held are gone. Every request it was serving goes back
        to the head of its admission queue as its remainder: its client sees a pause,
        then the rest of its tokens, from this replica when it is back within
        --replica-grace-s, from another otherwise (see rebalance)."""
        if not replica.connected:
            return
        log.error("lost the scheduler at %s", replica.address)
        replica.connected = False
        replica.reconnect.lost()
        replica.aborts = []  # the scheduler that comes back never knew them
        replica.reported = scheduler_pb2.ReplicaLoad()
        self.chooser.index.forget(replica.address)  # its prefix cache is gone
        self.health.set_ready(self.ready)  # still live: the queue waits for a replica
        resubmit = []
        for pending in self.requests.values():
            if pending.replica is replica and pending.sent and not pending.finished:
                pending.sent = False
                resubmit.append(pending.remainder())
        replica.admission.push_front(resubmit)

    async def _rebalance_forever(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            self.rebalance()

    def rebalance(self) -> None:
        """Requests queued at a replica that is gone move to the live ones; with none
        live, they wait up to --scheduler-timeout and then fail."""
        live = [r for r in self.replicas.values() if r.connected]
        grace = self.settings.replica_grace_s
        for replica in [*self.replicas.values(), *self.leaving]:
            if replica.connected or not replica.admission:
                continue
            if live and (replica.removed or replica.reconnect.lost_for_s > grace):
                self._move(replica, live)
            elif replica.reconnect.gave_up:
                self._fail(replica, f"no scheduler for {self.settings.scheduler_timeout:g}s")
        self.leaving = [r for r in self.leaving if r.admission]

    def _move(self, replica: Replica, live: list[Replica]) -> None:
        moved: dict[Replica, list[scheduler_pb2.AddRequest]] = {}
        for add in replica.admission.take_all():
            target = self._choose(add.prompt_token_ids, live, moved=True)
            self.requests[add.request_id].replica = target
            moved.setdefault(target, []).append(add)
        for target, adds in moved.items():
            target.admission.push_front(adds)  # they came before what is queued there
            target.flush.set()
            log.warning("%d requests move from %s to %s", len(adds), replica.address,
                        target.address)  # fmt: skip

    def _fail(self, replica: Replica, why: str) -> None:
        for add in replica.admission.take_all():
            pending = self.requests.get(add.request_id)
            if pending is not None and not pending.finished:
                pending.finished = True
                pending.mailbox.put(scheduler_pb2.RequestError(
                    request_id=pending.request_id, code=grpc.StatusCode.UNAVAILABLE.value[0],
                    message=f"{why}; retry the request",
                ))  # fmt: skip

    def _routable(self) -> list[Replica]:
        """The live replicas; with none, those lost that may still come back (requests
        queue for them, as for a restarting scheduler)."""
        replicas = self.replicas.values()
        live = [r for r in replicas if r.connected]
        return live or [
            r for r in replicas if r.described and not r.removed and not r.reconnect.gave_up
        ]

    def _choose(self, token_ids, replicas: list[Replica], moved: bool = False) -> Replica:
        by_name = {r.address: r for r in replicas}
        hashes = []
        if self.settings.routing == "prefix":
            hashes = chain_hashes(list(token_ids), self.model_info.block_size)
        views = [ReplicaView(r.address, r.load, r.reported.kv_cache_usage) for r in replicas]
        name, why = self.chooser.choose(hashes, views)
        replica = by_name[name]
        replica.routed_since_report += 1
        ROUTED.labels(name, "moved" if moved else why).inc()
        return replica

    def fan_out(self, msg: scheduler_pb2.SchedulerMessage) -> None:
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

    # -- clients ---------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Readiness, as the health entries report it: a replica connected, admitting."""
        return self.accepting and any(r.connected for r in self.replicas.values())

    @property
    def serving(self) -> bool:
        """Taking requests: while a lost replica may still come back, new requests
        queue up here."""
        return self.accepting and self.limits is not None and bool(self._routable())

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
        queues = (r.admission for r in self.replicas.values())
        if refusal := self.budget.refusal(queues, len(token_ids)):
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
        replica = self._choose(token_ids, self._routable())
        pending = Pending(request_id, request, token_ids, trace, add, replica)
        self.requests[request_id] = pending
        replica.admission.push(add)
        replica.flush.set()
        return pending

    def release(self, pending: Pending) -> None:
        """The client stream ended: done, cancelled, past its deadline or stopped by a
        stop string. Whatever the scheduler still holds of it is aborted there.
        Idempotent."""
        pending.trace.abort("the stream ended before the request finished")
        if self.requests.pop(pending.request_id, None) is None:
            return
        replica = pending.replica
        if replica.admission.cancel(pending.request_id):
            return  # never reached the scheduler
        if pending.sent and not pending.finished and replica.connected:
            replica.aborts.append(pending.request_id)
            replica.flush.set()

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
