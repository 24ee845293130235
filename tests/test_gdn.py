"""The gated delta rule's torch path (kernels/torch_gdn.py) against transformers' own
torch fallback (the math its Qwen3-Next runs without flash-linear-attention): the
chunked form in blocks and the recurrent one, a chunk continuing from a state, grouped
value heads, the causal convolution carried across chunks. The layer over paged states:
tests/test_executor_model.py's and tests/test_recurrent.py's recurrent models."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from flagstop.kernels import torch_gdn

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)


def inputs(length: int, heads: int, dk: int, dv: int, seed: int):
    """q, k [1, T, H, dk], v [1, T, H, dv], g <= 0 and beta in (0, 1) [1, T, H]."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    g = -torch.nn.functional.softplus(randn(1, length, heads)) * 0.5
    beta = torch.sigmoid(randn(1, length, heads))
    return randn(1, length, heads, dk), randn(1, length, heads, dk), \
        randn(1, length, heads, dv), g, beta  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(length=st.integers(1, 70), heads=st.integers(1, 3), block=st.sampled_from([4, 16, 64]),
       split=st.floats(0, 1), seed=st.integers(0, 2**16))  # fmt: skip
def test_the_chunked_rule_in_two_chunks_equals_transformers(length, heads, block, split, seed):
    """A prompt in two chunks, the second from the state the first left, in blocks
    of `block` tokens: outputs and the final state equal transformers' one pass."""
    dk, dv = 8, 6
    q, k, v, g, beta = inputs(length, heads, dk, dv, seed)
    initial = torch.randn(1, heads, dk, dv, generator=torch.Generator().manual_seed(seed + 1))
    want, want_state = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=initial.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    nq, nk = torch_gdn.normalize(q[0], k[0])
    state, cut = initial[0].clone(), int(split * length)
    parts = [torch_gdn.chunked(nq[s], nk[s], v[0, s], g[0, s], beta[0, s], state, block)
             for s in (slice(0, cut), slice(cut, length))]  # fmt: skip
    torch.testing.assert_close(torch.cat(parts), want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, want_state[0], atol=1e-4, rtol=1e-4)


def test_the_recurrent_rule_equals_transformers_and_the_chunked_form():
    """Decode: a batch of 3 sequences, 5 tokens each one at a time, from their states."""
    heads, dk, dv = 2, 16, 8
    q, k, v, g, beta = (torch.cat(x) for x in zip(*(inputs(5, heads, dk, dv, s)
                                                    for s in range(3)), strict=True))  # fmt: skip
    initial = torch.randn(3, heads, dk, dv, generator=torch.Generator().manual_seed(9))
    want, want_state = torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=initial.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    nq, nk = torch_gdn.normalize(q, k)
    state = initial.clone()
    got = torch_gdn.recurrent(nq, nk, v, g, beta, state)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)
    for b in range(3):  # the same tokens as one chunk
        one = initial[b].clone()
        chunk = torch_gdn.chunked(nq[b], nk[b], v[b], g[b], beta[b], one, block=4)
        torch.testing.assert_close(chunk, got[b], atol=1e-5, rtol=1e-5)


def test_grouped_value_heads_read_their_key_head():
    """Qwen3-Next has more value heads than key heads: value head h reads key head
    h // (value heads / key heads), as transformers repeats them."""
    q, k, v, g, beta = inputs(9, 4, 8, 6, seed=3)
    q, k = q[:, :, :2], k[:, :, :2]  # 2 key heads for 4 value heads
    want, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    nq, nk = torch_gdn.normalize(q[0].repeat_interleave(2, 1), k[0].repeat_interleave(2, 1))
    got = torch_gdn.chunked(nq, nk, v[0], g[0], beta[0], torch.zeros(4, 8, 6))
    torch.testing.assert_close(got, want[0], atol=1e-4, rtol=1e-4)


def test_the_convolution_carried_across_chunks_equals_one_pass():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(11, 5, generator=gen), torch.randn(5, 4, generator=gen)
    want = causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T
    state = torch.zeros(5, 3)
    got = torch.cat([torch_gdn.causal_conv(x[s], weight, state)
                     for s in (slice(0, 2), slice(2, 3), slice(3, 11))])  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, x[-3:].T)
