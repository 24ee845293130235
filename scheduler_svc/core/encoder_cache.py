"""The encoder as a second budget of the step, and its cache (vLLM's
encoder_compute_budget and EncoderCacheManager): before a prefill chunk reaches an
image's placeholder tokens, the image's embeddings must be in the executor's encoder
cache or be computed this step within the encoder budget; else the chunk stops short
of the image. The cache holds embeddings by content hash, counted in embedding
tokens: an entry a running request still needs is never evicted; one no request
needs stays (a later prompt with the same image hits it) until room is needed, oldest
first. The executor holds the embeddings and follows the plan's encoder_inputs and
encoder_frees; this accounting is the one place that decides (docs/multimodal.md)."""

from collections import OrderedDict
from dataclasses import dataclass, field

from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.limits import RequestRejected
from flagstop.scheduler_svc.core.media import MediaPlaceholder
from flagstop.scheduler_svc.core.request import Request


@dataclass(slots=True)
class EncoderStats:
    num_encoded_items: int = 0  # images run through the encoder (planned)
    num_encoded_tokens: int = 0  # their embedding tokens
    num_cache_hits: int = 0  # images a chunk found cached (no encoder work)


class NoEncoder:
    """A text-only model's: no image ever reaches a chunk."""

    capacity = budget = 0
    num_used_tokens = 0
    stats = EncoderStats()

    def check(self, request: Request) -> None:
        if request.media:
            raise RequestRejected("this model reads no images; send text only, or serve "
                                  "a vision-language model")  # fmt: skip

    def chunk(self, request: Request, num_computed: int, num_new: int, step) -> int:
        return num_new

    def free(self, request: Request) -> None:
        pass

    def take_frees(self) -> list[bytes]:
        return []


@dataclass(slots=True)
class EncoderCache:
    capacity: int  # embedding tokens the executor's cache holds
    budget: int  # embedding tokens the encoder computes a step
    # The most tokens a chunk holds, where a chunk may not cut an image (0: it may):
    # Gemma 3's image tokens attend to each other both ways, so an image's tokens
    # still to compute go in one chunk.
    whole_items_within: int = 0
    num_free: int = 0
    # Every entry: its tokens; those no request needs, oldest first (evictable).
    entries: dict[bytes, int] = field(default_factory=dict)
    users: dict[bytes, set[str]] = field(default_factory=dict)
    unused: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    frees: list[bytes] = field(default_factory=list)  # evicted since the last plan
    stats: EncoderStats = field(default_factory=EncoderStats)

    def __post_init__(self) -> None:
        self.num_free = self.capacity

    @property
    def num_used_tokens(self) -> int:
        return self.capacity - self.num_free

    def check(self, request: Request) -> None:
        """At admission: an image larger than the step's encoder budget or the whole
        cache could never be computed."""
        limit = min(self.budget, self.capacity)
        for item in request.media:
            if item.length > limit:
                raise RequestRejected(
                    f"an image of {item.length} embedding tokens exceeds the encoder's "
                    f"{limit} a step (--max-num-encoder-input-tokens, "
                    "--encoder-cache-size); send a smaller image")  # fmt: skip
            if self.whole_items_within and item.length > self.whole_items_within:
                raise RequestRejected(
                    f"an image of {item.length} tokens, which this model computes in one "
                    f"chunk, exceeds a chunk's {self.whole_items_within} tokens "
                    "(--max-num-batched-tokens, --long-prefill-token-threshold)")  # fmt: skip

    def chunk(self, request: Request, num_computed: int, num_new: int, step) -> int:
        """num_new cut so that every image the chunk [num_computed, + num_new)
        reaches has its embeddings, cached or computed this step."""
        if not request.media:
            return num_new
        end = num_computed + num_new
        for item in request.media:
            if item.end <= num_computed:
                self._release(item.hash, request.request_id)  # past it: no longer needed
                continue
            if item.offset >= end:
                break
            if self.whole_items_within and end < item.end:  # it would cut the image
                return max(item.offset - num_computed, 0)
            if self._use(item.hash, request.request_id):
                continue
            if item.length > step.encoder_budget or not self._make_room(item.length):
                return max(item.offset - num_computed, 0)
            step.encoder_budget -= item.length
            step.encoder_inputs.append(item)
            self._add(item, request.request_id)
        return num_new

    def _use(self, key: bytes, request_id: str) -> bool:
        users = self.users.get(key)
        if users is None:
            return False
        if request_id not in users:
            if not users:
                self.unused.pop(key, None)
            self.stats.num_cache_hits += 1
            users.add(request_id)
        return True

    def _add(self, item: MediaPlaceholder, request_id: str) -> None:
        self.entries[item.hash] = item.length
        self.users[item.hash] = {request_id}
        self.num_free -= item.length
        self.stats.num_encoded_items += 1
        self.stats.num_encoded_tokens += item.length

    def _make_room(self, num_tokens: int) -> bool:
        while self.num_free < num_tokens and self.unused:
            key, _ = self.unused.popitem(last=False)
            self.num_free += self.entries.pop(key)
            del self.users[key]
            self.frees.append(key)
        return self.num_free >= num_tokens

    def _release(self, key: bytes, request_id: str) -> None:
        users = self.users.get(key)
        if users is not None and request_id in users:
            users.discard(request_id)
            if not users:
                self.unused[key] = None

    def free(self, request: Request) -> None:
        """A request ended or was preempted: it needs none of its images now."""
        for item in request.media:
            self._release(item.hash, request.request_id)

    def take_frees(self) -> list[bytes]:
        frees, self.frees = self.frees, []
        return frees


def encoder_cache(config: SchedulerConfig) -> EncoderCache | NoEncoder:
    """The scheduler's encoder component: none for a text-only model (budget 0)."""
    budget = config.max_num_encoder_input_tokens
    if budget <= 0:
        return NoEncoder()
    whole = 0
    if config.whole_images:
        whole = min(
            config.max_num_batched_tokens,
            config.long_prefill_token_threshold or config.max_num_batched_tokens,
        )
    return EncoderCache(config.encoder_cache_size, budget, whole)
