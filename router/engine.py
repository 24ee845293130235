"""The one request path behind both fronts (gRPC and OpenAI HTTP): validation,
admission, the fan-out of each step's tokens and the client streams.

A request is validated against the model, given a replica (router/replicas.py) and
queued there; its scheduler's steps come back as one message per step whose tokens
the fan-out appends to each request's Pending; the client stream turns them into
chunks (router/pending.py). A front calls submit(), iterates stream() and the stream
releases the request however it ends; a request that cannot be served raises
RequestFailed with a gRPC status code, which the HTTP front maps to its own."""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from flagstop.adapters import already_loaded, name_refusal
from flagstop.health import Health
from flagstop.router.admission import AdmissionBudget
from flagstop.router.auth import NO_KEYS, ApiKeys, tenant_salt
from flagstop.router.detokenizer import StopStringMatcher, new_detokenizer
from flagstop.router.media.inputs import ImageRef, router_media
from flagstop.router.media.processor import Processed
from flagstop.router.objective_defaults import ObjectiveDefaults
from flagstop.router.pending import ChunkBuilder, Pending, RequestFailed
from flagstop.router.recorder import recorder
from flagstop.router.replicas import ReplicaSet
from flagstop.router.settings import RouterSettings
from flagstop.router.telemetry import RequestTrace
from flagstop.router.validation import ModelLimits, prompt_ids, validate
from flagstop.scheduler_svc.core.limits import RequestRejected
from flagstop.scheduler_svc.core.objectives import ms_of
from flagstop.telemetry import Telemetry
from flagstop.v1 import generation_pb2, scheduler_pb2

log = logging.getLogger("flagstop.router")

REQUEST_FINISH_TRANSFER = scheduler_pb2.REQUEST_FINISH_TRANSFER
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


SESSION_HEADER = "x-session-id"  # a session's key (docs/sessions.md)


class RouterEngine:
    def __init__(
        self, tokenizer, settings: RouterSettings, health: Health, telemetry: Telemetry,
        keys: ApiKeys = NO_KEYS,
    ) -> None:  # fmt: skip
        """keys: the API keys the fronts check; a tenant's binds its requests."""
        self.tokenizer = tokenizer
        self.keys = keys
        self.tracer = telemetry.tracer
        self.settings = settings
        self.health = health
        self.requests: dict[str, Pending] = {}
        self.budget = AdmissionBudget(settings.max_queued_requests, settings.max_queued_tokens)
        self.objectives = ObjectiveDefaults(settings.slo_defaults)
        self.recorder = recorder(settings.record_workload)
        self.media = router_media(settings, tokenizer)  # images (TextOnlyMedia: none)
        self.replicas = ReplicaSet(settings, self.requests, self.fan_out, self._readiness)
        self.accepting = True

    @property
    def model_info(self) -> generation_pb2.ModelInfo:
        return self.replicas.model_info

    @property
    def limits(self) -> ModelLimits | None:
        return self.replicas.limits

    async def run(self) -> None:
        await self.replicas.run()

    def reload(self, scheduler: str) -> None:
        self.replicas.reload(scheduler)

    # -- readiness -------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Readiness, as the health entries report it: a replica connected, admitting."""
        return self.accepting and self.replicas.any_serving

    def _readiness(self) -> None:
        self.health.set_ready(self.ready)

    def check_serving(self) -> ModelLimits:
        """Whether requests are taken now (every route and front asks this); raises
        RequestFailed UNAVAILABLE saying why not."""
        if self.limits is None:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, (
                "the router is not serving yet: no scheduler has connected (with its "
                "executor's model); retry later"))  # fmt: skip
        if not self.accepting:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE,
                                "the router is shutting down; retry on another")  # fmt: skip
        if not self.replicas.routable():
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, (
                "no replica can serve: none has a working executor (lost or restarting "
                f"for over {self.settings.replica_grace_s:g}s) or a scheduler; retry later"
            ))  # fmt: skip
        return self.limits

    # -- the request path ------------------------------------------------------

    def submit(
        self,
        request: generation_pb2.GenerateRequest,
        metadata=(),
        operation: str = "text_completion",
        media: Processed | None = None,
    ) -> Pending:
        """Validate and queue one request; stream() it, then release() it. metadata:
        the call's headers (a W3C traceparent makes the request part of the client's
        trace); media: its prompt as processed with its images (process_images).
        Raises RequestFailed (the refusal recorded with --record-workload)."""
        arrival = time.time()
        try:
            return self._queue(request, metadata, operation, arrival, media)
        except RequestFailed as e:
            self.recorder.refused(request, self.tokenizer, arrival, e)
            raise

    async def process_images(self, request: generation_pb2.GenerateRequest) -> Processed | None:
        """A gRPC request's images, with its prompt text (None: it has none). Raises
        RequestFailed."""
        images = [ImageRef(f"images[{i}]", image.url, image.data)
                  for i, image in enumerate(request.images)]  # fmt: skip
        if images and not request.prompt:
            raise RequestFailed(
                grpc.StatusCode.INVALID_ARGUMENT,
                "images need a text prompt holding their placeholders, not prompt_token_ids",
                "prompt",
            )
        try:
            return await self.process_media(request.prompt, images, add_special_tokens=True)
        except RequestRejected as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.param) from None

    async def process_media(self, text: str, images: list[ImageRef],
                            add_special_tokens: bool) -> Processed | None:  # fmt: skip
        """A prompt's images processed, their pixels in the executor's dtype
        (RequestRejected for a bad one)."""
        return await self.media.process(text, images, add_special_tokens,
                                        self.model_info.pixel_dtype)  # fmt: skip

    def _queue(self, request: generation_pb2.GenerateRequest, metadata, operation: str,
               arrival: float, media: Processed | None) -> Pending:  # fmt: skip
        limits = self.check_serving()
        lora_name, lora_id = request.lora_name, ""
        if lora_name and (lora_id := self.replicas.adapter_id(lora_name)) is None:
            message = f"LoRA adapter {lora_name!r} is not loaded (/v1/models lists them)"
            raise RequestFailed(grpc.StatusCode.NOT_FOUND, message, "model")
        try:
            token_ids = media.token_ids if media else prompt_ids(request, self.tokenizer)
            sampling = validate(request, token_ids, limits)
        except RequestRejected as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.param) from None
        key_tenant = self.keys.tenant_of(metadata)  # a tenant's key binds its requests
        try:
            objectives = self.objectives.resolve(request, metadata, key_tenant)
        except RequestRejected as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.param) from None
        queues = (r.admission for r in self.replicas)
        if refusal := self.budget.refusal(queues, len(token_ids)):
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        trace = RequestTrace(self.tracer, self.model_info.model_name, request, len(token_ids),
                             metadata, operation, objectives)  # fmt: skip
        request_id = uuid.uuid4().hex
        add = scheduler_pb2.AddRequest(
            request_id=request_id, prompt_token_ids=token_ids, sampling=sampling,
            min_tokens=request.min_tokens, ignore_eos=request.ignore_eos,
            stop_token_ids=request.stop_token_ids, priority=request.priority,
            arrival_time=arrival, traceparent=trace.traceparent(), labels=request.labels,
            lora_name=lora_name, lora_id=lora_id, tenant=objectives.tenant,
            request_class=objectives.request_class, slo_ttft_ms=ms_of(objectives.ttft_s),
            slo_tpot_ms=ms_of(objectives.tpot_s),
        )  # fmt: skip
        if key_tenant:
            add.labels["tenant"] = key_tenant
        if media is not None:
            add.media.extend(media.media)
            add.media_data.extend(media.media_data)
        add.cache_salt = (tenant_salt(key_tenant, request.cache_salt) if key_tenant
                          else request.cache_salt)  # fmt: skip
        clamped = self._retention(request, add)
        if not request.session_id:  # the header says it where the body does not
            request.session_id = next((v for k, v in metadata if k.lower() == SESSION_HEADER
                                       and isinstance(v, str)), "")  # fmt: skip
        add.session_id = request.session_id
        if request.HasField("max_tokens"):
            add.max_tokens = request.max_tokens
        if request.HasField("num_speculative_tokens"):
            add.num_speculative_tokens = request.num_speculative_tokens
        pending = Pending(request_id, request, token_ids, trace, add)
        pending.retention_clamped_s = clamped
        if request.HasField("logprobs"):
            pending.logprobs = []
        replica, queued = self.replicas.place(pending, add, self.replicas.routable())
        self.requests[request_id] = pending
        replica.admission.push(queued)
        replica.flush.set()
        return pending

    def _retention(self, request: generation_pb2.GenerateRequest,
                   add: scheduler_pb2.AddRequest) -> float | None:  # fmt: skip
        """The prompt's retention, its ttl clamped to --max-cache-ttl-s: the ttl it
        was clamped to (the APIs say so in a header), or None."""
        if not request.HasField("retention") or request.retention.priority <= 0:
            return None
        add.retention.CopyFrom(request.retention)
        limit = self.settings.max_cache_ttl_s
        if add.retention.ttl_s <= limit:
            return None
        add.retention.ttl_s = limit
        return limit

    def release(self, pending: Pending) -> None:
        """The client stream ended: done, cancelled, past its deadline or stopped by a
        stop string. Whatever the scheduler still holds of it is aborted there.
        Idempotent."""
        pending.trace.abort("the stream ended before the request finished")
        if self.requests.pop(pending.request_id, None) is None:
            return
        self.recorder.record(pending)
        replica = pending.replica
        if replica.admission.cancel(pending.request_id):
            return  # never reached the scheduler
        if pending.sent and not pending.finished:
            replica.abort(pending.request_id)

    def fan_out(self, msg: scheduler_pb2.SchedulerMessage) -> None:
        """One scheduler message: each token to its request (a request's tokens of a
        step are consecutive: speculative decoding's 1 + accepted drafts), then the
        ends, then the failures; each waiting stream woken once it has news. The
        per-token loop is the router's hottest: an append and a waiter check."""
        requests = self.requests
        if msg.num_cached_tokens or msg.prompt_logprobs:
            self._prefill_facts(msg)
        if msg.logprobs:
            self._logprobs(msg)
        for request_id, pooled in msg.pooled.items():  # before the ends that follow them
            if (pending := requests.get(request_id)) is not None:
                pending.pooled = pooled
        for request_id, token_id in zip(msg.request_ids, msg.token_ids, strict=True):
            pending = requests.get(request_id)
            if pending is not None:
                pending.generated.append(token_id)
                if (waiter := pending.waiter) is not None:  # Pending.wake, inlined
                    pending.waiter = None
                    if not waiter.done():
                        waiter.set_result(None)
        for request_id, reason in zip(msg.finished_ids, msg.finish_reasons, strict=True):
            if (pending := requests.get(request_id)) is None:
                continue
            if reason == REQUEST_FINISH_TRANSFER:  # its prefill is done: the decode goes on
                self.replicas.hand_off(pending, msg.kv_transfers.get(request_id))
            else:
                pending.end(reason)
        for error in msg.errors:
            if (pending := requests.get(error.request_id)) is not None:
                if error.code == RESOURCE_EXHAUSTED:  # shed by the scheduler's policy
                    pending.trace.shed()
                pending.failed(error)

    def _logprobs(self, msg: scheduler_pb2.SchedulerMessage) -> None:
        """Each token's logprob entry beside it (the requests that asked for them)."""
        requests = self.requests
        for request_id, entry in zip(msg.request_ids, msg.logprobs, strict=True):
            pending = requests.get(request_id)
            if pending is not None and pending.logprobs is not None:
                pending.logprobs.append(entry)

    def _prefill_facts(self, msg: scheduler_pb2.SchedulerMessage) -> None:
        """What a message tells of prefills: prompt logprobs (before the tokens they
        precede) and the prefix-cache hits of finished requests."""
        requests = self.requests
        for chunk in msg.prompt_logprobs:
            if (pending := requests.get(chunk.req_id)) is not None:
                pending.add_prompt_logprobs(chunk.first_token, chunk.logprobs)
        for request_id, num_cached in zip(msg.finished_ids, msg.num_cached_tokens, strict=False):
            if (pending := requests.get(request_id)) is not None:
                pending.num_cached_tokens = num_cached

    async def stream(self, pending: Pending) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The request's chunks, one per wake-up holding everything new, the last with
        its finish reason and usage; released when the stream ends, however it ends.
        Raises RequestFailed. One generator, its wait inline: a resumed generator or
        coroutine per message is what the router's own CPU per token is made of."""
        try:
            detokenizer = new_detokenizer(self.tokenizer, pending.prompt_token_ids)
            stops = StopStringMatcher(list(pending.request.stop))
            builder = ChunkBuilder(pending, detokenizer, stops)
            interval = self.settings.stream_interval_ms / 1000
            loop = asyncio.get_running_loop()
            while True:
                if not builder.has_news:
                    pending.waiter = loop.create_future()
                    await pending.waiter
                chunk, failure = builder.build()
                if chunk is not None:
                    yield chunk
                if failure is not None:
                    raise failure
                if builder.done:
                    return
                if interval:
                    # At most a message per interval after the first: the tokens of the
                    # steps meanwhile go out together (fewer, larger writes).
                    await asyncio.sleep(interval)
        finally:
            self.release(pending)

    # -- LoRA adapters -----------------------------------------------------------

    async def load_lora(
        self, name: str, path: str, load_inplace: bool = False
    ) -> generation_pb2.LoadLoRAAdapterResponse:
        """On every connected replica (each reads its own copy of the directory); the
        first refusal is raised as RequestFailed, the replicas that took it keep it.
        A name that is the base model's, or loaded already (unless load_inplace, which
        replaces it), is refused before any replica is asked."""
        if refusal := name_refusal(name, self.model_info.model_name):
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, refusal, "lora_name")
        if name in self.replicas.adapters() and not load_inplace:
            raise RequestFailed(grpc.StatusCode.ALREADY_EXISTS, already_loaded(name), "lora_name")
        request = generation_pb2.LoadLoRAAdapterRequest(
            lora_name=name, lora_path=path, load_inplace=load_inplace
        )
        replicas = [r for r in self.replicas if r.connected]
        replies = await self._on_replicas("LoadLoRAAdapter", request, replicas)
        for replica, reply in zip(replicas, replies, strict=True):
            if isinstance(reply, generation_pb2.LoadLoRAAdapterResponse):
                replica.adapters[name] = generation_pb2.LoRAAdapter(name=name, path=path,
                                                                    id=reply.id)  # fmt: skip
        self._raise_first_refusal(replicas, replies)
        return replies[0]

    async def unload_lora(self, name: str) -> None:
        """From every replica that holds it: NOT_FOUND when none does."""
        holders = [r for r in self.replicas if r.connected and name in r.adapters]
        if not holders:
            message = f"no LoRA adapter {name!r} is loaded (/v1/models lists them)"
            raise RequestFailed(grpc.StatusCode.NOT_FOUND, message, "lora_name")
        request = generation_pb2.UnloadLoRAAdapterRequest(lora_name=name)
        replies = await self._on_replicas("UnloadLoRAAdapter", request, holders)
        for replica in holders:
            replica.adapters.pop(name, None)
        self._raise_first_refusal(holders, replies)

    async def _on_replicas(self, method: str, request, replicas: list) -> list:
        """Each replica's reply, or the exception it raised."""
        if not replicas:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "no replica is connected; retry")
        calls = [getattr(r.stub, method)(request, timeout=60) for r in replicas]
        return await asyncio.gather(*calls, return_exceptions=True)

    @staticmethod
    def _raise_first_refusal(replicas: list, replies: list) -> None:
        """The scheduler's (or executor's) own message reaches the client; which replica
        said it goes to the log, not to the client (an internal address)."""
        for replica, reply in zip(replicas, replies, strict=True):
            if isinstance(reply, grpc.aio.AioRpcError):
                log.warning("replica %s: %s", replica.address, reply.details())
                raise RequestFailed(reply.code(), reply.details())
            if isinstance(reply, BaseException):
                raise reply

    # -- shutdown --------------------------------------------------------------

    async def drain(self) -> None:
        self.accepting = False
        self.health.set_ready(False)
        deadline = asyncio.get_running_loop().time() + self.settings.drain_timeout
        while self.requests and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
