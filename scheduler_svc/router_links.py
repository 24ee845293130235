"""The scheduler's links to its routers (the mirror of executor_link.py): one stream
each, requests and aborts in, every step's tokens, credits and load out, and the one
way a request ends in failure here (`fail`: ended in the core, counted, told to its
router).

Credits keep the waiting queue short: the scheduler hands out room for more requests
to the routers that have some queued, and a few standing credits besides, so that a
request arriving at a router goes out at once in one message."""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from flagstop.scheduler_svc.convert import handoff_to_proto
from flagstop.scheduler_svc.core.output import OwnerOutputs, SchedulerOutput
from flagstop.scheduler_svc.core.request import FINISHED_ERROR, FinishReason, Request
from flagstop.scheduler_svc.core.scheduler import Scheduler
from flagstop.scheduler_svc.core_handle import CoreHandle
from flagstop.scheduler_svc.executor_link import ExecutorLink
from flagstop.scheduler_svc.intake import Intake
from flagstop.scheduler_svc.router_connection import RouterConnection
from flagstop.scheduler_svc.settings import SchedulerSettings
from flagstop.scheduler_svc.telemetry import SchedulerTelemetry
from flagstop.v1 import executor_pb2, generation_pb2, scheduler_pb2

log = logging.getLogger("flagstop.scheduler")
# A router with nothing running here still hears the load this often (and when the
# replica goes idle), so that its replica choice does not rest on an old figure.
LOAD_REPORT_INTERVAL_S = 0.25
EMPTY_LOGPROB = generation_pb2.TokenLogprob()
# Credits a router may hold beyond its queued requests while the waiting queue has room.
SPARE_CREDITS = 8


class RouterLinks:
    def __init__(
        self, core: CoreHandle, intake: Intake, link: ExecutorLink,
        settings: SchedulerSettings, telemetry: SchedulerTelemetry,
    ) -> None:  # fmt: skip
        self.core, self.intake, self.link = core, intake, link
        self.settings, self.telemetry = settings, telemetry
        self.routers: dict[str, RouterConnection] = {}

    # -- a router's stream ------------------------------------------------------------

    async def stream(self, request_iterator) -> AsyncIterator[scheduler_pb2.SchedulerMessage]:
        """One router's Connect: what it sends is applied as it comes, what the engine
        has for it goes out in order."""
        conn = RouterConnection(router_id=uuid.uuid4().hex)
        reader = asyncio.create_task(self._read(conn, request_iterator))
        try:
            # The reader puts None when the router closes its side (one task for the
            # stream, not one per message: this runs once per engine step).
            while (msg := await conn.outbox.get()) is not None:
                yield msg
        finally:
            reader.cancel()
            self._drop(conn)

    async def _read(self, conn: RouterConnection, request_iterator) -> None:
        registered = False
        try:
            async for msg in request_iterator:
                if not registered:
                    if msg.router_id in self.routers:
                        log.error("refused a second router calling itself %s", msg.router_id)
                        return
                    conn.router_id = msg.router_id or conn.router_id
                    self.routers[conn.router_id] = conn
                    registered = True
                    if self.core.scheduler is not None:  # where it stands, at once
                        conn.outbox.put_nowait(scheduler_pb2.SchedulerMessage(
                            load=self.load()))  # fmt: skip
                self._apply(conn, msg)
        finally:
            conn.outbox.put_nowait(None)

    def _apply(self, conn: RouterConnection, msg: scheduler_pb2.RouterMessage) -> None:
        conn.num_queued = msg.num_queued
        scheduler = self.core.scheduler
        # While steps run, each step's message carries the credits (dispatch): only a
        # router with requests waiting for them, or an idle engine, gets them at once.
        stepping = scheduler is not None and scheduler.has_unfinished_requests()
        if msg.aborts and scheduler is not None:
            self.abort(msg.aborts)
        conn.held = max(0, conn.held - len(msg.adds))
        errors = [e for add in msg.adds if (e := self.intake.add(conn, add)) is not None]
        self._grant_credits()
        if errors or (conn.credits and (conn.num_queued or not stepping)):
            conn.outbox.put_nowait(
                scheduler_pb2.SchedulerMessage(errors=errors, credits=self._take_credits(conn))
            )
        self.link.wakeup.set()

    def _drop(self, conn: RouterConnection) -> None:
        """Its clients are gone with it: nobody is left to stream these tokens to."""
        conn.closed = True
        if self.routers.get(conn.router_id) is conn:
            del self.routers[conn.router_id]
        self.intake.cancel_owned_by(conn.router_id)
        if (scheduler := self.core.scheduler) is not None:
            self.abort(scheduler.request_ids_by_owner().get(conn.router_id, []))

    def abort(self, request_ids) -> None:
        """Their clients left: ended without a word to anyone."""
        self.intake.cancel(request_ids)
        self._scheduler().abort(request_ids)
        for request_id in request_ids:
            self.telemetry.on_finish(request_id, FinishReason.ABORT)

    def fail(self, ids_by_owner: dict[str, list[str]], code: grpc.StatusCode, message: str) -> None:
        """End these requests with an error their clients can act on."""
        for owner, ids in ids_by_owner.items():
            self._scheduler().abort(ids, FINISHED_ERROR)
            for request_id in ids:
                self.telemetry.on_finish(request_id, FinishReason.ERROR)
            self.send_errors(owner, [scheduler_pb2.RequestError(
                request_id=r, code=code.value[0], message=message) for r in ids])  # fmt: skip

    def refuse_shed(self, shed: list[tuple[Request, str]]) -> None:
        """Requests the policy shed (already freed in the core): their clients are
        told to retry later, with the policy's reason."""
        by_owner: dict[str, list[scheduler_pb2.RequestError]] = {}
        code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        for request, reason in shed:
            self.telemetry.on_finish(request.request_id, FinishReason.ABORT)
            by_owner.setdefault(request.owner, []).append(scheduler_pb2.RequestError(
                request_id=request.request_id, code=code, message=reason))  # fmt: skip
        for owner, errors in by_owner.items():
            self.send_errors(owner, errors)

    def send_errors(self, owner: str, errors: list[scheduler_pb2.RequestError]) -> None:
        if (conn := self.routers.get(owner)) is not None:
            conn.send_errors(errors)

    def report_load(self) -> None:
        """The load to every router now (its executor came or went)."""
        load, now = self.load(), time.monotonic()
        for conn in self.routers.values():
            conn.load_sent_at = now
            conn.outbox.put_nowait(scheduler_pb2.SchedulerMessage(load=load))

    def close(self) -> None:
        for conn in self.routers.values():
            conn.outbox.put_nowait(None)

    # -- each step ---------------------------------------------------------------------

    def dispatch(
        self, plan: SchedulerOutput, result: executor_pb2.StepResult,
        outputs: dict[str, OwnerOutputs],
    ) -> None:  # fmt: skip
        """A step's tokens to their routers, with credits and the load; the load alone
        to the others now and then."""
        logprobs = self._logprobs(plan, result) if result.logprobs else {}
        self._grant_credits()
        load, now = self.load(), time.monotonic()
        prompt_logprobs = self._prompt_logprobs(plan, result) if result.prompt_logprobs else {}
        for owner in prompt_logprobs.keys() - outputs.keys():
            outputs[owner] = OwnerOutputs()  # a prefill chunk that sampled nothing
        for owner, out in outputs.items():
            conn = self.routers.get(owner)
            if conn is None:
                continue
            conn.load_sent_at = now
            msg = scheduler_pb2.SchedulerMessage(
                step_id=plan.step_id, request_ids=out.req_ids, token_ids=out.new_token_ids,
                finished_ids=list(out.finished), finish_reasons=list(out.finished.values()),
                num_cached_tokens=out.num_cached_tokens, credits=self._take_credits(conn),
                load=load, prompt_logprobs=prompt_logprobs.get(owner, ()),
            )  # fmt: skip
            for request_id, handoff in out.kv_transfers.items():
                msg.kv_transfers[request_id].CopyFrom(handoff_to_proto(handoff))
            for request_id, pooled in out.pooled.items():
                msg.pooled[request_id] = pooled
            if logprobs:
                msg.logprobs.extend(self._in_order(out.req_ids, logprobs))
            conn.outbox.put_nowait(msg)
        idle = not self._scheduler().has_unfinished_requests()
        for conn in self.routers.values():
            if conn.router_id in outputs:
                continue
            if conn.credits or idle or now - conn.load_sent_at > LOAD_REPORT_INTERVAL_S:
                conn.load_sent_at = now
                conn.outbox.put_nowait(
                    scheduler_pb2.SchedulerMessage(credits=self._take_credits(conn), load=load)
                )

    @staticmethod
    def _logprobs(plan: SchedulerOutput, result: executor_pb2.StepResult) -> dict[str, list]:
        """Each sampling request's logprob entries, one per token it emitted."""
        counts, flat, start = result.num_sampled_tokens, result.logprobs, 0
        if not counts:
            return {r.request_id: [lp] for r, lp in zip(plan.sampling_requests, flat, strict=True)}
        by_request = {}
        for request, n in zip(plan.sampling_requests, counts, strict=True):
            by_request[request.request_id], start = flat[start : start + n], start + n
        return by_request

    @staticmethod
    def _in_order(req_ids: list[str], logprobs: dict[str, list]):
        # A request's tokens are consecutive: its entries are taken in turn.
        taken: dict[str, int] = {}
        for req_id in req_ids:
            entries, i = logprobs.get(req_id, ()), taken.get(req_id, 0)
            taken[req_id] = i + 1
            yield entries[i] if i < len(entries) else EMPTY_LOGPROB

    def _prompt_logprobs(
        self, plan: SchedulerOutput, result: executor_pb2.StepResult
    ) -> dict[str, list]:
        """The step's prompt logprobs by owner: of requests still held, or that
        finished in this very step (their first token was their last)."""
        owner_of = self._scheduler().owner_of
        sampled = {r.request_id: r.owner for r in plan.sampling_requests}
        by_owner: dict[str, list] = {}
        for chunk in result.prompt_logprobs:
            owner = owner_of(chunk.req_id) or sampled.get(chunk.req_id)
            if owner is not None:
                by_owner.setdefault(owner, []).append(chunk)
        return by_owner

    # -- the load ----------------------------------------------------------------------

    def load(self) -> scheduler_pb2.ReplicaLoad:
        """What this replica reports to its routers (and gateways) with each step."""
        scheduler = self._scheduler()
        figures = scheduler.load()
        load = scheduler_pb2.ReplicaLoad(
            num_running=figures.num_running, num_waiting=self.num_waiting(scheduler),
            kv_cache_usage=figures.kv_cache_usage, lora_adapters_version=self.link.lora_version,
            executor_lost=not self.link.connected,
            num_host_cached_blocks=figures.num_host_cached_blocks,
            external_prefix_cache_hits=figures.external_prefix_cache_hits,
            running_loras=figures.running_loras, waiting_loras=figures.waiting_loras,
            prefix_cache_queries=figures.prefix_cache_queries,
            prefix_cache_hits=figures.prefix_cache_hits,
        )  # fmt: skip
        if scheduler.config.max_loras:
            self.telemetry.lora_requests(figures.running_loras, figures.waiting_loras,
                                         scheduler.config.max_loras)  # fmt: skip
        return load

    def num_waiting(self, scheduler: Scheduler) -> int:
        """Requests waiting here and those the routers still hold queued for us."""
        return len(scheduler.waiting) + self.intake.num_compiling + self.num_queued

    def _scheduler(self) -> Scheduler:
        scheduler = self.core.scheduler
        assert scheduler is not None, "a step or a request before the executor described itself"
        return scheduler

    # -- credits -----------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        """Requests the routers still hold queued for us."""
        return sum(c.num_queued for c in self.routers.values())

    def _tokens_full(self) -> bool:
        """--max-waiting-tokens: the prompt tokens still to compute of the requests
        waiting here reached it (no cap: 0); the rest wait at the routers, whose own
        caps then refuse with RESOURCE_EXHAUSTED."""
        cap = self.settings.max_waiting_tokens
        if not cap:
            return False
        waiting = self._scheduler().waiting
        return sum(r.num_tokens - r.num_computed_tokens for r in waiting) >= cap

    def _grant_credits(self) -> None:
        """Hand out room for more requests to the routers that have some queued, one at
        a time in turn; then, while room is left, a few standing credits each
        (SPARE_CREDITS), so that a request arriving at a router goes out at once in one
        message, instead of being announced, waiting a round trip for its credit and
        then sent (three messages)."""
        core = self.core
        if core.scheduler is None or not core.accepting:
            return
        outstanding = sum(c.credits + c.held for c in self.routers.values())
        waiting = len(core.scheduler.waiting) + self.intake.num_compiling
        room = self.settings.max_waiting_requests - waiting - outstanding
        if self._tokens_full():
            room = 0
        for spare in (0, SPARE_CREDITS):
            wanting = [c for c in self.routers.values()
                       if c.num_queued + spare > c.credits + c.held]  # fmt: skip
            while room > 0 and wanting:
                for conn in list(wanting):
                    if room == 0:
                        break
                    conn.credits += 1
                    room -= 1
                    if conn.credits + conn.held >= conn.num_queued + spare:
                        wanting.remove(conn)

    @staticmethod
    def _take_credits(conn: RouterConnection) -> int:
        # Credits are sent once and held at the router until its adds spend them.
        sent, conn.credits = conn.credits, 0
        conn.held += sent
        conn.num_queued = max(0, conn.num_queued - sent)
        return sent
