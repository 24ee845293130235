"""A request as the scheduler tracks it, its status and why it finished."""

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flagstop.scheduler_svc.core.kv_handoff import KVHandoff
from flagstop.scheduler_svc.core.media import MediaPlaceholder
from flagstop.scheduler_svc.core.objectives import NO_OBJECTIVES, Objectives


def stop_token_ids(
    stop_token_ids: Iterable[int], eos_token_ids: Iterable[int], ignore_eos: bool
) -> frozenset[int]:
    """The tokens that end a request: its own stop tokens, and EOS unless ignore_eos."""
    return frozenset(stop_token_ids) | (frozenset() if ignore_eos else frozenset(eos_token_ids))


class RequestStatus(enum.IntEnum):
    WAITING = 0
    # Its KV is arriving from a connector (a host tier, a prefill replica): it holds
    # its blocks, in the scheduler's `loading` queue, until the load is reported done.
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7
    # Handed off (prefill/decode disaggregation): the prompt is computed here, its
    # decode goes on at another replica, which reads its blocks.
    FINISHED_TRANSFERRED = 8

    is_finished: bool  # set on each member below


# A plain attribute of each member: read per sampled token, it costs a third of a
# property (38 vs 114 ns).
for _status in RequestStatus:
    _status.is_finished = _status >= RequestStatus.FINISHED_STOPPED

# The members by their own names, for the core's loops (a module global, not an
# attribute lookup a request).
WAITING, WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS
RUNNING, PREEMPTED = RequestStatus.RUNNING, RequestStatus.PREEMPTED
FINISHED_STOPPED, FINISHED_LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH
FINISHED_ERROR = RequestStatus.FINISHED_ERROR
FINISHED_TRANSFERRED = RequestStatus.FINISHED_TRANSFERRED


class FinishReason(enum.IntEnum):
    """Why a request ended: the one vocabulary of every layer. The values are those of
    the protos' RequestFinish and FinishReason (a test holds them equal), and `label`
    is the name in metrics, spans, the client and the OpenAI API."""

    STOP = 1  # EOS, a stop token or a stop string
    LENGTH = 2  # max_tokens or max_model_len
    ABORT = 3
    ERROR = 4
    TRANSFER = 5  # handed off to a decode replica (disaggregation)

    @property
    def label(self) -> str:
        return self.name.lower()


FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_TRANSFERRED: FinishReason.TRANSFER,
}


# A new request's acceptance estimate per draft token, before any of its drafts was
# verified (speculative.py keeps it up to date).
SPEC_PRIOR_ACCEPTANCE = 0.8


@dataclass(frozen=True, slots=True)
class Retention:
    """What a request asks of its prefix's KV once it ends (docs/sessions.md): keep
    the cached blocks of its first num_tokens past their LRU turn, at a priority
    (1-100: higher is evicted later), for ttl_s seconds (the scheduler's clock)."""

    priority: int
    ttl_s: float
    num_tokens: int = 0


# A retention's num_tokens over every block the request cached, its output's too (a
# session's next turn resends them).
ALL_TOKENS = 1 << 30


@dataclass(slots=True, frozen=True)
class StopParams:
    # None: until the engine's max_model_len.
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    owner: str
    prompt_token_ids: list[int]
    stop: StopParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = 0.0
    # Opaque to the scheduler: forwarded to the executor with the request's first step.
    sampling_params: Any = None
    # Client labels (e.g. tenant), for the scheduling policy.
    labels: dict[str, str] = field(default_factory=dict)
    # Its TTFT and TPOT targets, tenant and class (the SLO and fair policies').
    objectives: Objectives = NO_OBJECTIVES
    # Prompt logprobs come out of the prefill's logits, which a cached prefix never
    # computes: such a request recomputes its whole prompt (its blocks still fill the
    # cache for others).
    skip_prefix_cache: bool = False
    # The LoRA adapter it runs ("": the base model): by name for the --max-loras rule
    # and the executor's slots, by identity (the digest of its files) for the prefix
    # cache, whose hashes start from it: a name loaded again from other files never
    # hits the KV the old ones computed.
    lora_name: str = ""
    lora_id: str = ""
    # Speculative decoding: the request's own cap on draft tokens a step (None: the
    # engine's), and its measured acceptance per draft token (speculative.py).
    num_speculative_tokens: int | None = None
    spec_acceptance: float = field(default=SPEC_PRIOR_ACCEPTANCE)
    # Prefill/decode disaggregation. On a prefill replica: end after the first token
    # and hand the decode off (kv_handoff: where its blocks wait). On a decode
    # replica: where its prompt's KV waits, until its load is planned.
    do_remote_decode: bool = False
    kv_handoff: KVHandoff | None = None
    remote_prefill: KVHandoff | None = None
    # A pooling request (an embedding, a score, a class: docs/pooling.md) is prefill
    # only: at its prompt's end the executor pools its hidden states instead of
    # sampling, and it ends there, its blocks cached as any prompt's.
    pools: bool = False
    # Its images (media.py), by prompt position: their hashes key its blocks, and the
    # encoder cache computes their embeddings before a chunk reaches them.
    media: tuple[MediaPlaceholder, ...] = ()
    # Opaque to the core: their pixels, which a new executor is sent again.
    media_data: Any = ()
    # Its prefix's retention once it ends (None: ordinary LRU), and the salt its block
    # hashes start from ("": shared with every request of its adapter).
    retention: Retention | None = None
    cache_salt: str = ""
    # The agent session it is a turn of ("": none): the policy's to read.
    session_id: str = ""
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    # Derived once at admission for the per-token stop check: length at which the
    # request ends (max_tokens or max_model_len) and the ids that stop it.
    max_num_tokens: int = field(init=False, default=0)
    stop_ids: frozenset[int] = field(init=False, default=frozenset())
    num_computed_tokens: int = 0
    # Tokens sampled by steps still in flight (async scheduling): they count as known
    # to the executor but not yet to us.
    num_output_placeholders: int = 0
    num_preemptions: int = 0
    # When its first output token came back (the scheduler's clock; 0: not yet).
    first_token_time: float = 0.0
    num_cached_tokens: int = -1
    # Tokens past its local prefix hits that a connector is loading (while
    # WAITING_FOR_REMOTE_KVS), and of those, the ones that arrived (the prefix stats').
    num_external_tokens: int = 0
    num_loaded_tokens: int = 0
    # Chained hashes of the full blocks of known tokens, kept up to date by the
    # KVCacheManager (which owns the block size).
    block_hashes: list[bytes] = field(default_factory=list)
    # The KVCacheManager's too: positions the request may compute up to with no call
    # to it (slots allocated, no block to cache before them), so that the loop's
    # decodes skip the call: 15 of 16 steps of a decode (bench/scheduler_bench.py);
    # 0: call it.
    num_ready_kv_slots: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Its known tokens and those steps in flight will sample (vLLM's name: with
        drafts, the optimistic count the scheduler plans against)."""
        return len(self.all_token_ids) + self.num_output_placeholders

    def set_limits(self, max_model_len: int) -> None:
        """Derived once at admission for the per-token stop check: the length at which
        it ends (max_tokens or max_model_len) and the ids that stop it."""
        stop = self.stop
        self.max_num_tokens = max_model_len
        if stop.max_tokens is not None:
            self.max_num_tokens = min(self.num_prompt_tokens + stop.max_tokens, max_model_len)
        if self.pools:  # its prompt, all of it: it ends there whatever the limits
            self.max_num_tokens = self.num_prompt_tokens + 1
        self.stop_ids = stop_token_ids(stop.stop_token_ids, self.eos_token_ids, stop.ignore_eos)
        if self.num_speculative_tokens is not None:
            self.num_speculative_tokens = max(0, self.num_speculative_tokens)

    def resume_status(self) -> "RequestStatus":
        """The waiting status it goes back to: PREEMPTED once it ran, else WAITING."""
        return PREEMPTED if self.num_preemptions else WAITING

    def sort_key(self) -> tuple[int, float, str]:
        return (self.priority, self.arrival_time, self.request_id)
