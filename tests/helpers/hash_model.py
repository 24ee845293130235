"""A deterministic stand-in for the executor, for scheduler tests.

It keeps a persistent batch and a paged "KV cache" (slot -> (token, position)) the way
the real executor does, and its next token is a hash of every previous token READ
BACK THROUGH THE BLOCK TABLE. A wrong block table, a bad prefix-cache hit or a block
reused too early changes the tokens, so equality with `reference_tokens` proves the
scheduler's bookkeeping, not just its arithmetic.

With draft slots in a plan it speculates like the real executor: it proposes drafts
(right ones, wrong ones from a seeded coin, or fewer than the slots), writes them to
the KV cache after the request's tokens, and verifies them against its hash, so
rollbacks, trims and multi-token outputs go through the same read-back.

A pooling request (request.pools) samples nothing: at its prompt's end its pooled
output is the digest of its prompt read back through the block table (`pooled`).

With KV cache groups (kv_groups.py) each token is written through every group's block
table, tagged with its group; the hash reads the first full-attention group, and
every window group's read of the window before each sampled position must find its
own entries (a block freed too early, or another group's block, fails it). A recurrent
group's blocks hold states instead (kv_groups.py): a forward reads the state after the
request's computed tokens from that last token's block, which must be the state of
exactly those tokens (a hit on another prefix's state, or a block freed too early,
fails it), writes the state at each block end it passes and after its last token, and
after a verification the state after the accepted tokens (the rollback)."""

import hashlib
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flagstop.scheduler_svc.core.kv_connector import NO_TRANSFERS
from flagstop.scheduler_svc.core.kv_groups import KVCacheGroup, kv_cache_groups
from flagstop.scheduler_svc.core.output import OwnerOutputs, SchedulerOutput, StepOutcome
from flagstop.scheduler_svc.core.request import StopParams
from flagstop.scheduler_svc.core.scheduler import Scheduler


def next_token(tokens: list[int] | tuple[int, ...], vocab_size: int) -> int:
    digest = hashlib.blake2b(repr(tuple(tokens)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab_size


def reference_tokens(
    prompt: list[int],
    stop: StopParams,
    eos_ids: frozenset[int],
    vocab_size: int,
    max_model_len: int,
) -> list[int]:
    """What one request alone must produce: the oracle for every schedule."""
    tokens, out = list(prompt), []
    while True:
        token = next_token(tokens, vocab_size)
        tokens.append(token)
        out.append(token)
        if len(out) >= stop.min_tokens and (
            token in stop.stop_token_ids or (not stop.ignore_eos and token in eos_ids)
        ):
            return out
        if len(out) == stop.max_tokens or len(tokens) >= max_model_len:
            return out


@dataclass(slots=True)
class _CachedRequest:
    token_ids: list[int]
    block_ids: list[list[int]]  # per group
    num_computed_tokens: int
    pools: bool = False


def _digest(tokens: list[int]) -> bytes:
    return hashlib.blake2b(repr(tuple(tokens)).encode(), digest_size=8).digest()


def pooled_output(prompt: list[int]) -> bytes:
    """What one pooling request alone must get back: the oracle of its pooled output."""
    return b"pooled:" + _digest(prompt)


def split_groups(block_ids, num_groups: int) -> list[list[int]]:
    """A plan's position-major block ids as one list per group."""
    return [list(block_ids[g::num_groups]) for g in range(num_groups)]


class HashModelExecutor:
    def __init__(
        self, num_blocks: int, block_size: int, vocab_size: int, draft_error_rate: float = 0.3,
        seed: int = 0, groups: list[KVCacheGroup] | None = None,
    ) -> None:  # fmt: skip
        """draft_error_rate: the chance that a proposed draft token is wrong."""
        self.groups = groups or kv_cache_groups([])
        self.windows = [g.sliding_window for g in self.groups]
        self.recurrent = [g for g, group in enumerate(self.groups) if group.is_recurrent]
        self.nulls = any(g.window for g in self.groups)
        full = [g for g, window in enumerate(self.windows) if not window]
        self.hash_group = full[0] if full else None  # None: the windows alone
        self.block_size = block_size
        self.vocab_size = vocab_size
        # Slot -> (token, position, group); a recurrent group's block holds its state
        # in its first slot: ("state", tokens it has seen, group, their digest).
        self.kv: list[tuple | None] = [None] * (num_blocks * block_size)
        self.requests: dict[str, _CachedRequest] = {}
        self.draft_error_rate = draft_error_rate
        self.rng = random.Random(seed)
        # Drafts proposed per sampling request, and the pooling requests' outputs, by
        # step id (the StepResult's columns).
        self.num_drafts: dict[int, list[int]] = {}
        self.pooled: dict[int, list[bytes]] = {}

    def _slot(self, state: _CachedRequest, position: int, group: int = 0) -> int:
        block = state.block_ids[group][position // self.block_size]
        assert not (block == 0 and self.nulls), f"position {position}: the null block"
        return block * self.block_size + position % self.block_size

    def execute(self, plan: SchedulerOutput) -> list[list[int]]:
        """Per sampling request, its new tokens (one; with drafts 1 + accepted)."""
        self._apply_diff(plan)
        slots = plan.num_draft_slots
        drafts: dict[str, list[int]] = {}
        # Like a real forward: every new token's K/V is stored before any attention reads.
        for rid, num_new in plan.num_scheduled_tokens.items():
            # Logits come from computing a token: a request with none scheduled has none.
            assert num_new > 0, f"{rid} scheduled with no token to compute"
            state = self.requests[rid]
            num_known = num_new - slots.get(rid, 0)
            start = state.num_computed_tokens
            assert start + num_known <= len(state.token_ids), f"{rid} scheduled past its tokens"
            written = state.token_ids[start : start + num_known]
            if rid in slots:
                assert start + num_known == len(state.token_ids), f"{rid} drafts mid-prompt"
                drafts[rid] = self._propose(state.token_ids, slots[rid])
                written = written + drafts[rid]
            for pos, token in enumerate(written, start):
                for g in range(len(self.groups)):
                    if g not in self.recurrent:
                        self.kv[self._slot(state, pos, g)] = (token, pos, g)
            self._advance_states(state, start, state.token_ids[:start] + written)
        sampled, num_drafts, pooled = [], [], []
        for rid, num_new in plan.num_scheduled_tokens.items():
            state = self.requests[rid]
            state.num_computed_tokens += num_new - slots.get(rid, 0)
            if state.num_computed_tokens == len(state.token_ids) and state.pools:
                pooled.append(pooled_output(self._context(state)))
            elif state.num_computed_tokens == len(state.token_ids):
                sampled.append(self._verify(state, drafts.get(rid, [])))
                num_drafts.append(len(drafts.get(rid, [])))
        if slots:
            self.num_drafts[plan.step_id] = num_drafts
        if pooled:
            self.pooled[plan.step_id] = pooled
        return sampled

    def _advance_states(self, state: _CachedRequest, start: int, tokens: list[int]) -> None:
        """Each recurrent group's state read at start, then written at each block end
        after it and after the last of tokens."""
        bs, end = self.block_size, len(tokens)
        ends = [*range((start // bs + 1) * bs, end, bs), end]
        for g in self.recurrent:
            if start:
                block = state.block_ids[g][(start - 1) // bs]
                assert block != 0, f"the state after {start} tokens: the null block"
                found = self.kv[block * bs]
                assert found == ("state", start, g, _digest(tokens[:start])), (
                    f"group {g}: block {block} holds {found} for the state after {start}"
                )
            for n in ends:
                self._write_state(state, g, n, tokens)

    def _write_state(self, state: _CachedRequest, g: int, n: int, tokens: list[int]) -> None:
        block = state.block_ids[g][(n - 1) // self.block_size]
        self.kv[block * self.block_size] = ("state", n, g, _digest(tokens[:n]))

    def _propose(self, tokens: list[int], num_slots: int) -> list[int]:
        """Up to num_slots drafts: the right continuation, wrong from a coin's first
        failure on, and sometimes fewer than asked (as a proposer without a match)."""
        context, out = list(tokens), []
        for _ in range(self.rng.randrange(num_slots + 1)):
            token = next_token(context, self.vocab_size)
            if self.rng.random() < self.draft_error_rate:
                token = (token + 1) % self.vocab_size
            context.append(token)
            out.append(token)
        return out

    def _verify(self, state: _CachedRequest, drafts: list[int]) -> list[int]:
        """The drafts the hash agrees with (read back through the block table), then
        one token more."""
        emitted = []
        for draft in drafts:
            token = self._sample(state)
            emitted.append(token)
            if token != draft:
                break
            state.num_computed_tokens += 1  # the draft's K/V is in the cache
        else:
            emitted.append(self._sample(state))
        if drafts:  # the recurrent states roll back to the tokens kept
            for g in self.recurrent:
                self._write_state(state, g, state.num_computed_tokens, state.token_ids)
        return emitted

    def _apply_diff(self, plan: SchedulerOutput) -> None:
        for rid in plan.finished_req_ids | plan.preempted_req_ids:
            self.requests.pop(rid, None)
        for rid, num_blocks in plan.trimmed_blocks.items():
            if (state := self.requests.get(rid)) is not None:
                assert num_blocks * self.block_size >= state.num_computed_tokens, "trimmed too far"
                for block_ids in state.block_ids:
                    del block_ids[num_blocks:]
        num_groups = len(self.groups)
        for data in plan.scheduled_new_reqs + plan.scheduled_resumed_reqs:
            assert data.req_id not in self.requests, f"{data.req_id} sent twice"
            self.requests[data.req_id] = _CachedRequest(
                list(data.token_ids), split_groups(data.block_ids, num_groups),
                data.num_computed_tokens, data.pools,
            )  # fmt: skip
        cached = plan.scheduled_cached_reqs
        for rid, num_computed, new_ids in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True
        ):
            state = self.requests[rid]
            # The scheduler counts drafts as computed until it hears they were not.
            assert state.num_computed_tokens <= num_computed, (
                rid,
                state.num_computed_tokens,
                num_computed,
            )
            for block_ids, ids in zip(state.block_ids, split_groups(new_ids, num_groups),
                                      strict=True):  # fmt: skip
                block_ids.extend(ids)

    def _sample(self, state: _CachedRequest) -> int:
        n = state.num_computed_tokens
        for g, window in enumerate(self.windows):
            if window:  # what the group's layers read: the window before position n
                self._read(state, range(max(0, n - window), n), g)
        token = next_token(self._context(state), self.vocab_size)
        state.token_ids.append(token)
        return token

    def _context(self, state: _CachedRequest) -> list[int]:
        """Its computed tokens, read back through the first full-attention group's
        block table (the windows alone: as known)."""
        n = state.num_computed_tokens
        if self.hash_group is None:
            return state.token_ids[:n]
        return self._read(state, range(n), self.hash_group)

    def _read(self, state: _CachedRequest, positions: range, g: int) -> list[int]:
        context = [self.kv[self._slot(state, pos, g)] for pos in positions]
        for pos, entry in zip(positions, context, strict=True):
            assert entry is not None and entry[1:] == (pos, g), (
                f"group {g}: slot for position {pos} holds {entry}"
            )
            assert entry[0] == state.token_ids[pos], f"group {g}: another token at {pos}"
        return [entry[0] for entry in context]  # type: ignore[index]


@dataclass(slots=True)
class Driver:
    """Runs a scheduler against the stand-in executor with `depth` steps in flight
    (depth 2 = the service's async scheduling) and collects every owner's tokens."""

    scheduler: Scheduler
    executor: HashModelExecutor
    depth: int = 2
    on_step: Callable[[SchedulerOutput], None] | None = None
    # A KV connector's worker side (tests/helpers/fake_kv_tier.py), or None.
    tier_worker: Any = None
    in_flight: deque[tuple[SchedulerOutput, list[list[int]], Any]] = field(default_factory=deque)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    pooled: dict[str, bytes] = field(default_factory=dict)
    finish_reasons: dict[str, object] = field(default_factory=dict)
    num_steps: int = 0

    def step(self) -> SchedulerOutput:
        plan = self.scheduler.schedule()
        self.num_steps += 1
        if self.on_step is not None:
            self.on_step(plan)
        if not plan.is_empty:
            worker = self.tier_worker
            if worker is not None:
                worker.before_forward(plan)
            sampled = self.executor.execute(plan)
            result = worker.after_forward(plan) if worker is not None else None
            self.in_flight.append((plan, sampled, result))
        if self.in_flight and (len(self.in_flight) >= self.depth or not plan.num_scheduled_tokens):
            self.collect(*self.in_flight.popleft())
        return plan

    def collect(self, plan: SchedulerOutput, sampled: list[list[int]], transfers=None) -> None:
        if plan.num_draft_slots:
            counts = [len(tokens) for tokens in sampled]
            flat = [t for tokens in sampled for t in tokens]
            num_drafts = self.executor.num_drafts.pop(plan.step_id)
            outcome = StepOutcome(flat, counts, num_drafts, transfers or NO_TRANSFERS)
        else:
            outcome = StepOutcome([t for [t] in sampled], transfers=transfers or NO_TRANSFERS)
        outcome.pooled = self.executor.pooled.pop(plan.step_id, [])
        for owner_outputs in self.scheduler.update_from_output(plan, outcome).values():
            self._record(owner_outputs)

    def _record(self, out: OwnerOutputs) -> None:
        for rid, token in zip(out.req_ids, out.new_token_ids, strict=True):
            assert rid not in self.finish_reasons, f"token for {rid} after it finished"
            self.tokens.setdefault(rid, []).append(token)
        for rid in out.pooled:
            assert rid not in self.tokens and rid not in self.pooled, f"{rid} pooled twice"
        self.pooled.update(out.pooled)
        self.finish_reasons.update(out.finished)

    def run(self, max_steps: int = 100_000) -> None:
        while self.scheduler.has_unfinished_requests() or self.in_flight:
            assert self.num_steps < max_steps, "no progress: the scheduler is stuck"
            self.step()
