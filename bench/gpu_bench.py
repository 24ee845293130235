"""Attention microbenchmarks on a CUDA device (part of bench/gpu_check.sh).

    python bench/gpu_bench.py [--out FILE]

Decode: achieved HBM bandwidth of paged_attention_decode (K/V bytes read per call /
time) against the H200's ~4.8 TB/s, batch 1..256 x context 512..8192, beside torch SDPA
on a dense (unpaged) cache and flash-attn / FlashInfer when importable. Prefill: causal
TFLOP/s of paged_attention_prefill beside SDPA. Shapes of a Llama-3-8B layer: 32 query
heads, 8 KV heads, head_dim 128, bf16, 16-token blocks.
"""

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flagstop.kernels import triton_attention
from flagstop.utils import cdiv

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
HBM_TBPS = 4.8
DTYPE = torch.bfloat16


def paged_cache(batch: int, context: int):
    blocks_per_seq = cdiv(context, BLOCK)
    shape = (batch * blocks_per_seq, BLOCK, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device="cuda", dtype=DTYPE)
    v = torch.randn(shape, device="cuda", dtype=DTYPE)
    # Scattered blocks, as after a while of serving.
    order = torch.randperm(batch * blocks_per_seq, device="cuda", dtype=torch.int32)
    return k, v, order.view(batch, blocks_per_seq)


def timed_ms(fn, *args, **kwargs) -> float:
    return do_bench(lambda: fn(*args, **kwargs))


def dense(cache: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """[batch, kv_heads, length, head_dim]: the same bytes as an unpaged cache."""
    return cache.view(batch, -1, KV_HEADS, HEAD_DIM)[:, :length].transpose(1, 2).contiguous()


def flash_attn_ms(q, k, v, lens, batch: int) -> str:
    if importlib.util.find_spec("flash_attn") is None:
        return "-"
    from flash_attn import flash_attn_with_kvcache

    kc = k.view(batch, -1, KV_HEADS, HEAD_DIM).contiguous()
    vc = v.view(batch, -1, KV_HEADS, HEAD_DIM).contiguous()
    return f"{timed_ms(flash_attn_with_kvcache, q[:, None], kc, vc, cache_seqlens=lens) * 1e3:.0f}"


def decode_rows() -> list[str]:
    rows = [
        "| batch | context | triton (us) | GB/s | % of HBM | SDPA dense (us) | flash-attn (us) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for context in (512, 2048, 8192):
        for batch in (1, 16, 64, 256):
            k, v, tables = paged_cache(batch, context)
            q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
            lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
            ms = timed_ms(
                triton_attention.paged_attention_decode, q, k, v, tables, lens, HEAD_DIM**-0.5
            )
            gbps = batch * context * KV_HEADS * HEAD_DIM * 2 * 2 / (ms * 1e-3) / 1e9
            sdpa = timed_ms(
                F.scaled_dot_product_attention, q[:, :, None], dense(k, batch, context),
                dense(v, batch, context), enable_gqa=True,
            )  # fmt: skip
            flash = flash_attn_ms(q, k, v, lens, batch)
            percent = gbps / (HBM_TBPS * 1e3) * 100
            rows.append(
                f"| {batch} | {context} | {ms * 1e3:.0f} | {gbps:.0f} | {percent:.0f}% | "
                f"{sdpa * 1e3:.0f} | {flash} |"
            )
            print(rows[-1], flush=True)
    return rows


def prefill_rows() -> list[str]:
    rows = [
        "| sequences x tokens | triton (ms) | TFLOP/s | SDPA causal (ms) | SDPA TFLOP/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for num_seqs, length in ((1, 512), (1, 2048), (4, 2048), (1, 8192)):
        k, v, tables = paged_cache(num_seqs, length)
        q = torch.randn(num_seqs * length, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        starts = torch.arange(0, num_seqs + 1, device="cuda", dtype=torch.int32) * length
        lens = torch.full((num_seqs,), length, device="cuda", dtype=torch.int32)
        ms = timed_ms(
            triton_attention.paged_attention_prefill, q, k, v, tables, starts, lens,
            HEAD_DIM**-0.5,
        )  # fmt: skip
        # Causal attention: half of the 4 * heads * head_dim * length^2 of a full one.
        flops = num_seqs * 2 * HEADS * HEAD_DIM * length * length
        qd = q.view(num_seqs, length, HEADS, HEAD_DIM).transpose(1, 2)
        sdpa = timed_ms(
            F.scaled_dot_product_attention, qd, dense(k, num_seqs, length),
            dense(v, num_seqs, length), is_causal=True, enable_gqa=True,
        )  # fmt: skip
        rows.append(
            f"| {num_seqs} x {length} | {ms:.2f} | {flops / ms / 1e9:.0f} | {sdpa:.2f} | "
            f"{flops / sdpa / 1e9:.0f} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_bench.md")
    args = parser.parse_args()
    name = torch.cuda.get_device_name()
    sections = [f"# Attention on {name}", "", "## Decode", "", *decode_rows()]
    sections += ["", "## Prefill", "", *prefill_rows(), ""]
    text = "\n".join(sections)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
