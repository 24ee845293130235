"""KV cache groups: the model's layers by attention type, as the block pool serves them.

The executor describes its layers (`KVLayer`); `kv_cache_groups` cuts them into groups
of one attention type and equal size (vLLM's hybrid KV cache manager): every group's
layers share the pool's block ids, so one block id is one page in each of
`group_size` KV tensors, and layer j of each group reads tensor j. A request holds a
block table per group; a full-attention group keeps every block, a sliding-window
group lets go of the blocks that left every query's window. So a model of 12 window
and 12 full layers needs a block per 16 tokens per group, each of 12 layers' bytes,
and its window layers hold a window's worth whatever the length, where one group of
24 layers would hold every token in every layer.

A recurrent (linear-attention) layer keeps no KV per token but one state per request
(Qwen3-Next's gated DeltaNet: a convolution window and a matrix per head). Its group
holds, in the block of a request's last computed token, the state after that token,
and in each full block it completed, the state at that block's end: a query at p
reads the state in p - 1's block, so for the pool the group is a window of 2 tokens
(vLLM's "align" mode). The blocks it let go of keep their hashes, so a later request
with the same prefix resumes from the state at the longest block boundary every
group still holds, and only there. The state lives in the block's page (the bytes a
full-attention layer's K and V of block_size tokens take: the executor sizes blocks
so that one state fits), so a request holds constant bytes in these layers.

Both sides build the groups from the same description with this one function, so the
scheduler's block ids and the executor's tensors agree by construction."""

from collections.abc import Sequence
from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
ATTENTION_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)  # a config's layer_types
# Multi-head latent attention (DeepSeek): every token kept, as full attention keeps them,
# but a block holds one latent per token instead of each KV head's key and value, so
# its layers are a group of their own (their bytes per token are not full attention's).
LATENT_ATTENTION = "latent_attention"
# A recurrent layer (transformers' layer_types name for Qwen3-Next's gated DeltaNet).
LINEAR_ATTENTION = "linear_attention"
KV_KINDS = (*ATTENTION_TYPES, LATENT_ATTENTION, LINEAR_ATTENTION)
# A recurrent group's window for the pool: the previous token's block and the query's.
RECURRENT_WINDOW = 2


@dataclass(slots=True, frozen=True)
class KVLayer:
    """One attention layer as its KV needs it: a query at position p of a window layer
    sees keys p - sliding_window + 1 .. p (transformers' and vLLM's convention);
    sinks: learned per-head logits that join the softmax (no KV of their own)."""

    attention: str = FULL_ATTENTION
    sliding_window: int = 0  # tokens a query sees, itself included; 0: all
    sinks: bool = False
    kv_bytes_per_token: int = 0  # K and V of this layer, one token, one rank (recurrent: 0)

    def __post_init__(self) -> None:
        if self.attention not in KV_KINDS:
            raise ValueError(f"attention type {self.attention!r}: one of {KV_KINDS}")
        if (self.attention == SLIDING_ATTENTION) != (self.sliding_window > 0):
            raise ValueError(
                f"a {self.attention} layer with sliding_window={self.sliding_window}: a "
                "sliding_attention layer needs a window > 0, a full_attention one none"
            )

    @property
    def kind(self) -> tuple[str, int]:
        return self.attention, self.sliding_window


@dataclass(slots=True, frozen=True)
class KVCacheGroup:
    """Layers of one attention type sharing a block table; layers[i] reads KV tensor i."""

    attention: str
    sliding_window: int
    layers: tuple[int, ...]

    @property
    def is_window(self) -> bool:
        return self.sliding_window > 0

    @property
    def is_recurrent(self) -> bool:
        return self.attention == LINEAR_ATTENTION

    @property
    def window(self) -> int:
        """The tokens before and at a query whose blocks it needs (0: every token)."""
        return RECURRENT_WINDOW if self.is_recurrent else self.sliding_window

    def describe(self) -> str:
        kind = f"window {self.sliding_window}" if self.is_window else self.attention.split("_")[0]
        return f"{kind} x{len(self.layers)}"


def kv_cache_groups(layers: Sequence[KVLayer]) -> list[KVCacheGroup]:
    """The groups of a model's layers: each attention type's layers, in order, in runs
    of the rarest type's count (a model of one type: one group of all its layers). A
    type whose count the rarest's does not divide leaves its last group short: its slots'
    pages go unused (vLLM pads the same way)."""
    if not layers:
        return [KVCacheGroup(FULL_ATTENTION, 0, ())]
    by_kind: dict[tuple[str, int], list[int]] = {}
    for index, layer in enumerate(layers):
        by_kind.setdefault(layer.kind, []).append(index)
    group_size = min(len(indices) for indices in by_kind.values())
    # Full attention first: the scheduler's fast paths read group 0's table length.
    kinds = sorted(by_kind, key=lambda kind: (kind[0] == LINEAR_ATTENTION, kind[1]))
    return [
        KVCacheGroup(attention, window, tuple(by_kind[(attention, window)][i : i + group_size]))
        for attention, window in kinds
        for i in range(0, len(by_kind[(attention, window)]), group_size)
    ]


def group_size(groups: Sequence[KVCacheGroup]) -> int:
    """KV tensors a block id spans: the largest group's layers."""
    return max(len(g.layers) for g in groups)


def layer_slots(groups: Sequence[KVCacheGroup], num_layers: int) -> list[tuple[int, int]]:
    """(group, tensor slot) of every layer."""
    slots = [(0, 0)] * num_layers
    for g, group in enumerate(groups):
        for slot, layer in enumerate(group.layers):
            slots[layer] = (g, slot)
    return slots


def group_key(g: int) -> bytes:
    """What a block's hash is suffixed with in group g's prefix-cache entries (and a
    host tier's): the same tokens are different KV in each group's layers. Group 0's
    is empty, so a model of one group keys its blocks by their hashes alone."""
    return bytes([g]) if g else b""


def describe_groups(groups: Sequence[KVCacheGroup]) -> str:
    """One line for logs and /v1/models: "full x12 + window 128 x12"."""
    return " + ".join(g.describe() for g in groups)
