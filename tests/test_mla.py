"""Latent attention's torch path (kernels/torch_mla.py) on a paged latent cache: the
expanded prefill equals plain causal multi-head attention over the up-projected keys and
values, and the absorbed decode equals the expanded form, on random shapes, lengths and
scattered block tables."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flagstop.kernels import torch_mla

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)

BLOCK = 4


def dense_reference(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):
    """Causal attention of the last T of S positions with every head's K and V expanded."""
    num_queries, length = q_nope.shape[0], c.shape[0]
    k = torch.cat((torch.einsum("sr,hnr->shn", c, w_uk),
                   k_pe[:, None].expand(-1, w_uk.shape[0], -1)), -1)  # fmt: skip
    v = torch.einsum("sr,hvr->shv", c, w_uv)
    q = torch.cat((q_nope, q_pe), -1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    query_pos = torch.arange(length - num_queries, length)
    scores = scores.masked_fill(torch.arange(length)[None] > query_pos[:, None], float("-inf"))
    return torch.einsum("hts,shv->thv", scores.softmax(-1), v)


def paged(latents: list[torch.Tensor], num_blocks: int, gen: torch.Generator):
    """Each sequence's latents in scattered blocks: (cache, block tables)."""
    width = latents[0].shape[1]
    cache = torch.zeros(num_blocks, BLOCK, width)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-len(x) // BLOCK) for x in latents)
    tables = torch.zeros(len(latents), max_blocks, dtype=torch.int32)
    for s, x in enumerate(latents):
        blocks = [free.pop() for _ in range(-(-len(x) // BLOCK))]
        tables[s, : len(blocks)] = torch.tensor(blocks)
        slots = torch.tensor([blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(len(x))])
        torch_mla.store_latent(x, cache, slots)
    return cache, tables


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 23), min_size=1, max_size=4), heads=st.integers(1, 4),
       rank=st.sampled_from([8, 16]), seed=st.integers(0, 2**16))  # fmt: skip
def test_expanded_prefill_and_absorbed_decode_equal_plain_attention(lengths, heads, rank, seed):
    gen = torch.Generator().manual_seed(seed)
    nope, rope, v_dim, scale = 6, 4, 5, 0.3

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    w_uk, w_uv = randn(heads, nope, rank), randn(heads, v_dim, rank)
    cs, pes = [randn(n, rank) for n in lengths], [randn(n, rope) for n in lengths]
    cache, tables = paged([torch.cat(x, -1) for x in zip(cs, pes, strict=True)], 32, gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    # Prefill: each sequence's last new tokens (a chunk after a cached prefix).
    news = [1 + (seed + s) % n for s, n in enumerate(lengths)]
    q_nope, q_pe = randn(sum(news), heads, nope), randn(sum(news), heads, rope)
    starts = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32)
    out = torch_mla.mla_prefill(q_nope, q_pe, cache, tables, starts, seq_lens, w_uk, w_uv, scale)
    for s in range(len(lengths)):
        rows = slice(int(starts[s]), int(starts[s + 1]))
        want = dense_reference(q_nope[rows], q_pe[rows], cs[s], pes[s], w_uk, w_uv, scale)
        torch.testing.assert_close(out[rows], want, rtol=1e-4, atol=1e-4)
    # Decode: one new token each, absorbed, against the expanded form.
    q_nope, q_pe = randn(len(lengths), heads, nope), randn(len(lengths), heads, rope)
    absorbed = torch_mla.mla_decode(q_nope, q_pe, cache, tables, seq_lens, w_uk, w_uv, scale)
    one_each = torch.arange(len(lengths) + 1, dtype=torch.int32)
    expanded = torch_mla.mla_prefill(q_nope, q_pe, cache, tables, one_each, seq_lens, w_uk, w_uv,
                                     scale)  # fmt: skip
    torch.testing.assert_close(absorbed, expanded, rtol=1e-4, atol=1e-4)


def test_a_padded_row_is_not_stored():
    cache = torch.zeros(2, BLOCK, 3)
    torch_mla.store_latent(torch.ones(3, 3), cache, torch.tensor([5, -1, 0]))
    assert cache.view(-1, 3).sum(-1).tolist() == [3, 0, 0, 0, 0, 3, 0, 0]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


SMALL, OVER_16, V3_PER_RANK = (3, 32, 8, 16, 24), (20, 64, 16, 16, 24), (16, 512, 64, 128, 128)


# DeepSeek-V3's shapes in float32 only: tools/compile_sm90 derives the bf16 and FP8 KV
# launches from a float32 one.
@pytest.mark.parametrize(("dtype", "heads", "rank", "rope", "nope", "v_dim"),
                         [(d, *shape) for shape in (SMALL, OVER_16)
                          for d in (torch.float32, torch.float16)]
                         + [(torch.float32, *V3_PER_RANK)],
                         ids=["small-fp32", "small-fp16", "heads-over-16-fp32",
                              "heads-over-16-fp16", "deepseek-v3-per-rank"])  # fmt: skip
def test_the_triton_kernels_equal_their_torch_twins(dtype, heads, rank, rope, nope, v_dim):
    """Under TRITON_INTERPRET=1 on a CPU (the device's when there is one): contexts
    longer than a tile, heads beyond one program's 16, a rope dim padded for tl.dot,
    chunks after cached prefixes, an FP16 cache read by FP16 GEMMs; and DeepSeek-V3's
    per-rank shapes at TP=8, so that the launch compiled for sm_90a is the real one."""
    from flagstop.kernels import triton_mla

    gen = torch.Generator().manual_seed(heads)
    scale = 0.2
    lengths = [37, 5, 70, 1]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    cache, tables = paged([randn(n, rank + rope) for n in lengths], 64, gen)
    cache, tables = cache.to(DEVICE, dtype), tables.to(DEVICE)
    w_uk, w_uv = (randn(heads, d, rank).to(dtype) * rank**-0.5 for d in (nope, v_dim))
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else \
        {"atol": 3e-3, "rtol": 3e-3}  # fmt: skip
    news = [37, 2, 40, 1]  # a whole prompt, chunks after 3 and 30 cached, one token
    starts = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32,
                          device=DEVICE)  # fmt: skip
    q_nope, q_pe = randn(sum(news), heads, nope).to(dtype), randn(sum(news), heads, rope).to(dtype)
    args = (q_nope, q_pe, cache, tables, starts, seq_lens, w_uk, w_uv, scale)
    torch.testing.assert_close(triton_mla.mla_prefill(*args).float(),
                               torch_mla.mla_prefill(*args).float(), **tolerance)  # fmt: skip
    q_nope, q_pe = q_nope[: len(lengths)], q_pe[: len(lengths)]
    args = (q_nope, q_pe, cache, tables, seq_lens, w_uk, w_uv, scale)
    torch.testing.assert_close(triton_mla.mla_decode(*args).float(),
                               torch_mla.mla_decode(*args).float(), **tolerance)  # fmt: skip
