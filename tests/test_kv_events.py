"""KV events in-process (docs/llm-d.md): the core's log of what the prefix cache
gains and loses, and its encoding in vLLM's wire format. The Hypothesis state machine
(tests/test_scheduler_state_machine.py) holds a subscriber's view equal to the pool's
after every step of its random schedules; the stack test does it over ZMQ."""

import msgspec

from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
)
from flagstop.scheduler_svc.core.kv_groups import FULL_ATTENTION, KVCacheGroup
from flagstop.scheduler_svc.core.media import MediaPlaceholder
from flagstop.scheduler_svc.core.output import StepOutcome
from flagstop.scheduler_svc.core.request import Request, StopParams
from flagstop.scheduler_svc.core.scheduler import Scheduler
from flagstop.scheduler_svc.kv_event_publisher import EventBatch, expand_topic
from tests.helpers.kv_events import KVEventSubscriber

BLOCK = 4


def engine(num_blocks: int = 16, **fields) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64,
                             block_size=BLOCK, **fields)  # fmt: skip
    return Scheduler(config, num_blocks, kv_events=KVEventLog())


def run(scheduler: Scheduler, *requests: Request) -> list:
    for r in requests:
        scheduler.add_request(r)
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, StepOutcome([7] * len(plan.sampling_requests)))
    return scheduler.kv_events.take()


def request(rid: str, prompt: list[int], max_tokens: int = 1, **fields) -> Request:
    return Request(rid, "r", prompt, StopParams(max_tokens, ignore_eos=True), **fields)


def test_a_prompts_blocks_are_stored_once_with_their_tokens_and_chain():
    scheduler = engine()
    [stored] = run(scheduler, request("a", list(range(1, 11))))
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == list(range(1, 9)) and stored.block_size == BLOCK
    assert len(stored.block_hashes) == 2  # the two full blocks of its 10 (+1) tokens
    assert stored.parent_block_hash is None and stored.extra_keys is None
    # The same prefix again: a hit, nothing new but its own third block.
    [again] = run(scheduler, request("b", [*range(1, 11), 11, 12]))
    assert again.parent_block_hash == stored.block_hashes[-1] and again.token_ids == [9, 10, 11, 12]


def test_evictions_are_removals_and_a_reset_clears_everything():
    scheduler, subscriber = engine(num_blocks=4), KVEventSubscriber()
    for i in range(4):  # each prompt takes the whole pool: the one before is evicted
        subscriber.apply(run(scheduler, request(f"r{i}", [i * 100 + t for t in range(12)])))
        assert subscriber.cached == set(scheduler.kv.pool.cached_blocks)
    scheduler.reset_executor()
    events = scheduler.kv_events.take()
    assert isinstance(events[0], AllBlocksCleared)
    subscriber.apply(events)
    assert subscriber.cached == set() == set(scheduler.kv.pool.cached_blocks)


def test_a_salt_and_images_are_the_extra_keys_of_their_blocks():
    image = MediaPlaceholder(b"\x01" * 32, 2, 4, (1, 2, 2))
    images = dict(max_num_encoder_input_tokens=16, encoder_cache_size=16)
    [stored] = run(engine(**images), request("a", list(range(1, 13)), cache_salt="acme",
                                     media=(image,)))  # fmt: skip
    assert stored.extra_keys == [("acme", image.hash.hex()), (image.hash.hex(),), None]


def test_consecutive_removals_share_an_event():
    log = KVEventLog()
    log.removed(b"a" * 32)
    log.removed(b"b" * 32)
    log.removed(b"c" * 32 + b"\x01")  # group 1: its own event
    assert log.take() == [BlockRemoved([b"a" * 32, b"b" * 32], "GPU", 0),
                          BlockRemoved([b"c" * 32 + b"\x01"], "GPU", 1)]  # fmt: skip


def test_the_wire_is_vllms_positional_tagged_arrays():
    """The log's events encode as they are: each group's kind and window from the
    groups the manager described (a second, windowed group here)."""
    scheduler = engine(max_loras=1)
    scheduler.kv_events.describe([KVCacheGroup(FULL_ATTENTION, 0, (0,)),
                                  KVCacheGroup(FULL_ATTENTION, 128, (1,))])  # fmt: skip
    [stored] = run(scheduler, request("a", list(range(1, 6)), lora_name="adapter", lora_id="d1",
                                      cache_salt="s"))  # fmt: skip
    log = scheduler.kv_events
    log.offloaded(b"h" * 32 + b"\x01", BLOCK)
    log.removed(b"h" * 32)
    log.cleared()
    payload = msgspec.msgpack.encode(EventBatch(1.5, [stored, *log.take()]))
    ts, wire = msgspec.msgpack.decode(payload)
    assert ts == 1.5
    assert wire[0] == ["BlockStored", stored.block_hashes, None, [1, 2, 3, 4], BLOCK, None,
                       "GPU", "adapter", [["s"]], 0, "full_attention", None]  # fmt: skip
    assert wire[1] == ["BlockStored", [b"h" * 32 + b"\x01"], None, [], BLOCK, None, "CPU", None,
                       None, 1, "sliding_window", 128]  # fmt: skip
    assert wire[2] == ["BlockRemoved", [b"h" * 32], "GPU", 0]
    assert wire[3] == ["AllBlocksCleared"]
    assert expand_topic("kv@${POD_IP}@${MODEL}", "m").endswith("@m")


def test_host_tier_blocks_are_announced_as_cpu_without_tokens():
    log = KVEventLog()
    log.offloaded(b"a" * 32, 16)
    log.offloaded(b"b" * 32, 16)
    log.removed(b"a" * 32, "CPU")
    log.removed(b"c" * 32)  # the pool's: its own event
    stored, removed, evicted = log.take()
    assert (stored.block_hashes, stored.token_ids, stored.medium) == ([b"a" * 32, b"b" * 32], [],
                                                                      "CPU")  # fmt: skip
    assert (removed.medium, evicted.medium) == ("CPU", "GPU")
