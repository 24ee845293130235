"""EAGLE-1 heads (the speculative method `eagle`: executor/speculative/eagle1.py) on
the embedded model's shape, in process: every proposal is what the head computes (a
plain torch reading of its tensors: fc over [embedding, the target's final state], a
Llama layer without its input norm, the target's LM head), the first draft from the
catch-up and the others chained on its own states; greedy output equals
transformers' through chunks and preemption; seeded sampling equals plain decoding;
a head that does not fit is refused in one line."""

import json
import shutil

import pytest
import torch

from flagstop.server import StartupError
from tests.helpers.checkpoints import load_reference
from tests.helpers.drafting import (
    assert_every_proposal_is_computed,
    assert_preemption_stays_greedy,
    assert_prefix_hits_stay_greedy,
    assert_seeded_sampling_unchanged,
    plain_llama_layer,
    proposals_by_layout,
    spec_runner,
)
from tools.make_eagle_head import write_eagle1_head
from tools.make_model import write_model

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("target") / "tiny")
    return path, load_reference(path)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return write_eagle1_head(target[0], tmp_path_factory.mktemp("head") / "eagle1")


def spec(head, k: int = 3) -> dict:
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": k}


class Eagle1Reference:
    """The head over a request's known tokens at once: the target's final hidden
    states (transformers'), then fc and the layer over every position (causal),
    chained on its own outputs; the target's embedding and head."""

    def __init__(self, head_dir, reference) -> None:
        self.t = torch.load(head_dir / "pytorch_model.bin")
        self.config = json.loads((head_dir / "config.json").read_text())
        self.reference = reference
        self.embed = reference.model.embed_tokens.weight
        self.head = reference.lm_head.weight

    def _layer(self, embeds: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        x = torch.cat((embeds, states), -1) @ self.t["fc.weight"].T + self.t["fc.bias"]
        return plain_llama_layer(self.t, "layers.0.", self.config, x, x)

    @torch.no_grad()
    def drafts(self, known: list[int], k: int) -> list[torch.Tensor]:
        """The logits of each of k drafts after `known`."""
        computed = torch.tensor([known[:-1]])  # the last known token is not computed yet
        states = self.reference.model(computed).last_hidden_state[0]
        tokens, logits = list(known[1:]), []
        for _ in range(k):
            out = self._layer(self.embed[tokens], states)
            logits.append(out[-1] @ self.head.T)
            tokens.append(int(logits[-1].argmax()))
            states = torch.cat((states, out[-1:]))
        return logits


def test_every_proposal_is_what_the_head_computes(target, head):
    """Through chunked prefill and decodes beside each other, each draft equal to
    the reference's argmax (up to the first near tie)."""
    path, reference = target
    assert_every_proposal_is_computed(spec_runner(path, spec(head)), reference,
                                      Eagle1Reference(head, reference).drafts)  # fmt: skip


def test_preempted_and_chunked_requests_keep_greedy_outputs(target, head):
    assert_preemption_stays_greedy(target[0], spec(head), target[1])


def test_seeded_sampling_with_eagle_drafts_emits_what_it_would_without(target, head):
    assert_seeded_sampling_unchanged(target[0], spec(head))


def _broken(head, tmp_path, config=None, drop=()):
    path = shutil.copytree(head, tmp_path / "broken")
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, **(config or {})}))
    tensors = torch.load(path / "pytorch_model.bin")
    torch.save({k: v for k, v in tensors.items() if k not in drop}, path / "pytorch_model.bin")
    return path


@pytest.mark.parametrize(("config", "drop", "words"), [
    ({"hidden_size": 128, "head_dim": 32}, (), "hidden size is 128, the target's 256"),
    ({"vocab_size": 1000}, (), "vocabulary is 1000 tokens, the target's 512"),
    ({"speculators_model_type": "eagle"}, (), "speculators library's format is not run"),
    ({}, ("fc.weight",), "lacks 1 tensors"),
])  # fmt: skip
def test_a_head_that_does_not_fit_is_refused_in_one_line(target, head, tmp_path, config, drop,
                                                          words):  # fmt: skip
    with pytest.raises(StartupError, match=r"speculative method eagle: .*" + words) as e:
        spec_runner(target[0], spec(_broken(head, tmp_path, config, drop)))
    assert "\n" not in str(e.value)


def test_under_tensor_parallelism_the_head_reads_the_targets_lm_head_whole(target):
    """The target's head is split over the ranks and the head drafts on rank 0 alone:
    it reads a whole copy from the target's checkpoint (the stack test drafts with it
    on two ranks)."""
    from types import SimpleNamespace

    from flagstop.executor.speculative.eagle import whole_target_tensor
    from flagstop.executor.speculative.eagle1 import TARGET_HEAD

    path, reference = target
    runner = SimpleNamespace(config=SimpleNamespace(model=str(path)), device=torch.device("cpu"),
                             dtype=torch.float32)  # fmt: skip
    head = whole_target_tensor(runner, TARGET_HEAD, "eagle", "an LM head")
    assert torch.equal(head, reference.lm_head.weight)


def test_prefix_hits_keep_greedy_outputs(target, head):
    path, reference = target
    assert_prefix_hits_stay_greedy(spec_runner(path, spec(head)), reference)


def test_vllms_wrapped_config_loads_the_same_head(target, head, tmp_path):
    """vLLM's converted EAGLE-1 heads nest the Llama config under `model` (model_type
    eagle, eagle_fc_bias): the same weights propose the same drafts."""
    wrapped = shutil.copytree(head, tmp_path / "wrapped")
    config = json.loads((head / "config.json").read_text())
    (wrapped / "config.json").write_text(json.dumps(
        {"model_type": "eagle", "model": config, "eagle_fc_bias": True}))  # fmt: skip
    original, theirs = proposals_by_layout(target[0], [spec(head), spec(wrapped)])
    assert original == theirs
