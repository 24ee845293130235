"""A fleet router's view of one pool, from its KV events: the cached block hashes on
the GPU (the pool) and on the CPU (the host tier), each event checked for the shape
vLLM's subscribers rely on."""

from flagstop.scheduler_svc.core.kv_events import (
    CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)


class KVEventSubscriber:
    def __init__(self) -> None:
        self.cached: set[bytes] = set()
        self.host: set[bytes] = set()

    def apply(self, events) -> None:
        for event in events:
            match event:
                case BlockStored():
                    held, hashes = self._held(event.medium), event.block_hashes
                    if event.medium != CPU:  # the host tier's are announced without tokens
                        assert len(event.token_ids) == len(hashes) * event.block_size
                    assert event.extra_keys is None or len(event.extra_keys) == len(hashes)
                    assert not held & set(hashes), "a block stored twice"
                    held |= set(hashes)
                case BlockRemoved():
                    held = self._held(event.medium)
                    assert set(event.block_hashes) <= held, "an unknown block removed"
                    held -= set(event.block_hashes)
                case AllBlocksCleared():
                    self.cached.clear()
                    self.host.clear()

    def _held(self, medium: str) -> set[bytes]:
        return self.host if medium == CPU else self.cached
