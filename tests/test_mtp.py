"""DeepSeek's multi-token prediction layer as the speculative method `mtp`: drafting
never changes what is emitted (greedy: transformers' tokens; seeded: the plain run's),
through chunked prefill and preemption; on a checkpoint whose prediction layer is a copy
of its last layer that sees only the next token's embedding, most drafts are accepted,
so the catch-up and the chaining feed it the right tokens at the right positions."""

import copy
import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, Qwen3NextConfig

from flagstop.server import StartupError
from tests.helpers.checkpoints import (
    COMMON,
    RECURRENT_VARIANTS,
    load_reference,
    write_checkpoint,
    write_config,
)
from tests.helpers.drafting import (
    assert_greedy,
    checked_proposals,
    record_proposals,
    spec_engine,
    spec_jobs,
    spec_runner,
)

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)

MTP = {"method": "mtp", "num_speculative_tokens": 3}


def add_prediction_layer(path, echo: bool) -> None:
    """model.layers.{L}: a copy of the last layer, its head and norm the model's.
    echo: eh_proj passes only the token's embedding (the hidden state's half zero) and
    the embeddings are of unit RMS, so that with one layer the prediction layer is the
    model itself, run over the tokens from position 1 on: its drafts mostly agree."""
    config = json.loads((path / "config.json").read_text())
    last, index = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    tensors = load_file(path / "model.safetensors")
    hidden = config["hidden_size"]
    if echo:
        embed = tensors["model.embed_tokens.weight"]
        tensors["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    for name in [n for n in tensors if n.startswith(f"model.layers.{last}.")]:
        tensors[name.replace(f"layers.{last}.", f"layers.{index}.")] = tensors[name].clone()
    g = torch.Generator().manual_seed(3)
    eh = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), 1) if echo else \
        torch.randn(hidden, 2 * hidden, generator=g) * 0.05  # fmt: skip
    p = f"model.layers.{index}."
    own = {
        "shared_head.norm": "model.norm",
        "shared_head.head": "lm_head",
        "embed_tokens": "model.embed_tokens",
    }  # the model's, copied
    tensors |= {p + f"{ours}.weight": tensors[f"{theirs}.weight"].clone()
                for ours, theirs in own.items()}  # fmt: skip
    tensors |= {p + "enorm.weight": torch.ones(hidden), p + "hnorm.weight": torch.ones(hidden),
                p + "eh_proj.weight": eh}  # fmt: skip
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """A one-layer DeepSeek-V3 (latent attention, a sparse layer) with an echo layer."""
    path = write_config(DeepseekV3Config(
        **{**COMMON, "num_hidden_layers": 1, "num_key_value_heads": 4}, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, q_lora_rank=48,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        n_shared_experts=1, first_k_dense_replace=0, n_group=4, topk_group=2,
    ), tmp_path_factory.mktemp("mtp-echo"))  # fmt: skip
    add_prediction_layer(path, echo=True)
    return path, load_reference(path)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """GLM-4.5's layout, its prediction layer a copy of the last with a random eh_proj."""
    path = write_checkpoint("glm4-moe", tmp_path_factory.mktemp("mtp-glm"))
    add_prediction_layer(path, echo=False)
    return path, load_reference(path)


def test_greedy_drafts_of_the_echo_layer_are_mostly_accepted_and_change_nothing(echo):
    path, reference = echo
    jobs = spec_jobs(6, 1)
    run = spec_engine(spec_runner(path, MTP), jobs)
    assert_greedy(reference, jobs, run.outputs)
    stats = run.scheduler.drafts.stats
    # Measured: 0.64 of drafts accepted (0.80 at k = 1; the layer misses the first
    # token's context).
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 0
    assert max(run.tokens_per_request_step) == 4  # all three drafts and the bonus, once


def test_preempted_and_chunked_requests_keep_greedy_outputs(echo):
    path, reference = echo
    jobs = spec_jobs(6, 2)
    run = spec_engine(spec_runner(path, MTP, num_blocks=24), jobs, num_blocks=24,
                  max_num_batched_tokens=16)  # fmt: skip
    assert run.scheduler.num_preemptions > 0
    assert_greedy(reference, jobs, run.outputs)
    assert run.scheduler.drafts.stats.num_accepted_tokens > 0


def test_seeded_sampling_with_mtp_drafts_emits_what_it_would_without(echo):
    path, _ = echo
    jobs = spec_jobs(5, 3, temperature=0.9, top_k=40, seed=7)
    plain = spec_engine(spec_runner(path, None), jobs).outputs
    run = spec_engine(spec_runner(path, MTP), jobs)
    assert run.outputs == plain
    assert run.scheduler.drafts.stats.num_accepted_tokens > 0


def test_glms_prediction_layer_drafts_on_gqa_and_changes_nothing(glm):
    path, reference = glm
    jobs = spec_jobs(4, 4)
    run = spec_engine(spec_runner(path, MTP), jobs)
    assert_greedy(reference, jobs, run.outputs)
    assert run.scheduler.drafts.stats.num_draft_tokens > 0


def test_mtp_without_a_prediction_layer_is_refused_in_one_line(tmp_path):
    """transformers writes num_nextn_predict_layers=1 without the layer's tensors, and
    Qwen3-Next without its mtp.* ones."""
    for name in ("deepseek-v3", "qwen3-next", "llama"):
        path = write_checkpoint(name, tmp_path / name)
        with pytest.raises(
            StartupError,
            match="speculative method mtp: .* has no prediction "
            r"layer \(DeepSeek's model.layers.\d+.eh_proj or Qwen's mtp.fc",
        ):
            spec_runner(path, MTP)


def test_under_tensor_parallelism_a_layer_without_its_own_head_copies_the_models(echo, tmp_path):
    """The model's embedding and head are split over the ranks and the layer runs on
    rank 0: there it loads whole copies of them (Qwen's layers never have their own)."""
    from types import SimpleNamespace

    from flagstop.executor.speculative.mtp import load_mtp

    path = shutil.copytree(echo[0], tmp_path / "headless")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.shared_head.head.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    target = spec_runner(path, None).model
    one_rank = SimpleNamespace(model=target, config=SimpleNamespace(model=str(path)),
                               tp=SimpleNamespace(size=1), dtype=torch.float32,
                               device=torch.device("cpu"), attention_backend=target.layers[0]
                               .self_attn.backend)  # fmt: skip
    assert load_mtp(one_rank).layer.shared_head.head is None  # the model's head serves
    two_ranks = SimpleNamespace(**{**vars(one_rank), "tp": SimpleNamespace(size=2)})
    layer = load_mtp(two_ranks).layer
    assert torch.equal(layer.shared_head.head.weight, tensors["lm_head.weight"])
    assert torch.equal(layer.embed_tokens.weight, tensors["model.layers.1.embed_tokens.weight"])


# Qwen's layout (Qwen3-Next, Qwen3.5): mtp.fc, mtp.pre_fc_norm_embedding/hidden,
# mtp.layers.0, mtp.norm; the embedding and head are the model's.


def add_qwen_prediction_layer(path, echo: bool) -> None:
    """mtp.layers.0: a copy of the last layer (a full-attention one), mtp.norm the
    model's norm. echo: fc passes only the token's embedding, pre_fc_norm_embedding is
    the identity ((1 + w) norms, w = 0) on embeddings of unit RMS (see
    add_prediction_layer); otherwise fc and the two input norms are random."""
    config = json.loads((path / "config.json").read_text())
    last, hidden = config["num_hidden_layers"] - 1, config["hidden_size"]
    tensors = load_file(path / "model.safetensors")
    if echo:
        embed = tensors["model.embed_tokens.weight"]
        tensors["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    for name in [n for n in tensors if n.startswith(f"model.layers.{last}.")]:
        tensors[name.replace(f"model.layers.{last}.", "mtp.layers.0.")] = tensors[name].clone()
    g = torch.Generator().manual_seed(5)
    fc = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), 1) if echo else \
        torch.randn(hidden, 2 * hidden, generator=g) * 0.05  # fmt: skip
    norms = torch.zeros(2, hidden) if echo else 0.1 * torch.randn(2, hidden, generator=g)
    tensors |= {"mtp.fc.weight": fc, "mtp.pre_fc_norm_embedding.weight": norms[0],
                "mtp.pre_fc_norm_hidden.weight": norms[1],
                "mtp.norm.weight": tensors["model.norm.weight"].clone()}  # fmt: skip
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


class QwenMtpReference:
    """Qwen's prediction layer in transformers' own modules (which do not run it): the
    model's last layer copied (as add_qwen_prediction_layer wrote it), its norm class,
    run over whole sequences under a causal mask, no cache."""

    def __init__(self, reference, path) -> None:
        modeling = sys.modules[type(reference).__module__]
        norm = next(getattr(modeling, n) for n in dir(modeling)
                    if n.endswith("RMSNorm") and "Gated" not in n)  # fmt: skip
        tensors = load_file(path / "model.safetensors")
        size, eps = reference.config.hidden_size, reference.config.rms_norm_eps
        self.reference, self.layer = reference, copy.deepcopy(reference.model.layers[-1])
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            self.norms[name] = norm(size, eps=eps)
            self.norms[name].weight.data = tensors[f"mtp.{name}.weight"]
        self.fc = tensors["mtp.fc.weight"]

    def _states(self, token_ids, hidden) -> torch.Tensor:
        """The layer's normed output at each position i, fed token i+1 and hidden[i]."""
        n, norms = len(token_ids), self.norms
        x = (
            torch.cat(
                (
                    norms["pre_fc_norm_embedding"](
                        self.reference.model.embed_tokens(torch.tensor([token_ids]))
                    ),
                    norms["pre_fc_norm_hidden"](hidden),
                ),
                -1,
            )
            @ self.fc.T
        )
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        rope = self.reference.model.rotary_emb(x, positions)
        out = self.layer(x, position_embeddings=rope, attention_mask=mask, position_ids=positions)
        return norms["norm"](out[0] if isinstance(out, tuple) else out)

    @torch.no_grad()
    def drafts(self, known: list[int], k: int) -> list[torch.Tensor]:
        """The logits of k chained drafts after the known tokens (the last one just
        sampled): the target's final hidden states over known[:-1], then each draft's
        own normed output chained with the draft."""
        hidden = self.reference.model(torch.tensor([known[:-1]])).last_hidden_state
        tokens, logits = list(known[1:]), []
        for _ in range(k):
            state = self._states(tokens, hidden)[:, -1:]
            logits.append(self.reference.lm_head(state)[0, 0])
            tokens.append(int(logits[-1].argmax()))
            hidden = torch.cat((hidden, state), 1)
        return logits


@pytest.fixture(scope="module", params=list(RECURRENT_VARIANTS))
def qwen(request, tmp_path_factory):
    path = write_checkpoint(request.param, tmp_path_factory.mktemp(f"mtp-{request.param}"))
    add_qwen_prediction_layer(path, echo=False)
    return path, load_reference(path)


def test_qwens_prediction_layer_drafts_what_transformers_modules_compute(qwen):
    """Every proposal: the first draft from the catch-up over the target's hidden
    states, the others chained, equal to the reference layer's argmax (up to the first
    near tie), through chunked prefill and decodes beside each other."""
    path, reference = qwen
    runner = spec_runner(path, MTP)
    seen = record_proposals(runner)
    jobs = spec_jobs(4, 5)
    run = spec_engine(runner, jobs, max_num_batched_tokens=24)
    assert_greedy(reference, jobs, run.outputs)
    checked = checked_proposals(seen[::3], QwenMtpReference(reference, path).drafts)
    assert checked > 2 * len(seen[::3])


@pytest.fixture(scope="module")
def qwen_echo(tmp_path_factory):
    """A two-layer Qwen3-Next (a gated DeltaNet layer whose outputs, its mixer's and its
    MLP's, are scaled down, then a full-attention one) with an echo prediction layer:
    its drafts mostly agree."""
    path = write_config(Qwen3NextConfig(
        **{**COMMON, "num_hidden_layers": 2}, layer_types=["linear_attention", "full_attention"],
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    ), tmp_path_factory.mktemp("mtp-qwen-echo"))  # fmt: skip
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.startswith("model.layers.0.") and
                 n.endswith(("out_proj.weight", "down_proj.weight"))]:  # fmt: skip
        tensors[name] *= 0.05
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    add_qwen_prediction_layer(path, echo=True)
    return path, load_reference(path)


def test_qwens_echo_layer_drafts_are_mostly_accepted_and_change_nothing(qwen_echo):
    path, reference = qwen_echo
    jobs = spec_jobs(6, 6)
    run = spec_engine(spec_runner(path, {"method": "qwen3_next_mtp", "num_speculative_tokens": 3}),
                  jobs)  # fmt: skip
    assert_greedy(reference, jobs, run.outputs)
    stats = run.scheduler.drafts.stats
    # Measured: 0.55 of drafts accepted (0.73 at k = 1).
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 0
    assert max(run.tokens_per_request_step) == 4


def test_qwen_mtp_under_preemption_chunks_and_seeded_sampling_changes_nothing(qwen_echo):
    path, reference = qwen_echo
    jobs = spec_jobs(6, 7)
    run = spec_engine(spec_runner(path, MTP, num_blocks=32), jobs, num_blocks=32,
                  max_num_batched_tokens=16)  # fmt: skip
    assert run.scheduler.num_preemptions > 0
    assert_greedy(reference, jobs, run.outputs)
    assert run.scheduler.drafts.stats.num_accepted_tokens > 0
    seeded = spec_jobs(5, 8, temperature=0.9, top_k=40, seed=7)
    plain = spec_engine(spec_runner(path, None), seeded).outputs
    assert spec_engine(spec_runner(path, MTP), seeded).outputs == plain
