"""KV events on the wire, in vLLM's format (docs/llm-d.md), so that a fleet's router
(llm-d's endpoint picker, Dynamo's) indexes this pool as it indexes a vLLM pod's.

- Live: a ZMQ PUB socket sends `[topic, seq (8 bytes, big-endian), payload]`, the
  payload a msgspec-encoded `EventBatch [ts, events]`, each event a tagged positional
  array (`["BlockStored", hashes, parent, tokens, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, sliding_window]`,
  `["BlockRemoved", hashes, medium, group_idx]`, `["AllBlocksCleared"]`).
- Replay: a ROUTER socket answers a subscriber that missed a range: it sends an
  8-byte start seq and gets back `[seq, payload]` for each batch still buffered from
  there (the last `buffer_steps`), then `[-1, b""]`.
- Heartbeat: an idle publisher sends an empty batch every second, so a subscriber
  tells silence from loss.

The core's KVEventLog gathers the events, already vLLM's structs; the scheduler's
loop calls `flush` after each step (one step still runs on the executor meanwhile),
the heartbeat task once a second. The null publisher (events off) hands
the core the null log and sends nothing."""

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import deque
from typing import Any

import msgspec
import pydantic
import zmq
import zmq.asyncio

from flagstop.scheduler_svc.core import kv_events as core

log = logging.getLogger("flagstop.scheduler")
HEARTBEAT_S = 1.0
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVEventsConfig(pydantic.BaseModel):
    """vLLM's --kv-events-config, the fields flagstop reads (the rest are refused)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    enable_kv_cache_events: bool = True
    publisher: str = pydantic.Field("zmq", pattern="^zmq$")
    # Loopback unless told otherwise; Kubernetes binds tcp://*:5557 (deploy/llm-d/).
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = "tcp://127.0.0.1:5558"
    buffer_steps: int = pydantic.Field(10_000, ge=1)
    hwm: int = pydantic.Field(100_000, ge=0)
    # ${VAR} from the environment (POD_IP), ${MODEL} the served model's name.
    topic: str = "kv@${POD_IP}@${MODEL}"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, model: str) -> None:
        self.log = core.KVEventLog()
        self.topic = expand_topic(config.topic, model).encode()
        # PUB sends from the step loop and never blocks (past its high-water mark it
        # drops, and the subscriber replays): a plain socket. Replay is awaited.
        self.pub_context, self.context = zmq.Context(), zmq.asyncio.Context()
        self.pub = self.pub_context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, config.hwm)
        self.pub.bind(config.endpoint)
        self.replay = None
        if config.replay_endpoint:
            self.replay = self.context.socket(zmq.ROUTER)
            self.replay.bind(config.replay_endpoint)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.seq, self.last_sent = 0, time.monotonic()
        self.encoder = msgspec.msgpack.Encoder()
        self.task: asyncio.Task | None = None
        log.info("KV events on %s (replay %s), topic %s", config.endpoint,
                 config.replay_endpoint, self.topic.decode())  # fmt: skip

    def flush(self) -> None:
        """Send the events the core gathered since the last flush, as one batch."""
        if events := self.log.take():
            self._send(events)

    def _send(self, events: list[core.KVEvent]) -> None:
        payload = self.encoder.encode(EventBatch(time.time(), events))
        seq = self.seq.to_bytes(8, "big")
        with contextlib.suppress(zmq.Again):  # past the high-water mark: replayed on demand
            self.pub.send_multipart([self.topic, seq, payload], flags=zmq.NOBLOCK)
        self.buffer.append((self.seq, payload))
        self.seq += 1
        self.last_sent = time.monotonic()

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        """Replay requests as they come; events gathered between steps within a second;
        a heartbeat once a second of silence (waited for exactly: a fixed one-second
        poll let up to two seconds pass between beats)."""
        while True:
            wait = max(0.0, self.last_sent + HEARTBEAT_S - time.monotonic())
            if self.replay is not None and await self.replay.poll(int(wait * 1000)):
                await self._answer(await self.replay.recv_multipart())
            elif self.replay is None:
                await asyncio.sleep(wait)
            self.flush()
            if time.monotonic() - self.last_sent >= HEARTBEAT_S:
                self._send([])

    async def _answer(self, frames: list[bytes]) -> None:
        """[identity, (empty,) start seq]: every buffered batch from start on."""
        identity, start = frames[0], int.from_bytes(frames[-1], "big") if frames[-1] else 0
        delimiter = [b""] if len(frames) > 2 else []
        for seq, payload in list(self.buffer):
            if seq >= start:
                await self.replay.send_multipart([identity, *delimiter, seq.to_bytes(8, "big"),
                                                  payload])  # fmt: skip
        await self.replay.send_multipart([identity, *delimiter, END_OF_REPLAY, b""])

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.context.destroy(linger=0)
        self.pub_context.destroy(linger=0)


class NoKVEventPublisher:
    log = core.NO_KV_EVENTS

    def flush(self) -> None:
        pass

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


NO_KV_EVENT_PUBLISHER = NoKVEventPublisher()


def kv_event_publisher(config: KVEventsConfig | None, model: str):
    if config is None or not config.enable_kv_cache_events:
        return NO_KV_EVENT_PUBLISHER
    return KVEventPublisher(config, model)


def expand_topic(topic: str, model: str) -> str:
    """${MODEL}: the served model; ${POD_IP} or another ${VAR}: the environment's
    (POD_IP defaults to this host's name)."""
    env = {"POD_IP": socket.gethostname(), **os.environ, "MODEL": model}
    for name, value in env.items():
        topic = topic.replace("${" + name + "}", value)
    return topic
