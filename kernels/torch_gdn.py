"""The gated delta rule (Gated DeltaNet: Yang, Kautz, Hatamizadeh, arXiv 2412.06464),
the recurrent layers of Qwen3-Next and Qwen3.5, and their causal depthwise convolution,
on the CPU: the torch path and the twin of the GPU kernels (kernels/fla_gdn.py).

Per head the layer keeps a state S [dk, dv] and, for each token with its query q and
key k (both L2-normalised, q also scaled by dk^-0.5), value v, decay g <= 0 (log space)
and write strength beta in (0, 1):

    S <- exp(g) S;   S <- S + beta k (v - S^T k)^T;   out = S^T q

`recurrent` runs that token by token (decode: one token a sequence). `chunked` runs a
prefill chunk in blocks of `block` tokens: inside a block the writes are solved at once
(the WY form of the delta rule: one unit-lower-triangular solve for the corrected
values), and the state crosses blocks, so a sequence's chunk starts from the state its
last chunk left. Both are float32 inside, whatever the inputs' dtype.

The convolution mixes each channel over its last `width` inputs; its state is the last
width - 1 inputs, so a chunk continues where the previous one ended."""

import torch
import torch.nn.functional as F


def normalize(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k L2-normalised over the head dimension (eps 1e-6 inside the root, as the
    reference kernels), q also scaled by dk^-0.5; float32."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    return q, k


def recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Token by token over the second dimension: q, k [B, T, H, dk] (normalised), v
    [B, T, H, dv], g and beta [B, T, H]; state [B, H, dk, dv] float32, updated in place.
    Returns out [B, T, H, dv] float32."""
    out = v.new_empty(v.shape, dtype=torch.float32)
    for t in range(q.shape[1]):
        state.mul_(g[:, t].float().exp()[..., None, None])
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        correction = (v[:, t].float() - predicted) * beta[:, t].float()[..., None]
        state.add_(k[:, t][..., None] * correction[..., None, :])
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out


def chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, block: int = 64,
) -> torch.Tensor:  # fmt: skip
    """One sequence's chunk: q, k [T, H, dk] (normalised), v [T, H, dv], g and beta
    [T, H]; state [H, dk, dv] float32, updated in place. Returns out [T, H, dv] float32."""
    out = v.new_empty(v.shape, dtype=torch.float32)
    for start in range(0, q.shape[0], block):
        rows = slice(start, start + block)
        out[rows] = _block(q[rows], k[rows], v[rows].float(), g[rows].float(),
                           beta[rows].float(), state)  # fmt: skip
    return out


def _block(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """Up to `block` tokens at once, heads first inside. With G_i the decay summed from
    the block's start to token i, the state token i reads is exp(G_i) S0 plus the block's
    own corrected writes u_j up to i, each decayed by exp(G_i - G_j); the corrections
    themselves solve (I + A) u = beta (v - exp(G) S0^T k) with A the strictly lower
    beta_i exp(G_i - G_j) k_i.k_j: each token's prediction includes the writes before it."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [H, n, d]
    decay = g.transpose(0, 1).cumsum(-1)  # G [H, n]
    beta = beta.transpose(0, 1)[..., None]
    n = q.shape[1]
    gap = decay[:, :, None] - decay[:, None, :]  # G_i - G_j
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    weights = gap.masked_fill(~causal, float("-inf")).exp()  # exp(G_i - G_j), j <= i
    lower = beta * (k @ k.transpose(1, 2)) * weights.tril(-1)
    predicted = decay.exp()[..., None] * (k @ state)  # what S0 predicts at each token
    system = lower + torch.eye(n, device=q.device)
    corrections = torch.linalg.solve_triangular(system, beta * (v - predicted), upper=False,
                                                unitriangular=True)  # fmt: skip
    out = decay.exp()[..., None] * (q @ state) + ((q @ k.transpose(1, 2)) * weights) @ corrections
    tail = (decay[:, -1:] - decay).exp()[..., None]  # exp(G_n - G_j)
    state.mul_(decay[:, -1].exp()[:, None, None]).add_((k * tail).transpose(1, 2) @ corrections)
    return out.transpose(0, 1)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One sequence's chunk x [T, C] through the depthwise causal convolution weight
    [C, width] after SiLU; state [C, width - 1] (the inputs before the chunk, oldest
    first) is updated in place to the chunk's last width - 1 inputs."""
    width = weight.shape[1]
    padded = torch.cat((state.to(x.dtype), x.transpose(0, 1)), dim=1)  # [C, width - 1 + T]
    out = F.conv1d(padded[None], weight[:, None, :].to(x.dtype), groups=weight.shape[0])[0]
    state.copy_(padded[:, padded.shape[1] - (width - 1) :])
    return F.silu(out).transpose(0, 1)


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """One new input a sequence (decode): x [B, C], states [B, C, width - 1] updated in
    place; returns SiLU of the convolution [B, C]."""
    window = torch.cat((states.to(x.dtype), x[:, :, None]), dim=2)  # [B, C, width]
    states.copy_(window[:, :, 1:])
    return F.silu((window * weight.to(x.dtype)).sum(-1))
