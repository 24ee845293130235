"""In-process speculative decoding for the drafter tests (test_mtp.py, test_eagle.py,
test_eagle1.py): a model runner drafting by a method, a seeded workload, the scheduler
core driving it with drafts on, the greedy reference check, a recorder of every
proposal, and a plain torch Llama layer for the heads' references."""

import random

import torch
import torch.nn.functional as F

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from flagstop.scheduler_svc.core.config import SchedulerConfig
from tests.helpers.checkpoints import prompt, reference_generate
from tools.inprocess import Job, run_engine


def spec_runner(path, spec, **config) -> ModelRunner:
    base = dict(model=str(path), num_blocks=256, block_size=4, max_num_seqs=16)
    return ModelRunner(ExecutorConfig(**{**base, **config}, speculative_config=spec))


def spec_jobs(n: int, workload: int, **sampling) -> list[Job]:
    rng = random.Random(workload)
    return [Job(prompt(workload * 100 + i, rng.randrange(4, 30)), rng.randrange(10, 40),
                SamplingParams(**sampling)) for i in range(n)]  # fmt: skip


def spec_engine(runner, jobs, num_blocks=None, **config):
    base = dict(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=512, block_size=4,
                num_speculative_tokens=runner.num_speculative_tokens,
                speculative_min_gain=1e-12)  # fmt: skip
    return run_engine(runner, jobs, SchedulerConfig(**{**base, **config}), num_blocks=num_blocks)


def assert_greedy(reference, jobs: list[Job], outputs: list[list[int]]) -> None:
    for job, out in zip(jobs, outputs, strict=True):
        assert out == reference_generate(reference, job.prompt, job.max_tokens)


def record_proposals(runner) -> list[tuple[list[int], list[int]]]:
    """Each request's known tokens and the drafts proposed after them, as proposed."""
    proposer, seen = runner.drafter.proposer, []
    propose = proposer.propose

    def recording(batch, rows, slots):
        drafts, probs = propose(batch, rows, slots)
        for row, row_drafts in zip(rows.tolist(), drafts, strict=True):
            known = batch.token_ids[row, : batch.num_tokens[row]].tolist()
            seen.append((known, row_drafts.tolist()))
        return drafts, probs

    proposer.propose = recording
    return seen


def checked_proposals(seen: list[tuple[list[int], list[int]]], drafts_of) -> int:
    """Each recorded proposal's drafts against the reference's logits of each draft
    (drafts_of(known, k)), each the argmax up to the first near tie (the chain after
    it may rightly differ); how many drafts were checked."""
    checked = 0
    for known, drafts in seen:
        for ours, logits in zip(drafts, drafts_of(known, len(drafts)), strict=True):
            top = logits.topk(2).values
            if top[0] - top[1] < 1e-3:
                break
            assert ours == int(logits.argmax())
            checked += 1
    return checked


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding of [positions, heads, head_dim], positions 0.."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = torch.outer(torch.arange(len(x)).float(), inv)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    rotated = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1)
    return x * cos[:, None] + rotated * sin[:, None]


def plain_llama_layer(t: dict, p: str, c: dict, x: torch.Tensor, residual: torch.Tensor
                      ) -> torch.Tensor:  # fmt: skip
    """A Llama decoder layer's attention (causal, every position) and MLP over x (its
    input, already normed as the head norms it), its tensors t[p + ...], its config c;
    the residual stream it adds to. Returns the layer's output with the residual."""
    heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    n = len(x)
    q = (x @ t[p + "self_attn.q_proj.weight"].T).view(n, heads, d)
    k = (x @ t[p + "self_attn.k_proj.weight"].T).view(n, kv, d)
    if p + "self_attn.q_norm.weight" in t:  # Qwen3's: each head normed before RoPE
        q = rms_norm(q, t[p + "self_attn.q_norm.weight"], c["rms_norm_eps"])
        k = rms_norm(k, t[p + "self_attn.k_norm.weight"], c["rms_norm_eps"])
    q, k = rope(q, c["rope_theta"]), rope(k, c["rope_theta"])
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(n, kv, d)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), is_causal=True)  # fmt: skip
    h = out.transpose(0, 1).reshape(n, heads * d) @ t[p + "self_attn.o_proj.weight"].T + residual
    x = rms_norm(h, t[p + "post_attention_layernorm.weight"], c["rms_norm_eps"])
    gate, up = x @ t[p + "mlp.gate_proj.weight"].T, x @ t[p + "mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T + h


def shared_prefix_jobs(n: int, prefix_tokens: int = 24) -> list[Job]:
    """n greedy requests whose prompts share their first prefix_tokens."""
    shared = prompt(7, prefix_tokens)
    return [Job(shared + prompt(700 + i, 3 + i), 12, SamplingParams()) for i in range(n)]


def assert_prefix_hits_stay_greedy(runner, reference) -> None:
    """Two requests at a time with the prefix cache on, so that each later one finds
    the shared prompt's blocks cached (positions the drafter never saw, whose drafts
    may only be worse): greedy outputs unchanged, drafts made."""
    jobs = shared_prefix_jobs(6)
    run = spec_engine(runner, jobs, max_num_seqs=2)
    assert run.scheduler.stats().prefix_cache_hits >= 4 * 24
    assert_greedy(reference, jobs, run.outputs)
    assert run.scheduler.drafts.stats.num_draft_tokens > 0


def assert_every_proposal_is_computed(runner, reference, drafts_of) -> None:
    """Through chunked prefill and decodes beside each other, the prefix cache off
    (the reference reads every position's state): greedy outputs unchanged, and each
    draft the reference's argmax (drafts_of(known, k): each draft's logits) up to the
    first near tie."""
    seen = record_proposals(runner)
    jobs = spec_jobs(4, 5)
    run = spec_engine(runner, jobs, no_prefix_caching=True, max_num_batched_tokens=24)
    assert_greedy(reference, jobs, run.outputs)
    checked = checked_proposals(seen[::4], drafts_of)
    assert checked > 2 * len(seen[::4]) > 0


def assert_preemption_stays_greedy(path, spec: dict, reference) -> None:
    """Six requests in 16-token steps on a pool of 24 blocks: preempted, recomputed,
    their greedy outputs unchanged, drafts made."""
    jobs = spec_jobs(6, 2)
    run = spec_engine(spec_runner(path, spec, num_blocks=24), jobs, 24,
                      no_prefix_caching=True, max_num_batched_tokens=16)  # fmt: skip
    assert run.scheduler.num_preemptions > 0
    assert_greedy(reference, jobs, run.outputs)
    assert run.scheduler.drafts.stats.num_draft_tokens > 0


def assert_seeded_sampling_unchanged(path, spec: dict) -> None:
    """Seeded sampling with drafts emits what it emits without them."""
    jobs = spec_jobs(5, 3, temperature=0.9, top_k=40, seed=7)
    plain = spec_engine(spec_runner(path, None), jobs, no_prefix_caching=True).outputs
    run = spec_engine(spec_runner(path, spec), jobs, no_prefix_caching=True)
    assert run.outputs == plain
    assert run.scheduler.drafts.stats.num_draft_tokens > 0


def proposals_by_layout(path, specs: list[dict]) -> list[list]:
    """Each spec's proposals (known tokens, drafts) over the same small workload, the
    prefix cache off: the same weights in two layouts must propose the same."""
    out = []
    for spec in specs:
        runner = spec_runner(path, spec)
        seen = record_proposals(runner)
        spec_engine(runner, spec_jobs(3, 8), no_prefix_caching=True)
        out.append(seen)
    assert out[0], "nothing was proposed"
    return out
