"""The gated delta rule on the GPU: flash-linear-attention's Triton kernels (the library
made for it) behind kernels/torch_gdn.py's signatures: chunk_gated_delta_rule for a
prefill chunk, fused_recurrent_gated_delta_rule for a step of decodes. The convolution
stays torch_gdn's (one depthwise conv1d, fast on the GPU as it is).

An optional extra (`pip install 'flagstop[fla]'`, fla-core, which pulls no torch of its
own): on a CPU install, transformers' Qwen3-Next picks FLA's kernels up whenever it is
importable and fails without a GPU driver, so the reference the tests hold us to would
break; and FLA's autotuned kernels do not run in Triton's interpreter, so their twin test
against the torch path runs on a GPU (bench/gpu_check.sh)."""

import torch

from flagstop.kernels.torch_gdn import causal_conv, causal_conv_step, normalize  # noqa: F401

try:
    from fla.ops.gated_delta_rule import (
        chunk_gated_delta_rule,
        fused_recurrent_gated_delta_rule,
    )
except ImportError as error:  # the backend's one-line refusal (attention.py)
    raise ImportError(
        "gated DeltaNet layers on the triton backend run flash-linear-attention's kernels: "
        "pip install 'flagstop[fla]', or start with --attention-backend torch"
    ) from error


def recurrent(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """torch_gdn.recurrent: q, k already normalised and scaled (scale 1 here)."""
    out, final = fused_recurrent_gated_delta_rule(
        q, k, v, g=g.float(), beta=beta.float(), scale=1.0, initial_state=state,
        output_final_state=True,
    )  # fmt: skip
    state.copy_(final)
    return out.float()


def chunked(q, k, v, g, beta, state: torch.Tensor, block: int = 64) -> torch.Tensor:
    """torch_gdn.chunked: one sequence's chunk [T, H, d], its state [H, dk, dv]."""
    out, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None].float(), beta[None].float(), scale=1.0,
        initial_state=state[None], output_final_state=True,
    )  # fmt: skip
    state.copy_(final[0])
    return out[0].float()
