"""Device functions the Triton kernel modules share."""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b; fp32 in IEEE precision (no TF32), so that it compares tightly."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def online_softmax(s, values, m, l, acc, IEEE: tl.constexpr):  # noqa: E741
    """One tile of scores s [rows, n] (masked ones -inf) and its values [n, d] into a
    running softmax: the updated max m, sum l and unnormalised output acc. Every row
    must have seen a finite score by its first tile (causal attention from key 0)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    probs = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(probs, 1)  # noqa: E741
    return m_new, l, acc * alpha[:, None] + dot(probs.to(values.dtype), values, IEEE)
