"""A fake worker side for the scheduler's KV connector seam, beside the stand-in
executor: the real connectors decide what to save, load and hold (the host tier's
HostTierConnector; a prefill replica's PrefillConnector, whose hand-offs' blocks a
decode side reads under a lease; a decode replica's DecodeConnector, whose loads read
a prefill side's blocks), and this plays the executor's copies with the faults a real
transfer has (loads that finish late, fail and leave garbage, or are aborted mid-way;
leases that end late), plus a host tier that sometimes asks for time and sometimes
delays freeing (a transfer still reading the blocks).

Every copy moves the stand-in's KV entries (token, position), so a block reused while
a load still writes it, a slot evicted while a load reads it, or a block freed while a
send (or a lease) reads it changes tokens or trips an assertion."""

import random
from dataclasses import dataclass

from flagstop.scheduler_svc.core.host_tier_connector import HostTierConnector
from flagstop.scheduler_svc.core.kv_connector import KVHandoff, KVTransferResult
from flagstop.scheduler_svc.core.output import SchedulerOutput
from flagstop.scheduler_svc.core.request import Request
from tests.helpers.hash_model import HashModelExecutor

GARBAGE = (-1, -1)  # what a failed load leaves in a block


class FlakyHostTier(HostTierConnector):
    """The real host tier, except that a lookup sometimes asks for time (None) and a
    finished request's blocks are sometimes still read by a transfer."""

    def __init__(self, num_host_blocks: int, block_size: int, rng: random.Random,
                 defer_rate: float, delayed_free_rate: float,
                 num_groups: int = 1) -> None:  # fmt: skip
        super().__init__(num_host_blocks, block_size, num_groups)
        self.rng, self.defer_rate, self.delayed_free_rate = rng, defer_rate, delayed_free_rate
        self.deferred_ids: set[str] = set()

    def reset(self, num_host_blocks: int) -> None:
        super().reset(num_host_blocks)
        self.sending: list[tuple[str, list[int]]] = []  # (request id, blocks it reads)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        if self.rng.random() < self.defer_rate:
            self.deferred_ids.add(request.request_id)
            return None
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(self, request: Request, block_ids: list[int]) -> KVHandoff | None:
        if not block_ids or self.rng.random() >= self.delayed_free_rate:
            return None
        # A transfer id no request id equals: the request's id may come back meanwhile.
        transfer_id = f"{request.request_id}:send"
        self.sending.append((transfer_id, list(block_ids)))
        return KVHandoff(transfer_id)


@dataclass(slots=True)
class _Transfer:
    steps_left: int
    req_id: str
    block_ids: list[int]
    contents: list[list]  # per block: the entries copied (a load) or expected (a send)
    source_ids: list[int]
    fails: bool = False
    remote: bool = False  # from a prefill replica's blocks (which never change)


def prefill_side_blocks(tokens: list[int], block_size: int) -> list[list]:
    """The KV a prefill replica computed for tokens, block by block (its last block's
    slots past them hold nothing)."""
    entries = [(token, pos, 0) for pos, token in enumerate(tokens)]
    entries += [None] * (-len(entries) % block_size)
    return [entries[i : i + block_size] for i in range(0, len(entries), block_size)]


class FakeTierWorker:
    def __init__(self, executor: HashModelExecutor, connector, rng: random.Random,
                 fail_rate: float, max_delay: int) -> None:  # fmt: skip
        """connector: the scheduler's (a FlakyHostTier's delayed frees are played
        here too)."""
        self.executor, self.connector, self.rng = executor, connector, rng
        self.fail_rate, self.max_delay = fail_rate, max_delay
        self.store: dict[int, list] = {}  # slot -> the block's entries
        # A prefill replica's blocks, by hand-off: what a decode replica's loads read.
        self.remote: dict[str, list[list]] = {}
        self.read_transfers: set[str] = set()
        self.loads: list[_Transfer] = []
        self.sends: list[_Transfer] = []

    def _block(self, block_id: int) -> list:
        bs = self.executor.block_size
        return self.executor.kv[block_id * bs : (block_id + 1) * bs]

    def before_forward(self, plan: SchedulerOutput) -> None:
        """Loads read their sources now (as the real copy thread starts at once); a
        prefill replica's hand-offs are held under a lease that ends some steps on."""
        meta = plan.kv_connector
        held = [(s.transfer_id, s.block_ids) for s in meta.sends] if meta else []
        for transfer_id, block_ids in [*getattr(self.connector, "sending", ()), *held]:
            contents = [self._block(b) for b in block_ids]
            self.sends.append(_Transfer(self._delay(), transfer_id, block_ids, contents, []))
        if hasattr(self.connector, "sending"):
            self.connector.sending = []
        for load in meta.loads if meta else ():
            if load.endpoint:  # a decode replica reads a hand-off once, or lets it go
                assert load.transfer_id not in self.read_transfers, "a hand-off read twice"
                self.read_transfers.add(load.transfer_id)
                if not load.block_ids:
                    continue
            contents = [list(self._source(load, source)) for source in load.source_ids]
            fails = self.rng.random() < self.fail_rate
            transfer = _Transfer(self._delay(), load.req_id, load.block_ids, contents,
                                 load.source_ids, fails, bool(load.endpoint))  # fmt: skip
            self.loads.append(transfer)

    def _source(self, load, source_id: int) -> list:
        if load.endpoint:
            return self.remote[load.transfer_id][source_id]
        return self.store[source_id]

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
                assert load.remote or self.store[slot] == content, (
                    f"slot {slot} reused while a load read it"
                )
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
