"""The one decoder of every supported architecture on a paged KV cache: a stack of
attention (or latent attention, or a gated DeltaNet mixer) and MLP (or MoE) layers,
one flattened varlen forward per step; q/k/v and gate/up packed into one matmul each.
What a family changes is declared in its file under executor/models/families/ and
read here from the config's sections (GemmaStyle, MlaConfig, MoeConfig,
RecurrentConfig), never by architecture name. Under tensor parallelism
(executor/parallel.py) each rank builds the same modules at its shard's sizes."""

from collections.abc import Sequence
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from flagstop.executor.attention import AttentionMetadata, Band, FP8Scales, paged_attention
from flagstop.executor.models.aux_hidden import AuxHidden, NoAuxHidden
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.gdn import GatedDeltaNet
from flagstop.executor.models.layers import (
    GemmaRMSNorm,
    MRotaryEmbedding,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    apply_rotary,
    gelu_tanh_and_mul,
    silu_and_mul,
)
from flagstop.executor.models.linear import QuantLinear, make_linear
from flagstop.executor.models.mla import LatentAttention
from flagstop.executor.models.moe import Experts, QuantExperts, SparseMoeBlock
from flagstop.executor.models.onednn import Linear
from flagstop.executor.models.quantization import ConfigError
from flagstop.executor.parallel import SINGLE, TensorParallel
from flagstop.kernels import torch_attention
from flagstop.scheduler_svc.core.kv_groups import (
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    KVCacheGroup,
    kv_cache_groups,
    layer_slots,
)

# A layer's cache tensors: K and V, or latent attention's one latent cache.
KVCache = tuple[torch.Tensor, ...]


class InputEmbeds:
    """What a step's hidden states take besides the tokens' own embeddings: nothing (a
    text model's step); the runner's media component gives the image embeddings of
    the step's placeholder tokens, and DeepStack's features after the first layers
    (executor/media.py)."""

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def after_layer(self, index: int, x: torch.Tensor, residual: torch.Tensor):
        return x, residual


TEXT_ONLY = InputEmbeds()


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + rows) of the padded vocabulary; a token another rank holds
    looks up zeros here, and one all-reduce sums the ranks' rows."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        self.start, rows = tp.shard.vocab(vocab_size)
        super().__init__(rows, hidden_size)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.masked_fill(~mine, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(~mine.unsqueeze(-1), 0))


def softmax_scale(config: ModelConfig) -> float:
    """head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5, or Granite's own."""
    if config.multipliers is not None:
        return config.multipliers.attention
    gemma = config.gemma
    return (gemma.query_pre_attn_scalar if gemma else config.head_dim) ** -0.5


def norm_class(config: ModelConfig) -> type[RMSNorm]:
    """Gemma's and the recurrent Qwens' norms are (1 + w), Llama's w."""
    return GemmaRMSNorm if config.gemma is not None or config.recurrent is not None else RMSNorm


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, prefix: str, index: int) -> None:
        super().__init__()
        self.num_heads = tp.shard.heads(config.num_heads)[1]
        self.num_kv_heads = tp.shard.kv_heads(config.num_kv_heads)[1]
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        # Qwen3-Next's: q_proj gives each head its query and an output gate.
        self.gated = config.attention_gated
        q_rows = self.q_size * (2 if self.gated else 1)
        gemma = config.gemma
        self.scale = softmax_scale(config)
        qkv = tuple(f"{prefix}.{name}_proj" for name in "qkv")
        self.qkv_proj = make_linear(
            config, qkv, config.hidden_size, q_rows + 2 * self.kv_size, config.qkv_bias
        )
        self.o_proj = make_linear(
            config, (f"{prefix}.o_proj",), self.q_size, config.hidden_size, config.o_bias, tp
        )
        norm = norm_class(config)
        self.q_norm = norm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.backend: ModuleType = torch_attention
        # An FP8 cache's scales (this rank's KV heads'): set by set_kv_cache_dtype;
        # None while the cache is in the model's dtype.
        self.fp8_scales: FP8Scales | None = None
        sliding = config.layer_types[index] == SLIDING_ATTENTION
        self.window = config.sliding_window if sliding else 0
        # gpt-oss: this rank's heads' learned sink logits.
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None
        self.softcap = gemma.attn_logit_softcapping if gemma else 0.0
        # Which of the model's RoPE tables (Gemma's window layers have their own base).
        self.rope_index = int(sliding and gemma is not None)

    def forward(
        self, ropes: tuple[Rope, ...], x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        rope = ropes[self.rope_index]
        q_rows = self.q_size * (2 if self.gated else 1)
        q, k, v = self.qkv_proj(x).split([q_rows, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(rope, q, k)
        band = Band.of(self.window, self.sinks, self.softcap)
        out = paged_attention(self.backend, q, k, v, kv_cache, meta, self.scale, self.fp8_scales,
                              band)  # fmt: skip
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.flatten(1))


def use_backend(model: nn.Module, backend: ModuleType) -> None:
    """The kernels module a model's attention runs on; its experts run its fused_moe,
    its quantized layers its linears."""
    for module in model.modules():
        if isinstance(module, Attention | LatentAttention):
            module.backend = backend
        elif isinstance(module, GatedDeltaNet):
            try:
                module.kernels = backend.gdn()
            except ImportError as e:  # the triton backend without flash-linear-attention
                raise ConfigError(str(e)) from None
        elif isinstance(module, Experts):
            module.fused = backend.fused_moe
        elif isinstance(module, QuantLinear | QuantExperts):
            module.kernels = backend


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, prefix: str) -> None:
        super().__init__()
        size, inner = config.hidden_size, tp.shard.split(config.intermediate_size)[1]
        gate_up = (f"{prefix}.gate_proj", f"{prefix}.up_proj")
        self.gate_up_proj = make_linear(config, gate_up, size, 2 * inner, config.mlp_bias)
        down = (f"{prefix}.down_proj",)
        self.down_proj = make_linear(config, down, inner, size, config.mlp_bias, tp)
        self.act_and_mul = gelu_tanh_and_mul if config.gemma else silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, index: int) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"  # the checkpoint's names, which quantization uses
        if config.layer_types and config.layer_types[index] == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config, tp, f"{prefix}.linear_attn")
            mixer: nn.Module = self.linear_attn
        else:
            attention = Attention if config.mla is None else LatentAttention
            self.self_attn = mixer = attention(config, tp, f"{prefix}.self_attn", index)
        # The token mixer, by either name (a tuple: not registered twice).
        self.mixer = (mixer,)
        sparse = config.moe is not None and config.moe.sparse_layers[index]
        mlp = SparseMoeBlock if sparse else MLP
        self.mlp = mlp(config, tp, f"{prefix}.mlp")
        norm, size, eps = norm_class(config), config.hidden_size, config.rms_norm_eps
        self.input_layernorm = norm(size, eps)
        self.post_attention_layernorm = norm(size, eps)
        self.sandwich = config.gemma is not None
        if self.sandwich:  # Gemma: the attention's and the MLP's outputs normed too
            self.pre_feedforward_layernorm = norm(size, eps)
            self.post_feedforward_layernorm = norm(size, eps)

    def forward(self, ropes, x, residual, kv_cache: KVCache, meta: AttentionMetadata):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.mixer[0](ropes, x, kv_cache, meta)
        if not self.sandwich:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class ScaledDecoderLayer(DecoderLayer):
    """Granite's layer: each residual branch (the attention's output, the MLP's) scaled
    by residual_multiplier before it joins the residual stream."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, index: int) -> None:
        super().__init__(config, tp, index)
        assert config.multipliers is not None
        self.residual_multiplier = config.multipliers.residual

    def forward(self, ropes, x, residual, kv_cache: KVCache, meta: AttentionMetadata):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.mixer[0](ropes, x, kv_cache, meta) * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) * self.residual_multiplier, residual


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config, self.tp = config, tp
        # One table shared by every layer (Gemma's window layers: a second one).
        rope = (config.rotary_dim, config.max_position_embeddings, config.rope_theta,
                config.rope_scaling)  # fmt: skip
        vision = config.vision
        self.rotary = MRotaryEmbedding(*rope, vision.mrope_section,
                                       vision.layout.mrope_interleaved) \
            if vision is not None and vision.mrope_section else RotaryEmbedding(*rope)  # fmt: skip
        self.rotary_tables = [self.rotary]
        if (gemma := config.gemma) is not None:
            self.rotary_tables.append(RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, gemma.local_rope_theta,
                gemma.local_rope_scaling,
            ))  # fmt: skip
        # Gemma scales the embedding by sqrt(hidden_size), rounded to the model's dtype;
        # Granite by its embedding_multiplier, as is; the logits divided by its
        # logits_scaling.
        multipliers = config.multipliers
        self.embed_scale = config.hidden_size**0.5 if gemma is not None else \
            multipliers.embedding if multipliers is not None else None  # fmt: skip
        self.embed_scale_rounded = gemma is not None
        self.logits_divisor = multipliers.logits if multipliers is not None else None
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        layer = ScaledDecoderLayer if multipliers is not None else DecoderLayer
        self.layers = nn.ModuleList(layer(config, tp, i) for i in range(config.num_layers))
        # Each layer's KV cache group: the step's metadata has a block table per group.
        self.set_kv_groups(kv_cache_groups(config.kv_layers(1, 1)))
        mlps = (layer.mlp for layer in self.layers)
        self.moe_blocks = [mlp for mlp in mlps if isinstance(mlp, SparseMoeBlock)]
        self.recurrent_layers = [m for m in self.modules() if isinstance(m, GatedDeltaNet)]
        self.block_size = 0  # the cache's, once the runner knows it (after_verify)
        # Layers' inputs an EAGLE-3 drafter reads (models/aux_hidden.py); none unless
        # one asks.
        self.aux_hidden: NoAuxHidden | AuxHidden = NoAuxHidden()
        self.norm = norm_class(config)(config.hidden_size, config.rms_norm_eps)
        # The checkpoint's K/V cache scales by layer, [2, this rank's KV heads] (the
        # loader's; an FP8 cache without them scales by 1.0).
        self.checkpoint_kv_scales: dict[int, torch.Tensor] = {}
        # Vocabulary-parallel like the embedding (it may be the same tensor, tied).
        rows = tp.shard.vocab(config.vocab_size)[1]
        if config.quant and config.quant.scheme_for("lm_head"):
            raise ConfigError("quantization_config: a quantized lm_head is not run; "
                              "list lm_head in its ignore")  # fmt: skip
        self.lm_head = Linear(config.hidden_size, rows, bias=False)
        self.tie_weights()

    def set_kv_groups(self, groups: list[KVCacheGroup]) -> None:
        """The KV cache groups the runner holds (its own when the hybrid manager is off)."""
        self.layer_groups = [g for g, _ in layer_slots(groups, self.config.num_layers)]

    def after_verify(self, num_sampled: list[int] | None) -> None:
        """The model's hook after each step (vLLM's ModelState.postprocess_state): a
        verification kept num_sampled tokens per sampling request (None: no drafts),
        and the recurrent layers keep their states after those. A no-op without drafts
        or without recurrent layers, so the runner calls it every step."""
        for layer in self.recurrent_layers:
            layer.accept(num_sampled or [], self.block_size)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def shared_weights(self) -> list[torch.Tensor]:
        """Weights another module may read as they are (the LM head tied to the
        embedding): oneDNN's packing keeps them."""
        return [self.embed_tokens.weight]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metas: Sequence[AttentionMetadata],
        embeds: InputEmbeds = TEXT_ONLY,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of one flattened step; kv_caches by layer,
        metas by KV cache group; embeds: the images' at their placeholders."""
        x, residual = self.embed_tokens(input_ids), None
        if (scale := self.embed_scale) is not None:
            x = x * (torch.tensor(scale, dtype=x.dtype) if self.embed_scale_rounded else scale)
        x = embeds.merge(x)
        ropes = tuple(table.lookup(positions) for table in self.rotary_tables)
        for i, (layer, kv_cache, g) in enumerate(zip(self.layers, kv_caches, self.layer_groups,
                                                     strict=True)):  # fmt: skip
            self.aux_hidden.before_layer(i, x, residual)
            x, residual = layer(ropes, x, residual, kv_cache, metas[g])
            x, residual = embeds.after_layer(i, x, residual)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[tokens, vocab] float32 on rank 0 (the ranks' vocabulary slices gathered,
        the padding cut off); None on the other ranks."""
        logits = self.tp.gather_to_first(self.lm_head(hidden).float())
        if logits is None:
            return None
        logits = logits[:, : self.config.vocab_size]
        if (gemma := self.config.gemma) is not None and (cap := gemma.final_logit_softcapping):
            logits = torch.tanh(logits / cap) * cap  # Gemma 2's final soft cap
        if self.logits_divisor is not None:
            logits = logits / self.logits_divisor
        return logits

    def set_attention_backend(self, backend: ModuleType) -> None:
        use_backend(self, backend)

    def set_kv_cache_dtype(self, dtype: torch.dtype) -> None:
        """The cache's dtype: an FP8 one gives each layer its K and V scales (a latent
        layer: its one scale, the checkpoint's k_scale)."""
        for index, layer in enumerate(self.layers):
            attention = layer.mixer[0]
            if isinstance(attention, GatedDeltaNet):
                continue  # float32 states in the blocks' pages, whatever the cache's dtype
            if isinstance(attention, LatentAttention):
                scales = self.checkpoint_kv_scales.get(index)
                attention.kv_scale = None if dtype != torch.float8_e4m3fn else \
                    float(scales[0, 0]) if scales is not None else 1.0  # fmt: skip
                continue
            if dtype != torch.float8_e4m3fn:
                attention.fp8_scales = None
                continue
            ones = torch.ones(2, attention.num_kv_heads)
            kv_scale = self.checkpoint_kv_scales.get(index, ones).to(self.norm.weight.device)
            attention.fp8_scales = FP8Scales.of(kv_scale, attention.num_heads)

    def take_expert_tokens(self) -> list[int] | None:
        """The (token, expert) pairs each expert took over the sparse layers since
        the last call (rank 0; None for a dense model): the step span's."""
        counts = [c for b in self.moe_blocks if (c := b.take_expert_tokens()) is not None]
        return torch.stack(counts).sum(0).tolist() if counts else None
