"""LoRA adapters in PEFT's layout, made by peft itself on our random base model (A and B
both random: peft initialises B to zeros, which would test nothing): logits against
peft's merged model on transformers, a batch mixing adapters and the base model, the
slots refilled least recently used first, and the adapters flagstop refuses."""

import json

import pytest
import torch

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.lora.adapter import AdapterError
from flagstop.executor.model_runner import ModelRunner
from tests.helpers.checkpoints import TOL, load_reference, prompt, reference_logits
from tests.helpers.executor_harness import Harness

TARGETS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
    "q-v": ["q_proj", "v_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from tests.helpers.checkpoints import write_checkpoint

    return write_checkpoint("llama", tmp_path_factory.mktemp("base"))


def make_adapter(base, out, targets: str, rank: int, seed: int, **config):
    """peft's LoRA on `base` for TARGETS[targets], its weights seeded random (B too,
    at a size that moves the logits by some tenths), saved as peft saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    settings = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS[targets], **config)
    peft_model = get_peft_model(model, settings)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    peft_model.save_pretrained(out)
    return out


def merged_reference(base, adapter):
    """transformers with peft's adapter merged into the weights (merge_and_unload)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_reference(base), adapter).merge_and_unload().eval()


def runner(base, adapters: dict, max_loras: int = 4, max_lora_rank: int = 32, **kw):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    config = ExecutorConfig(model=str(base), num_blocks=64, block_size=4, max_num_seqs=16,
                            max_loras=max_loras, max_lora_rank=max_lora_rank,
                            lora_modules=modules, **kw)  # fmt: skip
    return ModelRunner(config)


def run_steps(harness: Harness, steps: list[dict[str, int]]) -> list[tuple[str, list, object]]:
    """(request, its context, logits) of every sampling request at each step."""
    out = []
    for step in steps:
        for req_id, got in harness.logits(step).items():
            out.append((req_id, harness.requests[req_id].token_ids[:-1], got))
    return out


@pytest.mark.parametrize(("targets", "rank", "rslora"),
                         [("attention", 8, False), ("mlp", 8, False), ("q-v", 16, False),
                          ("all", 32, True)])  # fmt: skip
def test_logits_equal_peft_merged_on_transformers(base, tmp_path, targets, rank, rslora):
    adapter = make_adapter(base, tmp_path / "a", targets, rank, seed=rank, use_rslora=rslora)
    harness = Harness(runner(base, {"a": adapter}))
    harness.add("x", prompt(1, 11), lora_name="a")
    harness.add("y", prompt(2, 6), lora_name="a")
    reference = merged_reference(base, adapter)
    plain = load_reference(base)
    for req_id, context, got in run_steps(harness, [{"x": 11, "y": 6}, {"x": 1, "y": 1}]):
        expected = reference_logits(reference, context)
        torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
        assert (expected - reference_logits(plain, context)).abs().max() > 100 * TOL, req_id


def test_a_batch_mixing_three_adapters_and_the_base_gives_each_its_own(base, tmp_path):
    """Prefills and decodes of three adapters (of other ranks and targets) and the base
    model in the same steps, a prompt in two chunks: each request's logits are its own
    model's."""
    adapters = {"a": make_adapter(base, tmp_path / "a", "attention", 8, seed=1),
                "b": make_adapter(base, tmp_path / "b", "mlp", 16, seed=2),
                "c": make_adapter(base, tmp_path / "c", "all", 4, seed=3)}  # fmt: skip
    harness = Harness(runner(base, adapters))
    owners = {"ra": "a", "rb": "b", "rc": "c", "rbase": "", "rb2": "b"}
    for i, (req_id, name) in enumerate(owners.items()):
        harness.add(req_id, prompt(10 + i, 5 + 2 * i), lora_name=name)
    steps = [{"ra": 5, "rb": 7, "rc": 4}, {"ra": 1, "rb": 1, "rc": 5, "rbase": 11, "rb2": 13},
             {"ra": 1, "rb": 1, "rc": 1, "rbase": 1, "rb2": 1}]  # fmt: skip
    references = {name: merged_reference(base, path) for name, path in adapters.items()}
    references[""] = load_reference(base)
    results = run_steps(harness, steps)
    assert {req_id for req_id, _, _ in results} == set(owners)
    for req_id, context, got in results:
        expected = reference_logits(references[owners[req_id]], context)
        torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def test_slots_are_refilled_least_recently_used_first(base, tmp_path):
    """Two slots, three adapters: each step's adapters are resident, the one run least
    recently gives its slot up, and a step of three is refused."""
    adapters = {n: make_adapter(base, tmp_path / n, "q-v", 8, seed=s)
                for s, n in enumerate("abc")}  # fmt: skip
    engine = runner(base, adapters, max_loras=2)
    harness = Harness(engine)
    for name in "abc":
        harness.add(name, prompt(ord(name), 6), lora_name=name)
    references = {name: merged_reference(base, path) for name, path in adapters.items()}
    for step in ({"a": 6, "b": 6}, {"c": 6, "a": 1}, {"b": 1, "c": 1}):
        for req_id, context, got in run_steps(harness, [step]):
            torch.testing.assert_close(got, reference_logits(references[req_id], context),
                                       atol=TOL, rtol=0)  # fmt: skip
        assert set(engine.lora.slots) == set(step)
    with pytest.raises(AdapterError, match="3 adapters in one step, above --max-loras 2"):
        harness.logits({"a": 1, "b": 1, "c": 1})


def peft_dir(base, tmp_path, **changes):
    path = make_adapter(base, tmp_path / "bad", "q-v", 8, seed=0)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return path


@pytest.mark.parametrize(("changes", "message"), [
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head'] is not supported"),
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"peft_type": "IA3"}, "peft_type='IA3'; only LORA is served"),
    ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern={'q_proj': 4} is not supported"),
])  # fmt: skip
def test_adapters_flagstop_cannot_serve_are_refused_naming_the_field(
    base, tmp_path, changes, message
):
    with pytest.raises(AdapterError, match=message.replace("[", r"\[").replace("]", r"\]")):
        runner(base, {"bad": peft_dir(base, tmp_path, **changes)})


def test_a_rank_above_the_limit_and_another_models_adapter_are_refused(base, tmp_path):
    from tests.helpers.checkpoints import write_checkpoint

    big = make_adapter(base, tmp_path / "big", "q-v", 32, seed=0)
    with pytest.raises(AdapterError, match="has rank 32, above --max-lora-rank 16"):
        runner(base, {"big": big}, max_lora_rank=16)
    other = write_checkpoint("qwen3", tmp_path / "qwen3")  # head_dim 48: other shapes
    foreign = make_adapter(other, tmp_path / "foreign", "q-v", 8, seed=0)
    with pytest.raises(AdapterError, match="do not fit the base layer's"):
        runner(base, {"foreign": foreign})
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        runner(base, {"none": tmp_path})
    with pytest.raises(AdapterError, match="expected name=DIR"):
        runner(base, {"": big})


@pytest.mark.processes
def test_two_ranks_give_the_logits_of_one(base, tmp_path):
    """An adapter on every module over two ranks (B's rows of each rank's outputs, A's
    columns of its inputs for o and down), beside base-model requests, through
    prefills, prefix hits, a preemption and its recompute: the logits of one rank."""
    from flagstop.executor.models.config import ModelConfig
    from tests.helpers.tp_scenarios import config, run_group, run_scenarios

    adapter = make_adapter(base, tmp_path / "a", "all", 8, seed=4)
    spec = f"a={adapter}"
    vocab = ModelConfig.from_pretrained(base).vocab_size
    single = run_scenarios(Harness(ModelRunner(config(base, lora_modules=(spec,)))), vocab, "a")
    parallel = run_group(base, tmp_path / "tp2.pt", 2, lora=spec)
    assert len(parallel) == len(single) >= 10
    for context, one in single:
        torch.testing.assert_close(parallel[tuple(context)], one, atol=TOL, rtol=0)
