"""Every Triton kernel against its torch twin: under TRITON_INTERPRET=1 on a CPU, on
the device when a GPU is present."""

import pytest
import torch

from flagstop.executor.models.quant_formats import pack_int4
from flagstop.executor.models.quantization import ActScheme
from flagstop.kernels import (
    torch_attention,
    torch_quant,
    triton_attention,
    triton_moe,
    triton_quant,
)
from flagstop.utils import cdiv

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SHAPES = [
    (num_kv_heads * group, num_kv_heads, head_dim, block_size)
    for group, num_kv_heads in ((1, 2), (2, 2), (4, 1), (8, 1))
    for head_dim in (64, 128)
    for block_size in (16, 32)
]
SHAPE_IDS = [f"h{h}-kv{k}-d{d}-bs{b}" for h, k, d, b in SHAPES]


def make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0):
    """In the Triton kernels' layout; head_major() gives the torch twins' copy."""
    g = torch.Generator().manual_seed(seed)
    shape = triton_attention.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.randn(shape, generator=g).to(DEVICE, dtype),
            torch.randn(shape, generator=g).to(DEVICE, dtype))  # fmt: skip


def head_major(*caches: torch.Tensor) -> list[torch.Tensor]:
    """[blocks, block_size, kv_heads, dim] -> the torch backend's [blocks, kv_heads,
    block_size, dim]."""
    return [cache.transpose(1, 2).contiguous() for cache in caches]


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Seeded: a case that passes passes every run (fp16 sits near its tolerance)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def block_tables(seq_lens: list[int], block_size: int, num_blocks: int, seed=0) -> torch.Tensor:
    """Each sequence gets its own blocks, scattered over the pool; padding is -1."""
    g = torch.Generator().manual_seed(seed)
    needed = [cdiv(n, block_size) for n in seq_lens]
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(seq_lens), max(needed)), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(needed):
        table[i, :n] = torch.tensor(order[start : start + n], dtype=torch.int32)
        start += n
    return table.to(DEVICE)


def assert_close(got, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), SHAPES[:4])
def test_store_kv(num_heads, num_kv_heads, head_dim, block_size, dtype):
    k_tri, v_tri = make_caches(6, block_size, num_kv_heads, head_dim, dtype)
    k_ref, v_ref = head_major(k_tri, v_tri)
    key = randn(5, num_kv_heads, head_dim, dtype=dtype)
    value = randn(5, num_kv_heads, head_dim, dtype=dtype, seed=1)
    slots = torch.tensor([0, block_size - 1, -1, block_size, 5 * block_size + 3], device=DEVICE)
    torch_attention.store_kv(key, value, k_ref, v_ref, slots)
    triton_attention.store_kv(key, value, k_tri, v_tri, slots)
    assert all(map(torch.equal, head_major(k_tri, v_tri), (k_ref, v_ref)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"), SHAPES, ids=SHAPE_IDS
)
def test_paged_attention_decode(num_heads, num_kv_heads, head_dim, block_size, dtype, monkeypatch):
    # Ragged: 1 token, block boundaries, and (with a 64-token partition) split-K.
    seq_lens = [1, block_size, block_size + 1, 2 * block_size - 1, 150]
    monkeypatch.setattr(triton_attention, "DECODE_PARTITION", 64)
    num_blocks = sum(cdiv(n, block_size) for n in seq_lens) + 3
    k_cache, v_cache = make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = block_tables(seq_lens, block_size, num_blocks)
    query = randn(len(seq_lens), num_heads, head_dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = torch_attention.paged_attention_decode(
        query, *head_major(k_cache, v_cache), tables, lens, scale
    )
    got = triton_attention.paged_attention_decode(query, k_cache, v_cache, tables, lens, scale)
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("with_context", [False, True, "short"],
                         ids=["fresh", "cached-context", "short-after-context"])  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"), SHAPES, ids=SHAPE_IDS
)
def test_paged_attention_prefill(
    num_heads, num_kv_heads, head_dim, block_size, dtype, with_context
):
    # (new tokens, cached context): 1 token, block boundaries, a tile boundary (>16).
    shapes = [(1, 0), (block_size, 0), (17, 0), (block_size + 3, 0)]
    if with_context is True:
        shapes = [(1, 5), (block_size, block_size), (17, block_size - 1), (9, 2 * block_size + 1)]
    if with_context == "short":  # draft verification: batched in the torch reference
        shapes = [(4, 5), (1, block_size), (8, block_size - 1), (17, 3), (2, 2 * block_size + 1)]
    seq_lens = [q + c for q, c in shapes]
    num_blocks = sum(cdiv(n, block_size) for n in seq_lens) + 3
    k_cache, v_cache = make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = block_tables(seq_lens, block_size, num_blocks)
    starts = torch.tensor([0] + [q for q, _ in shapes], dtype=torch.int32).cumsum(0).to(torch.int32)
    query = randn(int(starts[-1]), num_heads, head_dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    starts, scale = starts.to(DEVICE), head_dim**-0.5
    expected = torch_attention.paged_attention_prefill(
        query, *head_major(k_cache, v_cache), tables, starts, lens, scale
    )
    got = triton_attention.paged_attention_prefill(
        query, k_cache, v_cache, tables, starts, lens, scale
    )
    assert_close(got, expected, dtype)


def _sinks(num_heads: int, with_sinks: bool) -> torch.Tensor | None:
    """Of both signs: gpt-oss' learned ones span about -4..4."""
    return randn(num_heads, dtype=torch.float32, seed=7) * 3 if with_sinks else None


def _null_before_window(tables: torch.Tensor, first_keys: list[int], block_size: int):
    """The blocks wholly before each sequence's first visible key as the null block 0,
    as a window group's table holds them."""
    tables = tables.clone()
    for i, first in enumerate(first_keys):
        tables[i, : max(0, first) // block_size] = 0
    return tables


BAND_SHAPES = [SHAPES[0], SHAPES[5], SHAPES[-2]]
# (window, sinks, soft cap): each alone, and together (the plain kernels have their own).
BANDS = [(37, False, 0.0), (20, False, 0.0), (0, True, 0.0), (0, False, 2.0), (37, True, 2.0)]
BAND_IDS = ["window37", "window20", "sinks", "capped", "all"]


@pytest.mark.parametrize(("window", "with_sinks", "softcap"), BANDS, ids=BAND_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), BAND_SHAPES)
def test_paged_attention_decode_in_a_window_with_sinks(
    num_heads, num_kv_heads, head_dim, block_size, dtype, window, with_sinks, softcap,
    monkeypatch,
):  # fmt: skip
    seq_lens = [1, block_size + 1, 40, 150]
    monkeypatch.setattr(triton_attention, "DECODE_PARTITION", 64)
    num_blocks = sum(cdiv(n, block_size) for n in seq_lens) + 3
    k_cache, v_cache = make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = block_tables(seq_lens, block_size, num_blocks)
    if window:
        tables = _null_before_window(tables, [n - window for n in seq_lens], block_size)
    sinks = _sinks(num_heads, with_sinks)
    # Not seed 0: the caches' first rows would be the queries, each peaked on its twin.
    query = randn(len(seq_lens), num_heads, head_dim, dtype=dtype, seed=3)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = torch_attention.paged_attention_decode(
        query, *head_major(k_cache, v_cache), tables, lens, scale, window, sinks, softcap
    )
    got = triton_attention.paged_attention_decode(
        query, k_cache, v_cache, tables, lens, scale, window, sinks, softcap
    )
    assert_close(got, expected, dtype)
    if window:  # the band matters: the plain kernel differs
        plain = torch_attention.paged_attention_decode(
            query, *head_major(k_cache, v_cache), tables, lens, scale, 0, sinks, softcap
        )
        assert not torch.allclose(plain[-1].float(), expected[-1].float(), atol=1e-2)


@pytest.mark.parametrize(("window", "with_sinks", "softcap"), BANDS, ids=BAND_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), BAND_SHAPES)
def test_paged_attention_prefill_in_a_window_with_sinks(
    num_heads, num_kv_heads, head_dim, block_size, dtype, window, with_sinks, softcap
):  # fmt: skip
    # (new tokens, cached context): fresh, chunks after long contexts, a 64-query tile.
    shapes = [(1, 5), (17, 0), (9, 2 * block_size + 1), (70, 45)]
    seq_lens = [q + c for q, c in shapes]
    num_blocks = sum(cdiv(n, block_size) for n in seq_lens) + 3
    k_cache, v_cache = make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = block_tables(seq_lens, block_size, num_blocks)
    if window:  # the first query's window starts at context - window + 1
        tables = _null_before_window(tables, [c - window + 1 for _, c in shapes], block_size)
    sinks = _sinks(num_heads, with_sinks)
    starts = torch.tensor([0] + [q for q, _ in shapes], dtype=torch.int32).cumsum(0).to(torch.int32)
    query = randn(int(starts[-1]), num_heads, head_dim, dtype=dtype, seed=3)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    starts, scale = starts.to(DEVICE), head_dim**-0.5
    expected = torch_attention.paged_attention_prefill(
        query, *head_major(k_cache, v_cache), tables, starts, lens, scale, window, sinks, softcap
    )
    got = triton_attention.paged_attention_prefill(
        query, k_cache, v_cache, tables, starts, lens, scale, window, sinks, softcap
    )
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_with_key_limits_lets_an_images_tokens_see_the_whole_image(window, dtype):
    """Gemma 3's bidirectional images: a query inside [a, b) sees keys up to b - 1. The
    torch twin against a mask written out here, and the Triton kernel against it."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    shapes = [(40, 0), (30, 21)]  # (new tokens, cached context)
    images = [(5, 17), (25, 45)]  # a [start, end) image span in each (positions)
    seq_lens = [q + c for q, c in shapes]
    num_blocks = sum(cdiv(n, block_size) for n in seq_lens) + 3
    k_cache, v_cache = make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = block_tables(seq_lens, block_size, num_blocks)
    starts = torch.tensor([0, 40, 70], dtype=torch.int32, device=DEVICE)
    query = randn(70, num_heads, head_dim, dtype=dtype, seed=4)
    limits = torch.cat([torch.arange(c, c + q) for q, c in shapes])
    for i, (a, b) in enumerate(images):
        first = int(starts[i]) - shapes[i][1]  # flat index of position 0
        limits[first + a : first + b] = b - 1
    limits = limits.to(DEVICE, torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = torch_attention.paged_attention_prefill(
        query, *head_major(k_cache, v_cache), tables, starts, lens, scale, window,
        key_limits=limits)  # fmt: skip
    k, v = (torch_attention.gather_kv(c, tables[1:2], seq_lens[1]) for c in
            head_major(k_cache, v_cache))  # fmt: skip
    q = query[40:70].transpose(0, 1)[None].float()
    pos, keys = torch.arange(21, 51, device=DEVICE)[:, None], torch.arange(51, device=DEVICE)
    mask = (keys <= limits[40:70, None].long()) & ((keys > pos - window) if window else True)
    own = torch.softmax(
        (q @ k.float().repeat_interleave(2, 1).transpose(-1, -2)) * scale
        + torch.where(mask, 0.0, float("-inf")),
        -1,
    ) @ v.float().repeat_interleave(2, 1)
    assert_close(expected[40:70], own[0].transpose(0, 1), dtype)
    got = triton_attention.paged_attention_prefill(
        query, k_cache, v_cache, tables, starts, lens, scale, window, key_limits=limits
    )
    assert_close(got, expected, dtype)


@pytest.mark.parametrize(
    "checkpoint", ["llama", "qwen2-moe", "qwen2-window", "gpt-oss", "gemma2", "deepseek-v3"]
)
def test_the_model_on_triton_kernels_matches_transformers(tmp_path, checkpoint):
    from flagstop.executor.config import ExecutorConfig
    from flagstop.executor.model_runner import ModelRunner
    from tests.helpers.checkpoints import assert_matches, load_reference, prompt, write_checkpoint
    from tests.helpers.executor_harness import Harness

    path = write_checkpoint(checkpoint, tmp_path / checkpoint)
    config = ExecutorConfig(
        model=str(path), num_blocks=64, block_size=16, attention_backend="triton",
        device=DEVICE, dtype="float32",
    )  # fmt: skip
    harness, reference = Harness(ModelRunner(config)), load_reference(path)
    assert harness.runner.attention_backend is triton_attention
    for layer in harness.runner.model.moe_blocks:  # the fused kernel, not oneDNN's
        assert layer.experts.fused is triton_moe.fused_moe and layer.experts.packed is None
    harness.add("a", prompt(1, 20))
    harness.add("b", prompt(2, 5))
    assert_matches(reference, harness, harness.logits({"a": 20, "b": 5}))
    # c's first block is a's: only its 3 own tokens are computed, beside two decodes.
    shared = harness.requests["a"].token_ids[:16]
    harness.add("c", [*shared, 5, 6, 7], shared_blocks=harness.prefix_blocks("a", 1))
    assert_matches(reference, harness, harness.logits({"a": 1, "b": 1, "c": 3}))


def test_the_torch_decode_in_length_groups_equals_one_sequence_at_a_time():
    # Sorted, spread lengths: the decode runs in several groups of similar lengths.
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    seq_lens = [1, 2, 3, 5, 9, 40, 41, 90, 300]
    num_blocks = sum(cdiv(n, block_size) for n in seq_lens) + 3
    k_cache, v_cache = head_major(*make_caches(num_blocks, block_size, num_kv_heads, head_dim,
                                               torch.float32))  # fmt: skip
    tables = block_tables(seq_lens, block_size, num_blocks)
    query = randn(len(seq_lens), num_heads, head_dim, dtype=torch.float32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    assert len(torch_attention.length_groups(tables, lens)) > 1
    assert len(torch_attention.length_groups(tables, lens.flip(0))) == 1  # unsorted: one group
    got = torch_attention.paged_attention_decode(query, k_cache, v_cache, tables, lens, 0.25)
    for i in range(len(seq_lens)):
        one = torch_attention.paged_attention_decode(
            query[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1], 0.25
        )
        torch.testing.assert_close(got[i], one[0], rtol=1e-5, atol=1e-5)


def test_short_queries_attend_batched_as_one_by_one(monkeypatch):
    """The torch reference's batched path for short queries after a context gives what
    attending one sequence at a time gives."""
    block_size, num_kv_heads, num_heads, head_dim = 4, 2, 4, 8
    shapes = [(4, 5), (1, 9), (8, 3), (3, 17), (2, 1)]
    seq_lens = [q + c for q, c in shapes]
    num_blocks = sum(cdiv(n, block_size) for n in seq_lens) + 3
    k_cache, v_cache = make_caches(num_blocks, block_size, num_kv_heads, head_dim, torch.float32)
    tables = block_tables(seq_lens, block_size, num_blocks)
    starts = torch.tensor([0] + [q for q, _ in shapes]).cumsum(0).to(torch.int32).to(DEVICE)
    query = randn(int(starts[-1]), num_heads, head_dim, dtype=torch.float32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    args = (query, *head_major(k_cache, v_cache), tables, starts, lens, head_dim**-0.5)
    batched = torch_attention.paged_attention_prefill(*args)
    assert torch_attention.short_queries(starts, lens) is not None
    monkeypatch.setattr(torch_attention, "SHORT_QUERY", 0)
    one_by_one = torch_attention.paged_attention_prefill(*[a.clone() for a in args[:-1]], args[-1])
    torch.testing.assert_close(batched, one_by_one, atol=1e-5, rtol=1e-5)


def routing(num_tokens: int, num_experts: int, top_k: int, skip: int | None, seed=0):
    """Random distinct top-k choices per token (never expert `skip`), and their
    softmax-like weights."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    if skip is not None:
        scores[:, skip] = -1.0
    weights, ids = scores.topk(top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(DEVICE), ids.to(DEVICE)


# (tokens, experts, top-k, first expert of this rank, an expert that gets no token)
MOE_SHAPES = [(1, 4, 1, 0, None), (7, 8, 2, 0, 5), (33, 8, 3, 0, 0), (70, 16, 4, 0, 9),
              (20, 4, 2, 2, 3)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "first", "skip"), MOE_SHAPES)
def test_fused_moe(num_tokens, num_experts, top_k, first, skip, dtype):
    hidden, inner = 96, 40  # neither a multiple of the kernel's blocks
    local = num_experts - first  # first > 0: this rank holds the last experts only
    x = randn(num_tokens, hidden, dtype=dtype)
    w13 = randn(local, 2 * inner, hidden, dtype=dtype, seed=1) / hidden**0.5
    w2 = randn(local, hidden, inner, dtype=dtype, seed=2) / inner**0.5
    weights, ids = routing(num_tokens, num_experts, top_k, skip)
    expected = torch_attention.fused_moe(x, w13, w2, weights, ids, first)
    got = triton_moe.fused_moe(x, w13, w2, weights, ids, first)
    assert_close(got, expected, dtype)
    if first:  # the tokens routed only to other ranks' experts add nothing here
        only_other = (ids < first).all(dim=1)
        assert only_other.any() and not got[only_other].any()


def test_align_by_expert_pads_each_experts_run_to_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)  # expert 3: no tokens
    sorted_ids, block_experts, num_padded = triton_moe.align_by_expert(ids, 0, 4, block_m=4)
    pad = ids.numel()
    assert int(num_padded) == 12  # three runs of one block each
    assert sorted_ids[:12].tolist() == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    assert block_experts[:4].tolist() == [0, 1, 2, -1]


def test_grouped_experts_equals_every_expert_on_every_token_masked():
    """The grouped CPU path against the dense definition of a sparse layer."""
    x = randn(9, 32, dtype=torch.float32)
    w13 = randn(6, 48, 32, dtype=torch.float32, seed=1)
    w2 = randn(6, 32, 24, dtype=torch.float32, seed=2)
    weights, ids = routing(9, 6, 2, skip=4)
    dense = torch.zeros_like(x)
    for e in range(6):
        gate, up = (x @ w13[e].T).chunk(2, dim=-1)
        chosen = (weights * (ids == e)).sum(-1, keepdim=True)
        dense += chosen * ((torch.nn.functional.silu(gate) * up) @ w2[e].T)
    torch.testing.assert_close(torch_attention.fused_moe(x, w13, w2, weights, ids), dense)


def quantized_weight(kind: str, rows: int, columns: int, group: int, seed: int = 0):
    """A weight in flagstop's quantized layout (quant_formats.py), seeded."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-columns // group)
    scale = torch.rand(rows, groups, generator=g) * 0.05 + 0.01
    if kind == "int4":
        values = torch.randint(0, 16, (rows, columns), generator=g, dtype=torch.uint8)
        zeros = torch.randint(0, 16, (rows, groups), generator=g, dtype=torch.uint8)
        return pack_int4(values).to(DEVICE), scale.to(DEVICE), zeros.to(DEVICE)
    if kind == "int8":
        weight = torch.randint(-128, 128, (rows, columns), generator=g, dtype=torch.int8)
    else:
        weight = (torch.randn(rows, columns, generator=g) * 100).to(torch.float8_e4m3fn)
    return weight.to(DEVICE), scale.to(DEVICE)


W8_CASES = [  # (weight kind, weight group, activations)
    ("fp8", 128, ActScheme("fp8", group=128)),  # FP8 block-scaled (Qwen3-FP8, DeepSeek)
    ("fp8", 256, ActScheme("fp8")),  # per channel, per token
    ("fp8", 256, ActScheme("fp8", static=True)),  # per tensor, static
    ("int8", 256, ActScheme("int8")),  # W8A8
    ("int8", 64, None),  # W8A16, groups
    ("fp8", 128, None),  # FP8 weight-only
]


@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize(("kind", "group", "act"), W8_CASES,
                         ids=[f"{k}-g{g}-{a and (a.kind + str(a.group) + 's' * a.static)}"
                              for k, g, a in W8_CASES])  # fmt: skip
def test_w8_linear(kind, group, act, num_tokens):
    weight, scale = quantized_weight(kind, 96, 256, group)
    x = randn(num_tokens, 256, dtype=torch.float32)
    bias = randn(96, dtype=torch.float32, seed=1)
    input_scale = torch.tensor([0.02], device=DEVICE)
    expected = torch_quant.w8_linear(x, weight, scale, act, input_scale, bias)
    got = triton_quant.w8_linear(x, weight, scale, act, input_scale, bias)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "group"), [(1, 128), (19, 64), (40, 256)])
def test_int4_linear(num_tokens, group, dtype):
    qweight, scales, zeros = quantized_weight("int4", 80, 256, group)
    x = randn(num_tokens, 256, dtype=dtype)
    expected = torch_quant.int4_linear(x, qweight, scales, zeros)
    got = triton_quant.int4_linear(x, qweight, scales, zeros)
    assert_close(got, expected, dtype)


def test_quantized_groups_a_block_step_would_straddle_run_the_torch_kernels():
    qweight, scales, zeros = quantized_weight("int4", 16, 48, 24)  # groups of 24 inputs
    x = randn(3, 48, dtype=torch.float32)
    got = triton_quant.int4_linear(x, qweight, scales, zeros)
    torch.testing.assert_close(got, torch_quant.int4_linear(x, qweight, scales, zeros))


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_on_an_fp8_cache_is_attention_on_its_values(backend, dtype):
    """An e4m3 cache read by either backend's kernels (decode and prefill, through
    attention.paged_attention's scaling) gives what the same kernels give on a cache in
    the model's dtype holding the dequantized values: only the storage differs."""
    from flagstop.executor.attention import AttentionMetadata, FP8Scales, paged_attention

    kernels = torch_attention if backend == "torch" else triton_attention
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    lens = [1, 1, 5, 40]  # two decodes, two prefills
    tables = block_tables(lens, block_size, 8)
    slots = [int(tables[i, p // block_size]) * block_size + p % block_size
             for i, n in enumerate(lens) for p in range(n)]  # fmt: skip
    starts = torch.tensor([0, 1, 2, 7, 47], dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(torch.tensor(slots, device=DEVICE), tables,
                             torch.tensor(lens, device=DEVICE), starts, 2)  # fmt: skip
    q = randn(47, num_heads, head_dim, dtype=dtype)
    k = randn(47, num_kv_heads, head_dim, dtype=dtype, seed=1)
    v = randn(47, num_kv_heads, head_dim, dtype=dtype, seed=2)
    kv_scale = torch.tensor([[0.01, 0.02], [0.015, 0.008]], device=DEVICE)
    shape = kernels.kv_cache_shape(8, block_size, num_kv_heads, head_dim)
    fp8 = [torch.zeros(shape, dtype=FP8, device=DEVICE) for _ in "kv"]
    scales = FP8Scales.of(kv_scale, num_heads)
    got = paged_attention(kernels, q, k, v, fp8, meta, head_dim**-0.5, scales)
    values = [((t.float() / s[None, :, None]).to(FP8).float() * s[None, :, None]).to(dtype)
              for t, s in ((k, kv_scale[0]), (v, kv_scale[1]))]  # fmt: skip
    plain = [torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in "kv"]
    expected = paged_attention(kernels, q, *values, plain, meta, head_dim**-0.5)
    assert_close(got, expected, dtype)
    # And against the exact cache: e4m3's 3 mantissa bits, ~3 % of the output's norm.
    exact = paged_attention(kernels, q, k, v, [torch.zeros_like(c) for c in plain], meta,
                            head_dim**-0.5)  # fmt: skip
    assert ((got.float() - exact.float()).norm() / exact.float().norm()) < 0.05


LORA_STEPS = {  # each token's slot (-1: the base model)
    "prefill": [2, -1, 0, 2, 3, *[0] * 11, -1, 3, 2],  # segments of 12, 3, 2: grouped
    "decode": [0, 1, 2, 3, 0, 1, -1, 2],  # short segments: batched in bmm's
}


@pytest.mark.parametrize("step", LORA_STEPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_sgmv_equals_the_torch_products(dtype, step):
    """Punica's segmented gather matmuls against the torch path (grouped by adapter
    for a prefill's long segments, batched for a decode's short ones): tokens of
    several slots and of none, interleaved as a batch's requests are, into a layer of
    three packed parts (q, k, v: 64, 32, 32 rows) at a padded rank 16 with one adapter
    of rank 8 (its other rows zero, as the slots hold them)."""
    import numpy as np

    from flagstop.executor.lora.mapping import LoRAMapping
    from flagstop.kernels import torch_lora, triton_lora

    slots, parts, rank, hidden = 4, [(0, 64), (64, 32), (96, 32)], 16, 96
    a = randn(slots, 3 * rank, hidden, dtype=dtype, seed=1) * 0.1
    b = randn(slots, 128, rank, dtype=dtype, seed=2) * 0.1
    a[2, 8:16], b[2, :, 8:] = 0, 0
    token_slots = np.array(LORA_STEPS[step], np.int64)
    mapping = LoRAMapping.of(token_slots, torch.device(DEVICE))
    assert (mapping.padded is not None) == (step == "decode")
    x = randn(len(token_slots), hidden, dtype=dtype, seed=3)
    base = randn(len(token_slots), 128, dtype=dtype, seed=4)
    expected, got = base.clone(), base.clone()
    torch_lora.lora_add(x, expected, a, b, parts, mapping)
    triton_lora.lora_add(x, got, a, b, parts, mapping)
    assert_close(got, expected, dtype)
    untouched = torch.from_numpy(token_slots < 0).to(DEVICE)
    assert torch.equal(got[untouched], base[untouched])  # the base model's tokens
    assert not torch.equal(got[~untouched], base[~untouched])


# -- the H200 compile check (tools/compile_sm90.py) ----------------------------------


def test_the_h200_compile_check_knows_every_kernel_and_adds_the_gpus_dtypes():
    """Each launched kernel has its roles (which arguments take the model's dtype and
    the KV cache's); a float32 launch gains the bf16 one a GPU makes (non-IEEE dots),
    and an attention kernel's the FP8-KV one; other arguments keep their types."""
    from tools.compile_sm90 import ROLES, variants
    from tools.kernel_launches import KERNEL_MODULES, Launch, launched_kernels

    for name in KERNEL_MODULES:
        kernels = {k.fn.__name__ for k in launched_kernels(name)}
        assert kernels and kernels <= ROLES.keys(), f"{name}: {kernels - ROLES.keys()}"
    signature = (("query", "*fp32"), ("k_cache", "*fp32"), ("v_cache", "*fp32"),
                 ("block_tables", "*i32"), ("out", "*fp32"), ("scale", "fp32"),
                 ("IEEE", "constexpr"))  # fmt: skip
    launch = Launch("triton_attention", "_prefill_kernel", signature, (("IEEE", True),), ())
    got = {variant: (dict(v.signature), dict(v.constexprs)) for variant, v in variants(launch)}
    assert got["as tested"] == (dict(launch.signature), {"IEEE": True})
    bf16, fp8 = got["bf16"][0], got["bf16, fp8 KV"][0]
    assert (bf16["query"], bf16["k_cache"], bf16["out"]) == ("*bf16", "*bf16", "*bf16")
    assert (fp8["query"], fp8["k_cache"], fp8["v_cache"]) == ("*bf16", "*fp8e4nv", "*fp8e4nv")
    assert bf16["block_tables"] == fp8["block_tables"] == "*i32" and bf16["scale"] == "fp32"
    assert got["bf16"][1] == {"IEEE": False}
