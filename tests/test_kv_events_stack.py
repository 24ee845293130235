"""KV events from a real scheduler (docs/llm-d.md): a ZMQ subscriber decoding vLLM's
wire format rebuilds exactly the prefix cache's blocks through prefix hits, salts and
eviction; sequence numbers run without a gap or repeat; an idle publisher beats once
a second; a missed range replays; an executor's restart clears everything."""

import json
import random
import threading
import time

import httpx
import msgspec
import pytest
import zmq

from tests.helpers.images import data_url, drawn
from tools.make_vision_model import write_vision_model
from tools.stack import free_port, generate, start_stack

pytestmark = pytest.mark.processes


class Subscriber(threading.Thread):
    """A fleet router's side: every frame on the topic, in arrival order."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.frames: list[tuple[bytes, int, list]] = []
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.socket.connect(endpoint)
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            if self.socket.poll(100):
                topic, seq, payload = self.socket.recv_multipart()
                _, events = msgspec.msgpack.decode(payload)
                self.frames.append((topic, int.from_bytes(seq, "big"), events))

    def catch_up(self, endpoint: str) -> None:
        """What was published before the first live frame, from the replay socket
        (vLLM's subscriber procedure: buffer live, replay the gap, go on)."""
        first = self.frames[0][1]
        missed = [(b"", seq, events) for seq, events in replay(endpoint, 0) if seq < first]
        self.frames[:0] = missed

    def cached(self, medium: str = "GPU") -> set[bytes]:
        """The blocks held on a medium (the pool's GPU, the host tier's CPU)."""
        held: set[bytes] = set()
        for _, _, events in self.frames:
            for event in events:
                if event[0] == "BlockStored" and event[6] == medium:
                    if medium == "GPU":  # the host tier's announcements carry no tokens
                        assert len(event[3]) == len(event[1]) * event[4]  # tokens, block size
                    held |= set(event[1])
                elif event[0] == "BlockRemoved" and event[2] == medium:
                    assert set(event[1]) <= held
                    held -= set(event[1])
                elif event[0] == "AllBlocksCleared":
                    held.clear()
        return held

    def stored(self) -> list[list]:
        return [e for _, _, events in self.frames for e in events if e[0] == "BlockStored"]

    def wait(self, predicate, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "no such frame in time"
            time.sleep(0.05)

    def close(self) -> None:
        self.stopped.set()
        self.join(5)
        self.context.destroy(linger=0)


def replay(endpoint: str, start: int) -> list[tuple[int, list]]:
    """Every batch still buffered from start on, as (seq, events), to the end marker."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send(start.to_bytes(8, "big"))
    batches = []
    try:
        while True:
            assert dealer.poll(5000), "no replay"
            seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return batches
            batches.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)[1]))
    finally:
        dealer.close(linger=0)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(3, 500) for _ in range(n)]


def subscribed_stack(model_dir, tmp_path, executor_args: list[str]):
    """A stack publishing KV events, a subscriber caught up on it, the replay endpoint."""
    pub, replay = free_port(), free_port()
    config = {"endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}",
              "topic": "kv@pod-a@${MODEL}"}  # fmt: skip
    stack = start_stack(model_dir, tmp_path, executor_args=executor_args,
                        scheduler_args=["--kv-events-config", json.dumps(config)])  # fmt: skip
    subscriber = Subscriber(f"tcp://127.0.0.1:{pub}")
    subscriber.start()
    subscriber.wait(lambda: subscriber.frames)  # a heartbeat: connected
    subscriber.catch_up(f"tcp://127.0.0.1:{replay}")
    return stack, subscriber, f"tcp://127.0.0.1:{replay}"


@pytest.fixture
def events_stack(model_dir, tmp_path):
    stack, subscriber, replay_endpoint = subscribed_stack(model_dir, tmp_path,
                                                          ["--num-blocks", "24"])  # fmt: skip
    yield stack, subscriber, replay_endpoint
    subscriber.close()
    stack.stop()


def test_a_subscriber_rebuilds_the_prefix_cache_and_misses_nothing(events_stack):
    stack, subscriber, replay_endpoint = events_stack
    shared = tokens(1, 100)
    generate(stack, prompt_token_ids=shared, max_tokens=4)
    generate(stack, prompt_token_ids=[*shared, 7, 8], max_tokens=4)  # a prefix hit
    generate(stack, prompt_token_ids=shared, max_tokens=4, cache_salt="acme")
    for i in range(4):  # filler past the 24-block pool: evictions
        generate(stack, prompt_token_ids=tokens(10 + i, 150), max_tokens=2)
    held = stack.wait_idle().num_cached_blocks
    subscriber.wait(lambda: len(subscriber.cached()) == held)
    frames = subscriber.frames
    assert {topic for topic, _, _ in frames} <= {b"kv@pod-a@flagstop-tiny", b""}
    seqs = [seq for _, seq, _ in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap, no repeat
    kinds = {event[0] for _, _, events in frames for event in events}
    assert {"BlockStored", "BlockRemoved"} <= kinds
    stored = subscriber.stored()
    assert any(e[8] and e[8][0] == ["acme"] for e in stored if len(e) > 8)  # the salt
    # Medium, group, the group's kind: a full-attention model's one group.
    assert all(e[6] == "GPU" and e[9] == 0 and e[10] == "full_attention" for e in stored)

    # A missed range replays, batch for batch, then the end marker.
    live = [(seq, events) for _, seq, events in frames]
    assert replay(replay_endpoint, seqs[0])[: len(live)] == live

    # Idle: a heartbeat (an empty batch) once a second of silence.
    count = len(subscriber.frames)
    time.sleep(3)
    idle = subscriber.frames[count:]
    assert len(idle) >= 2 and all(events == [] for _, _, events in idle)


def test_an_executors_restart_clears_every_block(events_stack):
    stack, subscriber, _ = events_stack
    generate(stack, prompt_token_ids=tokens(3, 100), max_tokens=2)
    subscriber.wait(lambda: subscriber.cached())
    stack.kill("executor")
    stack.restart("executor")
    subscriber.wait(lambda: any(e == ["AllBlocksCleared"] for _, _, events in subscriber.frames
                                for e in events))  # fmt: skip
    generate(stack, prompt_token_ids=tokens(4, 100), max_tokens=2, timeout=120)
    held = stack.wait_idle(timeout=60).num_cached_blocks
    subscriber.wait(lambda: len(subscriber.cached()) == held)


def test_image_and_salted_blocks_carry_their_keys_and_the_host_tier_its_medium(tmp_path):
    """A vision model with a host tier: the blocks of a salted image prompt carry the
    salt (the first block) and the image's hash (each block its placeholder overlaps),
    the same hash the render route gives llm-d's picker; their tokens are the rendered
    prompt's; each full block is announced again on the host tier (medium CPU, no
    tokens), and both media rebuild exactly what the scheduler holds."""
    model = write_vision_model(tmp_path / "flagstop-tiny-qwen2_5_vl")
    stack, subscriber, _ = subscribed_stack(model, tmp_path, [
        "--num-blocks", "64", "--kv-offload-bytes", str(64 << 20)])  # fmt: skip
    try:
        words = "A continuous batching server keeps the accelerator busy at every step. " * 2
        body = {"model": "flagstop-tiny-qwen2_5_vl", "max_tokens": 2, "cache_salt": "acme",
                "messages": [{"role": "user", "content": [
                    {"type": "text", "text": words},
                    {"type": "image_url", "image_url": {"url": data_url(drawn(5))}},
                    {"type": "text", "text": " What is it?"}]}]}  # fmt: skip
        rendered = httpx.post(f"{stack.base_url}/chat/completions/render", json=body,
                              timeout=60).json()  # fmt: skip
        [image_hash] = rendered["features"]["mm_hashes"]["image"]
        [span] = rendered["features"]["mm_placeholders"]["image"]
        assert httpx.post(f"{stack.base_url}/chat/completions", json=body,
                          timeout=60).status_code == 200  # fmt: skip
        stats = stack.wait_idle()
        subscriber.wait(
            lambda: (
                len(subscriber.cached()) == stats.num_cached_blocks
                and len(subscriber.cached("CPU")) == stats.num_host_cached_blocks
            )
        )
        [event] = [e for e in subscriber.stored() if e[6] == "GPU" and e[2] is None]
        block_size, token_ids = event[4], rendered["token_ids"]
        assert event[3] == token_ids[: len(event[3])]  # the rendered prompt's full blocks
        for i, keys in enumerate(event[8]):
            start, end = i * block_size, (i + 1) * block_size
            over_image = span["offset"] < end and span["offset"] + span["length"] > start
            expected = (["acme"] if i == 0 else []) + ([image_hash] if over_image else [])
            assert (keys or []) == expected, i
        host = [e for e in subscriber.stored() if e[6] == "CPU"]
        assert host and all(e[3] == [] for e in host)
        assert set(event[1]) <= subscriber.cached("CPU")  # written through to the host
    finally:
        subscriber.close()
        stack.stop()
