"""EAGLE-3 draft heads as the speculative method `eagle3` (docs/speculative.md), in
process on the embedded model's size class: the target's captured layers equal
transformers' output_hidden_states there; every proposal is what the head computes
from them (a plain torch reading of the head's tensors: catch-up and chain); drafting
never changes what is emitted (greedy: transformers' tokens; seeded: the plain run's)
through chunked prefill and preemption; and a head that does not fit is refused in
one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flagstop.executor.sampling_params import SamplingParams
from flagstop.server import StartupError
from tests.helpers.checkpoints import load_reference, prompt
from tests.helpers.drafting import (
    assert_every_proposal_is_computed,
    assert_greedy,
    assert_preemption_stays_greedy,
    assert_prefix_hits_stay_greedy,
    assert_seeded_sampling_unchanged,
    plain_llama_layer,
    proposals_by_layout,
    rms_norm,
    spec_engine,
    spec_jobs,
    spec_runner,
)
from tools.inprocess import Job
from tools.make_eagle_head import SMALL_TARGET, write_eagle_head
from tools.make_model import write_model
from tools.train_eagle_head import TrainableHead, stored_names

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)
# Heads saved by the speculators library itself (make speculators-heads), for a target
# of SMALL_TARGET's shape, and probe.safetensors: the library's own forward of one.
SPECULATORS_HEADS = Path(__file__).parent / "data" / "eagle3"
# Its native heads: a Llama layer, a Qwen3 one, and the config's variants.
NATIVE_HEADS = ["native", "qwen3", "norm_before_fc", "fc_norm", "norm_output"]
VARIANT_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("target") / "tiny")
    return path, load_reference(path)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return write_eagle_head(target[0], tmp_path_factory.mktemp("head") / "eagle3")


def eagle_engine(runner, jobs, num_blocks=None, **config):
    """Without the prefix cache: the reference reads every position's state, and a
    prefix hit's positions were never seen by the head (docs/speculative.md)."""
    return spec_engine(runner, jobs, num_blocks, no_prefix_caching=True, **config)


def spec(head, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


class HeadReference:
    """The head computed from its tensors with plain torch, over a request's known
    tokens at once: the target's hidden states at its layers (transformers'), fused,
    then the layer over every position (causal), chained on its own drafts."""

    def __init__(self, head_dir, reference) -> None:
        self.t = load_file(head_dir / "model.safetensors")
        self.config = json.loads((head_dir / "config.json").read_text())
        if "transformer_layer_config" in self.config:  # the speculators library's layout
            self.t = {k.replace("layers.0.", "midlayer.", 1): v for k, v in self.t.items()}
            flags = {k: self.config.get(k) for k in VARIANT_FLAGS}
            aux = self.config["eagle_aux_hidden_state_layer_ids"]
            layer = self.config["transformer_layer_config"]
            self.config = {**layer, **flags, "rope_theta": layer["rope_parameters"]["rope_theta"],
                           "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}}  # fmt: skip
        self.aux = self.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        self.reference = reference

    def fc(self, fused: torch.Tensor) -> torch.Tensor:
        """The fused target layers' states through the variant's norms, then fc."""
        if self.config.get("norm_before_fc"):
            fused = self._norm(fused, "input_norm.weight")
        if self.config.get("fc_norm"):
            chunks = fused.chunk(len(self.aux), -1)
            fused = torch.cat([self._norm(c, f"fc_norm.{i}.weight") for i, c in enumerate(chunks)],
                              -1)  # fmt: skip
        return fused @ self.t["fc.weight"].T

    def head(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output -> the draft logits and the state chained from it
        (norm_output: the normed output, read by the head as it is)."""
        normed = self._norm(out, "norm.weight")
        chained = normed if self.config.get("norm_output") else out
        return normed @ self.t["lm_head.weight"].T, chained

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.t[name], self.config["rms_norm_eps"])

    def _layer(self, embeds: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        p = "midlayer."
        x = torch.cat((self._norm(embeds, p + "input_layernorm.weight"),
                       self._norm(states, p + "hidden_norm.weight")), -1)  # fmt: skip
        return plain_llama_layer(self.t, p, self.config, x, states)

    @torch.no_grad()
    def drafts(self, known: list[int], k: int) -> list[torch.Tensor]:
        """The logits of each of k drafts after `known` (over target ids)."""
        computed = known[:-1]  # the last known token is not computed yet
        hidden = self.reference(torch.tensor([computed]), output_hidden_states=True)
        fused = torch.cat([hidden.hidden_states[a][0] for a in self.aux], -1)
        states, tokens = self.fc(fused), list(known[1:])
        logits = []
        for _ in range(k):
            out = self._layer(self.t["embed_tokens.weight"][tokens], states)
            draft, chained = self.head(out[-1:])
            full = torch.full((self.t["embed_tokens.weight"].shape[0],), float("-inf"))
            full[torch.arange(draft.shape[-1]) + self.t["d2t"]] = draft[0]
            logits.append(full)
            tokens.append(int(full.argmax()))
            states = torch.cat((states, chained))
        return logits


def test_the_captured_layers_are_transformers_hidden_states_there(target, head):
    """One prompt computed in one chunk: the states the drafter is given are the
    residual stream entering each named layer (layer 0's: the embeddings)."""
    path, reference = target
    runner = spec_runner(path, spec(head))
    captured = []
    computed = runner.drafter.proposer.computed

    def capturing(batch, inputs):
        captured.append(inputs.aux_hidden.clone())
        computed(batch, inputs)

    runner.drafter.proposer.computed = capturing
    tokens = prompt(1, 20)
    eagle_engine(runner, [Job(tokens, 1, SamplingParams())])
    aux = json.loads((head / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ]
    assert 0 in aux  # the embedding's branch (no residual yet) is covered
    with torch.no_grad():
        hidden = reference(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[a][0] for a in aux], -1)
    torch.testing.assert_close(captured[0], expected, atol=1e-4, rtol=1e-4)


def test_every_proposal_is_what_the_head_computes(target, head):
    """The first draft from the catch-up over the target's captured states, the
    others chained on the head's own states, equal to the reference's argmax (up to
    the first near tie), through chunked prefill and decodes beside each other."""
    path, reference = target
    assert_every_proposal_is_computed(spec_runner(path, spec(head)), reference,
                                      HeadReference(head, reference).drafts)  # fmt: skip


def test_preempted_and_chunked_requests_keep_greedy_outputs(target, head):
    assert_preemption_stays_greedy(target[0], spec(head), target[1])


def test_seeded_sampling_with_eagle3_drafts_emits_what_it_would_without(target, head):
    assert_seeded_sampling_unchanged(target[0], spec(head))


def _broken(head, tmp_path, config=None, drop=()):
    path = shutil.copytree(head, tmp_path / "broken")
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, **(config or {})}))
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items() if k not in drop}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize(("config", "words"), [
    ({"hidden_size": 128, "head_dim": 32}, "reads hidden states of 128, the target's are 256"),
    ({"vocab_size": 1000}, "vocabulary is 1000 tokens, the target's 512"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 9, 2]}}, "layers 0..3"),
])  # fmt: skip
def test_a_head_for_another_target_is_refused_in_one_line(target, head, tmp_path, config, words):
    with pytest.raises(StartupError, match=r"speculative method eagle3: .*" + words) as e:
        spec_runner(target[0], spec(_broken(head, tmp_path, config)))
    assert "\n" not in str(e.value)


def test_a_head_missing_a_tensor_is_refused_in_one_line(target, head, tmp_path):
    with pytest.raises(StartupError, match=r"speculative method eagle3: .*lacks 1 tensors") as e:
        spec_runner(target[0], spec(_broken(head, tmp_path, drop=("fc.weight",))))
    assert "\n" not in str(e.value)


def test_a_head_without_safetensors_is_refused(target, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(StartupError, match=r"no \*\.safetensors or pytorch_model"):
        spec_runner(target[0], spec(tmp_path))


def test_a_trained_head_loads_and_drafts_losslessly(target, tmp_path):
    """tools/train_eagle_head.py (make eagle-head) at its smallest: text generated by
    the target, a few steps of training, a head written that the engine loads and
    drafts with, changing nothing."""
    from tools.train_eagle_head import train

    path, reference = target
    report = train(path, tmp_path / "trained", num_sequences=2, epochs=1, seed=0, held_out=2)
    assert (
        report["last_loss"] < report["first_loss"] * 2
        and len(report["held_out_top1_per_step"]) == 3
    )
    jobs = spec_jobs(3, 6)
    run = eagle_engine(spec_runner(path, spec(tmp_path / "trained")), jobs)
    assert_greedy(reference, jobs, run.outputs)
    assert run.scheduler.drafts.stats.num_draft_tokens > 0


def test_the_same_head_in_every_layout_drafts_the_same(target, head, tmp_path):
    """The original layout's safetensors, the same weights as a pytorch_model.bin (the
    original heads' files), and as the speculators library lays them out: identical
    proposals."""
    from tools.make_eagle_head import write_eagle_head

    as_bin = shutil.copytree(head, tmp_path / "bin")
    torch.save(load_file(as_bin / "model.safetensors"), as_bin / "pytorch_model.bin")
    (as_bin / "model.safetensors").unlink()
    speculators = write_eagle_head(target[0], tmp_path / "speculators", layout="speculators")
    assert "transformer_layer_config" in json.loads((speculators / "config.json").read_text())
    original, bin_file, theirs = proposals_by_layout(
        target[0], [spec(head), spec(as_bin), spec(speculators)])  # fmt: skip
    assert original == bin_file == theirs


def test_under_tensor_parallelism_a_head_takes_a_whole_copy_of_the_targets_embedding(
    target, tmp_path
):
    """The target's embedding is split over the ranks, and the head drafts on rank 0
    alone: without one of its own it reads the target's whole from the checkpoint
    (the stack test drafts with it on two ranks); a checkpoint without one is refused
    in one line."""
    from types import SimpleNamespace

    from flagstop.executor.speculative.eagle import whole_embedding

    def runner(model_dir):
        config = SimpleNamespace(model=str(model_dir))
        return SimpleNamespace(config=config, device=torch.device("cpu"), dtype=torch.float32)

    embedding = whole_embedding(runner(target[0]))
    stored = load_file(target[0] / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(embedding(torch.arange(len(stored))), stored)
    save_file({"lm_head.weight": stored}, tmp_path / "model.safetensors")
    with pytest.raises(StartupError, match=r"has no model\.embed_tokens\.weight or") as e:
        whole_embedding(runner(tmp_path))
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    """The target tests/data/eagle3's heads were made for."""
    path = write_model(tmp_path_factory.mktemp("small") / "tiny-h64", overrides=SMALL_TARGET)
    return path, load_reference(path)


@pytest.mark.parametrize("saved", [*NATIVE_HEADS, "converted"])
def test_heads_the_speculators_library_saved_propose_what_they_compute(small_target, saved):
    """native: an Eagle3DraftModel (the class the library trains) saved by its own
    save_pretrained, with a Llama layer, a Qwen3 one (q/k norms), and each norm
    variant of its config (norm_before_fc: gpt-oss's heads'; fc_norm; norm_output:
    EAGLE-3.1's); converted: an original-layout head (tools/make_eagle_head.py's)
    through the library's Eagle3Converter. Each loads, and its proposals are the
    plain torch reading of its tensors, greedy outputs unchanged."""
    path, reference = small_target
    head = SPECULATORS_HEADS / saved
    assert_every_proposal_is_computed(spec_runner(path, spec(head)), reference,
                                      HeadReference(head, reference).drafts)  # fmt: skip


@pytest.mark.parametrize("saved", NATIVE_HEADS)
def test_the_head_computes_what_the_speculators_library_computes(saved):
    """The library's own forward of each native head over seeded states and tokens,
    three training-time-test steps (each later step fed the states of the step before,
    attending to the earlier steps' keys): the plain torch reading's first step and
    the trainer's (tools/train_eagle_head.py) three steps draft the same tokens."""
    probe = load_file(SPECULATORS_HEADS / "probes" / f"{saved}.safetensors")
    aux, ids, library = probe["aux"], probe["input_ids"], probe["draft_tokens"]
    head = HeadReference(SPECULATORS_HEADS / saved, None)
    t = head.t
    first, _ = head.head(head._layer(t["embed_tokens.weight"][ids], head.fc(aux)))
    assert torch.equal(first.argmax(-1), library[0])
    trainer = TrainableHead(head.config, t["embed_tokens.weight"], t["lm_head.weight"], 3)
    trainer.load_state_dict({ours: t[stored] for stored, ours in stored_names(trainer).items()})
    tokens = torch.cat((ids[:1], ids, ids[:1]))  # the trainer reads token i+1 at i
    with torch.no_grad():
        steps = trainer(aux, tokens)
    assert len(steps) == len(library) == 3
    for s, logits in enumerate(steps):  # its step s at position i + s: the library's at i
        assert torch.equal(logits.argmax(-1)[s:], library[s][: len(ids) - s])


def test_prefix_hits_keep_greedy_outputs(target, head):
    path, reference = target
    assert_prefix_hits_stay_greedy(spec_runner(path, spec(head)), reference)


def test_a_gpt_oss_target_drafts_with_a_head_on_its_layers(tmp_path):
    """gpt-oss (window layers beside full ones, sinks, YaRN, experts): its layers are
    captured in its own forward as any family's (one Decoder), the head's cache lives
    on its full-attention group's blocks; every proposal is the plain reading's,
    greedy outputs transformers'."""
    path = write_model(tmp_path / "gpt-oss", arch="gpt_oss")
    reference = load_reference(path)
    head = write_eagle_head(path, tmp_path / "head")
    assert_every_proposal_is_computed(spec_runner(path, spec(head)), reference,
                                      HeadReference(head, reference).drafts)  # fmt: skip
