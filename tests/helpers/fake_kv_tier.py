"""A fake worker side for the scheduler's KV connector seam, beside the stand-in
executor: the real HostTierConnector decides what to save and load, and this plays the
executor's copies with the faults a real transfer has (loads that finish late, fail
and leave garbage, or are aborted mid-way), plus a connector that sometimes asks for
time and sometimes delays freeing (a transfer still reading the blocks).

Every copy moves the stand-in's KV entries (token, position), so a block reused while
a load still writes it, a slot evicted while a load reads it, or a block freed while a
send reads it changes tokens or trips an assertion."""

import random
from dataclasses import dataclass

from flagstop.scheduler_svc.core.host_tier import HostTierConnector
from flagstop.scheduler_svc.core.kv_connector import KVTransferResult
from flagstop.scheduler_svc.core.output import SchedulerOutput
from flagstop.scheduler_svc.core.request import Request
from tests.helpers.hash_model import HashModelExecutor

GARBAGE = (-1, -1)  # what a failed load leaves in a block


class FlakyHostTier(HostTierConnector):
    """The real host tier, except that a lookup sometimes asks for time (None) and a
    finished request's blocks are sometimes still read by a transfer."""

    def __init__(self, num_slots: int, block_size: int, rng: random.Random,
                 defer_rate: float, delayed_free_rate: float) -> None:  # fmt: skip
        super().__init__(num_slots, block_size)
        self.rng, self.defer_rate, self.delayed_free_rate = rng, defer_rate, delayed_free_rate
        self.deferred_ids: set[str] = set()

    def reset(self, num_slots: int) -> None:
        super().reset(num_slots)
        self.sending: list[tuple[str, list[int]]] = []  # (request id, blocks it reads)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        if self.rng.random() < self.defer_rate:
            self.deferred_ids.add(request.request_id)
            return None
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        if not block_ids or self.rng.random() >= self.delayed_free_rate:
            return False
        self.sending.append((request.request_id, list(block_ids)))
        return True


@dataclass(slots=True)
class _Transfer:
    steps_left: int
    req_id: str
    block_ids: list[int]
    contents: list[list]  # per block: the entries copied (a load) or expected (a send)
    source_ids: list[int]
    fails: bool = False


class FakeTierWorker:
    def __init__(self, executor: HashModelExecutor, connector: FlakyHostTier,
                 rng: random.Random, fail_rate: float, max_delay: int) -> None:  # fmt: skip
        self.executor, self.connector, self.rng = executor, connector, rng
        self.fail_rate, self.max_delay = fail_rate, max_delay
        self.store: dict[int, list] = {}  # slot -> the block's entries
        self.loads: list[_Transfer] = []
        self.sends: list[_Transfer] = []

    def _block(self, block_id: int) -> list:
        bs = self.executor.block_size
        return self.executor.kv[block_id * bs : (block_id + 1) * bs]

    def before_forward(self, plan: SchedulerOutput) -> None:
        """Loads read their sources now (as the real copy thread starts at once)."""
        for req_id, block_ids in self.connector.sending:
            contents = [self._block(b) for b in block_ids]
            self.sends.append(_Transfer(self._delay(), req_id, block_ids, contents, []))
        self.connector.sending = []
        meta = plan.kv_connector
        for load in meta.loads if meta else ():
            contents = [list(self.store[slot]) for slot in load.source_ids]
            fails = self.rng.random() < self.fail_rate
            transfer = _Transfer(self._delay(), load.req_id, load.block_ids, contents,
                                 load.source_ids, fails)  # fmt: skip
            self.loads.append(transfer)

    def after_forward(self, plan: SchedulerOutput) -> KVTransferResult:
        """Saves copy this step's computed blocks out; transfers whose time came end."""
        meta = plan.kv_connector
        if meta:
            for block_id, slot in zip(meta.save_block_ids, meta.save_slots, strict=True):
                self.store[slot] = self._block(block_id)
        recved, failed = self._tick_loads()
        return KVTransferResult(recved, failed, self._tick_sends())

    def _tick_loads(self) -> tuple[list[str], list[str]]:
        recved, failed = [], []
        bs = self.executor.block_size
        due, self.loads = _due(self.loads)
        for load in due:
            for slot, content in zip(load.source_ids, load.contents, strict=True):
                assert self.store[slot] == content, f"slot {slot} reused while a load read it"
            for block_id, content in zip(load.block_ids, load.contents, strict=True):
                entries = [GARBAGE] * bs if load.fails else content
                self.executor.kv[block_id * bs : (block_id + 1) * bs] = entries
            (failed if load.fails else recved).append(load.req_id)
        return recved, failed

    def _tick_sends(self) -> list[str]:
        due, self.sends = _due(self.sends)
        for send in due:
            for block_id, content in zip(send.block_ids, send.contents, strict=True):
                assert self._block(block_id) == content, f"block {block_id} reused mid-send"
        return [send.req_id for send in due]

    def _delay(self) -> int:
        return self.rng.randint(1, self.max_delay)


def _due(transfers: list[_Transfer]) -> tuple[list[_Transfer], list[_Transfer]]:
    """One step older: (those whose time came, the rest)."""
    for transfer in transfers:
        transfer.steps_left -= 1
    return ([t for t in transfers if t.steps_left <= 0],
            [t for t in transfers if t.steps_left > 0])  # fmt: skip
