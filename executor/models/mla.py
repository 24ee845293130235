"""Multi-head latent attention as a model layer (DeepSeek-V2/V3, Kimi-K2): the
projections around the latent cache's kernels (kernels/torch_mla.py, and the backend's
`mla` module).

Per token the layer writes one latent c (kv_a_proj_with_mqa's first kv_lora_rank
outputs, after kv_a_layernorm) and one rotated key k_pe (its last rope_dim outputs)
into the cache; each head's key is [W_uk c, k_pe] and its value W_uv c, W_uk and W_uv
the halves of kv_b_proj. Prefill attends in the expanded form, decode in the absorbed
one (torch_mla.py says why). Under tensor parallelism each rank holds its heads' rows of
q_b_proj (or q_proj) and kv_b_proj and their columns of o_proj, and every rank the
whole latent cache (the latent is shared by every head: vLLM splits it the same way)."""

import torch
from torch import nn

from flagstop.executor.attention import FP8, AttentionMetadata
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.layers import RMSNorm, Rope, apply_rotary, deinterleave
from flagstop.executor.models.linear import QuantLinear, make_linear
from flagstop.executor.parallel import TensorParallel
from flagstop.kernels import torch_attention

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps,
# not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, prefix: str, index: int) -> None:
        super().__init__()
        mla, hidden = config.mla, config.hidden_size
        assert mla is not None
        self.mla = mla
        self.num_heads = tp.shard.heads(config.num_heads)[1]
        heads = self.num_heads
        qk_dim = mla.nope_dim + mla.rope_dim
        bias = config.qkv_bias  # attention_bias: the a-projections and o_proj only

        def linear(name: str, size_in: int, size_out: int, biased: bool = False, row_tp=None):
            return make_linear(config, (f"{prefix}.{name}",), size_in, size_out, biased, row_tp)

        if mla.q_lora_rank:
            self.q_a_proj = linear("q_a_proj", hidden, mla.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = linear("q_b_proj", mla.q_lora_rank, heads * qk_dim)
        else:
            self.q_proj = linear("q_proj", hidden, heads * qk_dim)
        self.kv_a_proj_with_mqa = linear("kv_a_proj_with_mqa", hidden, mla.latent_width, bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = linear("kv_b_proj", mla.kv_lora_rank,
                                heads * (mla.nope_dim + mla.v_head_dim))  # fmt: skip
        self.o_proj = linear("o_proj", heads * mla.v_head_dim, hidden, config.o_bias, tp)
        self.scale = mla.scale
        self.backend = torch_attention  # its `mla` module runs the latent kernels
        # kv_b_proj's halves by head, W_uk [H, nope, rank] and W_uv [H, v, rank]: taken
        # by after_load() (the linear may be prepacked or quantized after it).
        self.w_uk = self.w_uv = torch.empty(0)
        # An FP8 cache's one scale (the latent and the rotated key share it): set by
        # set_kv_cache_dtype; None while the cache is in the model's dtype.
        self.kv_scale: float | None = None

    def after_load(self, dtype: torch.dtype) -> None:
        """W_uk and W_uv from kv_b_proj's weight (dequantized), in the model's dtype."""
        w = self.kv_b_proj
        weight = w.dequantize() if isinstance(w, QuantLinear) else w.weight.detach()
        weight = weight.to(dtype)
        halves = weight.view(self.num_heads, self.mla.nope_dim + self.mla.v_head_dim, -1)
        w_uk, w_uv = halves.split([self.mla.nope_dim, self.mla.v_head_dim], dim=1)
        self.w_uk, self.w_uv = w_uk.contiguous(), w_uv.contiguous()

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(
        self, ropes: tuple[Rope, ...], x: torch.Tensor, kv_cache: tuple[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        mla = self.mla
        q = self._queries(x).view(-1, self.num_heads, mla.nope_dim + mla.rope_dim)
        q_nope, q_pe = q.split([mla.nope_dim, mla.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.rope_dim], dim=-1)
        c, k_pe = self.kv_a_layernorm(c.contiguous()), k_pe.unsqueeze(1)
        if mla.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = apply_rotary(ropes[0], q_pe, k_pe)
        latent = torch.cat((c, k_pe.squeeze(1)), dim=-1)
        out = self._attend(q_nope, q_pe, latent, kv_cache[0], meta)
        return self.o_proj(out.flatten(1))

    def _attend(self, q_nope, q_pe, latent, cache: torch.Tensor, meta: AttentionMetadata):
        """Store the new latents, then attend: decode rows absorbed, prefill rows
        expanded. An FP8 cache holds latent / s: the keys are then s times what the
        kernels see and the values too, so the queries are scaled by s before and the
        output after (attention.fp8_cache's reasoning, with one scale)."""
        kernels, s = self.backend.mla, self.kv_scale
        if s is not None:
            latent = (latent.float() / s).to(FP8)
            q_nope, q_pe = q_nope * s, q_pe * s
        kernels.store_latent(latent, cache, meta.slot_mapping)
        n, args = meta.num_decodes, (self.w_uk, self.w_uv, self.scale)
        if n == q_nope.shape[0]:
            out = kernels.mla_decode(q_nope, q_pe, cache, *meta.decode, *args)
        else:
            out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.mla.v_head_dim)
            if n:
                out[:n] = kernels.mla_decode(q_nope[:n], q_pe[:n], cache, *meta.decode, *args)
            out[n:] = kernels.mla_prefill(q_nope[n:], q_pe[n:], cache, *meta.prefill, *args)
        return out if s is None else out * s
