"""The torch backend's attention kernels (the CPU path, and the oracle of the Triton
kernels in triton_attention.py), and the backend's module: its experts (torch_moe.py),
LoRA products (torch_lora.py) and quantized linears (torch_quant.py) are read through
it, as the Triton backend's are through triton_attention; its `mla` module runs
latent attention (torch_mla.py).

Cache layout, per layer: k_cache and v_cache of kv_cache_shape() = [num_blocks,
num_kv_heads, block_size, head_dim], head-major inside a block. A token at position p
of a request lives at offset p % block_size of block block_table[p // block_size]
(its slot: block * block_size + offset). Head-major, because then one index_select of
(block, head) tiles lands in the [seq, head, token, dim] layout that SDPA's CPU kernels
read fastest, with no transpose (10-30 % of the decode attention, at 64-256 decodes).
"""

import itertools
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from flagstop.kernels import torch_gdn
from flagstop.kernels import torch_mla as mla  # noqa: F401 (the backend's latent attention)
from flagstop.kernels.torch_lora import lora_add  # noqa: F401 (the backend's LoRA products)
from flagstop.kernels.torch_moe import (  # noqa: F401 (the backend's experts)
    fused_moe,
    grouped_experts,
    local_expert_ids,
    sort_by_expert,
)
from flagstop.kernels.torch_quant import (  # noqa: F401 (the backend's quantized linears)
    dequantize_int4,
    dequantize_w8,
    fp8_to_float,
    int4_linear,
    w8_linear,
)
from flagstop.utils import cdiv


def gdn():
    """The backend's gated delta rule (kernels/torch_gdn.py)."""
    return torch_gdn


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    return (num_blocks, num_kv_heads, block_size, head_dim)


class _Workspace(threading.local):
    """Gather buffers kept between layers and steps. A fresh multi-MB tensor per layer
    is a fresh mmap: its page faults cost more than the copy itself (tiny model, 64
    decodes at 128 tokens: 15.5 -> 9.6 ms a step). Grown by a quarter beyond the need,
    so that contexts growing a block at a time rarely reallocate. Thread-local: what
    one call returns is only valid until the next gather of that name in that thread."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        key, numel = (name, like.dtype, like.device), math.prod(shape)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            # A normal tensor even when made under inference_mode: one made there could
            # not be written outside it.
            with torch.inference_mode(False):
                buffer = torch.empty(numel + numel // 4, dtype=like.dtype, device=like.device)
            self.buffers[key] = buffer
        return buffer[:numel].view(shape)


_workspace = _Workspace()


class _StepMemo(threading.local):
    """Index tensors derived from a step's metadata, kept for its other layers: every
    layer passes the very same metadata tensors, and deriving them again costs about
    ten small ops a layer (0.2 ms of a 4-layer step at 16 decodes). Keyed by identity;
    holding the source tensors keeps their ids from being reused. So a caller must not
    change a metadata tensor in place between calls (prepare_inputs makes fresh ones
    each step)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[tuple, object]] = {}

    def get(self, name: str, sources: tuple, derive):
        """derive(*sources), or what it gave last time for these very sources."""
        entry = self.entries.get(name)
        if entry is None or not all(map(_same, entry[0], sources)):
            entry = self.entries[name] = (sources, derive(*sources))
        return entry[1]


def _same(a, b) -> bool:
    return a is b or (type(a) is int and a == b)


_memo = _StepMemo()


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] into the caches; slot -1 = padding."""
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    valid, rows = _memo.get("store", (slot_mapping, num_kv_heads, block_size), cache_rows)
    if valid is not None:
        key, value = key[valid], value[valid]
    for new, cache in ((key, k_cache), (value, v_cache)):
        new = new.reshape(-1, head_dim).to(cache.dtype)
        _bytes(cache).view(-1, head_dim).index_copy_(0, rows, _bytes(new))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as its bytes: torch's CPU index_copy_ and index_select have no
    float8 kernels; any other tensor as itself."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def cache_rows(
    slot_mapping: torch.Tensor, num_kv_heads: int, block_size: int
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the valid tokens' mask, or None when all are; the row of each valid (token,
    head) in the cache seen as [num_blocks * num_kv_heads * block_size, head_dim])."""
    valid = slot_mapping >= 0
    if bool(valid.all()):
        valid = None
    else:
        slot_mapping = slot_mapping[valid]
    slots = slot_mapping.long()
    heads = torch.arange(num_kv_heads, device=slots.device)
    tiles = (slots // block_size)[:, None] * num_kv_heads + heads
    return valid, (tiles * block_size + (slots % block_size)[:, None]).flatten()


def tile_ids(block_tables: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """The (block, head) tiles of each sequence's first num_blocks blocks, in [seq,
    head, block] order; padding (-1) reads block 0, which the caller masks."""
    blocks = block_tables[:, :num_blocks].long().clamp(min=0)
    heads = torch.arange(num_kv_heads, device=blocks.device)
    return (blocks[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()


def gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, max_len: int, into: str | None = None
) -> torch.Tensor:
    """[num_seqs, num_kv_heads, max_len, head_dim] read through the block tables; into
    the workspace buffer of that name if given (valid until its next use, and the tile
    ids kept for the step's other layers), else fresh."""
    _, num_kv_heads, block_size, head_dim = cache.shape
    num_seqs, num_blocks = block_tables.shape[0], cdiv(max_len, block_size)
    sources = (block_tables, num_kv_heads, num_blocks)
    ids = tile_ids(*sources) if into is None else _memo.get(into, sources, tile_ids)
    tiles = _bytes(cache).view(-1, block_size, head_dim)
    out = None if into is None else _workspace.take(into, (len(ids), block_size, head_dim), tiles)
    # index_select: about twice as fast as advanced indexing on the CPU.
    gathered = torch.index_select(tiles, 0, ids, out=out)
    if cache.dtype == torch.float8_e4m3fn:  # the values, in float32
        gathered = fp8_to_float(gathered.view(torch.float8_e4m3fn))
    return gathered.view(num_seqs, num_kv_heads, -1, head_dim)[:, :, :max_len]


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query token per sequence, attending to its seq_len cached tokens (its own
    included; with a window, the last window of them). query [num_seqs, num_heads,
    head_dim] -> same shape. sinks [num_heads]: learned logits that join each head's
    softmax denominator (gpt-oss); softcap: scores capped as cap * tanh(s / cap)
    (Gemma 2).

    A batch gathers every sequence to the longest one's length, so sequences sorted by
    length (the model runner sorts them) run in a few groups of similar lengths. Small
    model, 16 decodes at 17-529 tokens: 64 ms in one group (what 16 at 529 cost), 58 ms
    in groups, 47 ms were they all at their mean length."""
    if window or sinks is not None or softcap:
        return _masked_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, window,
                              sinks, softcap)  # fmt: skip
    groups = _memo.get("groups", (block_tables, seq_lens), length_groups)
    if len(groups) == 1:
        return _decode_group(query, k_cache, v_cache, *groups[0][1:], scale, 0)
    out = torch.empty_like(query)
    for i, (start, *group) in enumerate(groups):
        end = start + len(group[1])
        out[start:end] = _decode_group(query[start:end], k_cache, v_cache, *group, scale, i)
    return out


def length_groups(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_groups: int = 4
) -> list[tuple[int, torch.Tensor, torch.Tensor, int]]:
    """(first row, block tables, seq lens, longest) of each group: runs of ascending
    lengths split where that saves at least a tenth of the gathered tokens (each group
    costs three more kernel calls a layer); one group if the lengths are not sorted."""
    lens = seq_lens.cpu().numpy()
    bounds = [0, len(lens)]
    if len(lens) > 1 and bool((lens[1:] >= lens[:-1]).all()):
        while len(bounds) <= max_groups and (cut := _best_cut(lens, bounds)) is not None:
            bounds = sorted([*bounds, cut])
    return [
        (start, block_tables[start:end], seq_lens[start:end], int(lens[end - 1]))
        for start, end in itertools.pairwise(bounds)
    ]


def _best_cut(lens, bounds: list[int]) -> int | None:
    """The row to split a group at that saves the most gathered tokens, if enough."""
    total = sum((end - start) * int(lens[end - 1]) for start, end in itertools.pairwise(bounds))
    best, best_saving = None, 0.1 * total
    for start, end in itertools.pairwise(bounds):
        cuts = np.arange(start + 1, end)
        if len(cuts) == 0:
            continue
        savings = (cuts - start) * (int(lens[end - 1]) - lens[cuts - 1])
        i = int(savings.argmax())
        if savings[i] > best_saving:
            best, best_saving = int(cuts[i]), float(savings[i])
    return best


def _decode_group(query, k_cache, v_cache, block_tables, seq_lens, max_len, scale, group):
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    k = gather_kv(k_cache, block_tables, max_len, f"decode_k{group}")
    v = gather_kv(v_cache, block_tables, max_len, f"decode_v{group}")
    visible = _memo.get(f"visible{group}", (seq_lens, max_len), _visible)
    # The query heads that share a KV head are that head's queries, one per row: each
    # K/V tile is read once for all of them (SDPA's enable_gqa reads it per head).
    grouped = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped.float(), k.float(), v.float(), attn_mask=visible, scale=scale
    )
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def _visible(seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """[num_seqs, 1, 1, max_len]: which of the gathered keys each sequence has."""
    positions = torch.arange(max_len, device=seq_lens.device)
    return (positions[None, :] < seq_lens[:, None])[:, None, None, :]


def paged_attention_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention: sequence i's queries are query[query_start_loc[i]:
    query_start_loc[i+1]], the LAST tokens of its seq_lens[i] cached tokens (earlier
    ones are cached context: chunked prefill, prefix hits). query [T, H, D] -> same.
    window, sinks and softcap: as paged_attention_decode's; key_limits [T]: each
    query's last visible key position, where not its own (an image's tokens see the
    whole image: AttentionMetadata's).

    Short queries after a context (speculative decoding's 1 + k verification rows, a
    short last chunk) attend together in one batched call (_short_queries); the rest
    one sequence at a time."""
    if window or sinks is not None or softcap or key_limits is not None:
        return _masked_prefill(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                               scale, window, sinks, softcap, key_limits)  # fmt: skip
    out = torch.empty_like(query)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    plan = _memo.get("short", (query_start_loc, seq_lens), short_queries)
    if plan is not None:
        _attend_short(query, k_cache, v_cache, block_tables, plan, scale, out)
    for i, seq_len in enumerate(lens):
        if plan is not None and i in plan.members:
            continue
        start, end = starts[i], starts[i + 1]
        num_context = seq_len - (end - start)
        k = gather_kv(k_cache, block_tables[i : i + 1], seq_len, "prefill_k")
        v = gather_kv(v_cache, block_tables[i : i + 1], seq_len, "prefill_v")
        # 4-D inputs: SDPA's fused CPU kernels only take batched ones (about 4x faster).
        out[start:end] = (
            F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1)[None].float(),
                k.float(),
                v.float(),
                attn_mask=_causal_mask(num_context, seq_len, query.device),
                is_causal=num_context == 0,
                scale=scale,
                enable_gqa=True,
            )[0]
            .transpose(0, 1)
            .to(query.dtype)
        )
    return out


# Queries this short (after a cached context) attend batched: a draft verification's
# 1 + k rows. Measured on the tiny model, 64 verifying requests at k = 3: one call
# instead of 64 per layer.
SHORT_QUERY = 8


@dataclass(slots=True)
class ShortQueries:
    """Which sequences attend batched, and the index tensors to do it."""

    members: set[int]  # their indices among the step's prefill sequences
    rows: torch.Tensor  # their query rows, flattened in order
    max_len: int  # the longest of their sequences
    seqs: torch.Tensor  # members, as a tensor
    row_index: torch.Tensor  # [S, longest query]: query rows, padded by repeating the last
    visible: torch.Tensor  # [S, longest query, max_len]: the keys each query sees
    valid: torch.Tensor  # [S, longest query]: which of row_index are real


def short_queries(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> ShortQueries | None:
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    members = [
        i for i, seq_len in enumerate(lens)
        if (n := starts[i + 1] - starts[i]) <= SHORT_QUERY and seq_len > n
    ]  # fmt: skip
    if len(members) < 2:
        return None
    device = seq_lens.device
    n = torch.tensor([starts[i + 1] - starts[i] for i in members], device=device)
    first = torch.tensor([starts[i] for i in members], device=device)
    length = torch.tensor([lens[i] for i in members], device=device)
    max_n, max_len = int(n.max()), max(lens[i] for i in members)
    j = torch.arange(max_n, device=device)
    # Padded rows repeat a sequence's last query (and are dropped afterwards).
    row_index = first[:, None] + torch.minimum(j[None, :], n[:, None] - 1)
    valid = j[None, :] < n[:, None]
    # Query j of a sequence sits at position len - n + j and sees keys 0 .. that.
    last_key = (length - n)[:, None] + torch.minimum(j[None, :], n[:, None] - 1)
    visible = torch.arange(max_len, device=device)[None, None, :] <= last_key[:, :, None]
    seqs = torch.tensor(members, device=device)
    return ShortQueries(set(members), row_index[valid], max_len, seqs, row_index,
                        visible, valid)  # fmt: skip


def _attend_short(query, k_cache, v_cache, block_tables, plan: ShortQueries, scale, out) -> None:
    num_seqs, max_n = plan.row_index.shape
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    tables = block_tables[plan.seqs]
    k = gather_kv(k_cache, tables, plan.max_len, "short_k")
    v = gather_kv(v_cache, tables, plan.max_len, "short_v")
    # [S, n, H, D] -> [S, KV heads, group x n, D]: a KV head's query heads, row by row.
    q = query[plan.row_index].view(num_seqs, max_n, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group * max_n, head_dim)
    mask = plan.visible[:, None, None].expand(num_seqs, 1, group, max_n, plan.max_len)
    attended = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(),
        attn_mask=mask.reshape(num_seqs, 1, group * max_n, plan.max_len), scale=scale,
    )  # fmt: skip
    attended = attended.view(num_seqs, num_kv_heads, group, max_n, head_dim)
    attended = attended.permute(0, 3, 1, 2, 4).reshape(num_seqs, max_n, num_heads, head_dim)
    out[plan.rows] = attended[plan.valid].to(query.dtype)


def _causal_mask(num_context: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """Query j (at position num_context + j) sees keys 0..num_context + j. None without
    context: SDPA's own is_causal is the same mask and takes the fast kernels."""
    if num_context == 0:
        return None
    key_pos = torch.arange(seq_len, device=device)
    query_pos = torch.arange(num_context, seq_len, device=device)
    return key_pos[None, :] <= query_pos[:, None]


# -- windows and sinks ---------------------------------------------------------------
# Layers with a sliding window or attention sinks (Mistral, Qwen2's upper layers,
# gpt-oss, Gemma 3's local layers) take these: the keys a query sees are a band, and a
# sink is one more logit in the softmax that has no value (transformers' eager
# attention for gpt-oss concatenates it to the scores, softmaxes, and drops it). So
# the mask is explicit, and with sinks the scores are too (SDPA has no place for them).


def _masked_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, window, sinks,
                   softcap):  # fmt: skip
    max_len = int(seq_lens.max())
    k = gather_kv(k_cache, block_tables, max_len)
    v = gather_kv(v_cache, block_tables, max_len)
    last = (seq_lens.long() - 1)[:, None]  # each query's position
    visible = _band(last, torch.arange(max_len, device=query.device)[None, :], window)
    out = _attend(query[:, :, None], k, v, visible[:, None, :], scale, sinks, softcap)
    return out[:, :, 0].to(query.dtype)


def _masked_prefill(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                    window, sinks, softcap, key_limits=None):  # fmt: skip
    out = torch.empty_like(query)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        k = gather_kv(k_cache, block_tables[i : i + 1], seq_len)
        v = gather_kv(v_cache, block_tables[i : i + 1], seq_len)
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        key_pos = torch.arange(seq_len, device=query.device)
        limits = query_pos if key_limits is None else key_limits[start:end].long()
        visible = _band(query_pos[:, None], key_pos[None], window, limits[:, None])
        q = query[start:end].transpose(0, 1)[None]  # [1, H, n, D]
        out[start:end] = _attend(q, k, v, visible[None], scale, sinks, softcap)[0].transpose(0, 1)
    return out


def _band(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int,
          limits: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Which keys each query sees: causal (up to its limit, where one is given), and
    within the window (if any): key > q - W."""
    visible = key_pos <= (query_pos if limits is None else limits)
    return visible & (key_pos > query_pos - window) if window else visible


def _attend(q, k, v, visible, scale: float, sinks: torch.Tensor | None, softcap: float = 0.0):
    """q [S, H, Q, D], k/v [S, KVH, L, D], visible [S, Q, L] -> [S, H, Q, D] float32."""
    if sinks is None and not softcap:
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                              attn_mask=visible[:, None], scale=scale,
                                              enable_gqa=True)  # fmt: skip
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    if softcap:  # before the mask, as transformers' eager Gemma 2 attention
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), -1), dim=-1)[..., :-1]
    return probs @ v
