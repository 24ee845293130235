"""The sampler's logits processing (repetition, frequency and presence penalties,
logit_bias, min_p) against plain reference implementations of their formulas, and
prompt logprobs against transformers' log-softmax on the same weights: through the
executor's real path (persistent batch, chunked prefill, a preemption)."""

import pytest
import torch

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling import apply_min_p
from flagstop.executor.sampling_params import SamplingParams as SP
from tests.helpers.checkpoints import TOL, prompt, write_checkpoint
from tests.helpers.executor_harness import Harness
from tests.helpers.logits_reference import reference_processed


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference(tiny_model):
    from tests.helpers.checkpoints import load_reference

    return load_reference(tiny_model)


CASES = {
    "repetition": SP(repetition_penalty=1.8, logprobs=5),
    "repetition below 1": SP(repetition_penalty=0.6, logprobs=5),
    "frequency": SP(frequency_penalty=1.5, logprobs=5),
    "presence": SP(presence_penalty=-1.2, logprobs=5),
    "all three and a bias": SP(
        repetition_penalty=1.3,
        frequency_penalty=0.7,
        presence_penalty=0.4,
        logit_bias=((7, 3.0), (300, -50.0)),
        logprobs=5,
    ),
}


@torch.no_grad()
def test_penalties_and_bias_equal_their_formulas(tiny_model, reference):
    """Greedy under each setting, batched beside a plain request: every token is the
    argmax of the reference's processed logits, and its logprobs are theirs."""
    runner = ModelRunner(ExecutorConfig(model=str(tiny_model), num_blocks=256, block_size=4))
    harness = Harness(runner)
    prompts = {name: prompt(i, 9) for i, name in enumerate(CASES)}
    for name, params in CASES.items():
        harness.add(name, prompts[name], params)
    harness.add("plain", prompt(99, 6), SP(logprobs=5))
    outputs = {name: [] for name in harness.requests}
    checked = 0
    for step in range(10):
        num = {r: len(t.token_ids) - t.num_computed_tokens for r, t in harness.requests.items()}
        plan = harness._send(num)
        ids = harness.sampling_ids(plan)
        out = runner.execute(plan)
        for req_id, token, lp in zip(ids, out.token_ids, out.logprobs, strict=True):
            tokens = harness.requests[req_id].token_ids
            params = CASES.get(req_id, SP())
            raw = reference(torch.tensor([tokens])).logits[0, -1].float().tolist()
            expected = torch.tensor(reference_processed(
                raw, prompts.get(req_id, tokens), outputs[req_id], params))  # fmt: skip
            assert token == int(expected.argmax()), (req_id, step)
            logprobs = expected.log_softmax(-1)
            assert abs(lp[0] - float(logprobs[token])) < TOL
            torch.testing.assert_close(torch.tensor(lp[2]), logprobs.topk(5).values,
                                       atol=TOL, rtol=0)  # fmt: skip
            tokens.append(token)
            outputs[req_id].append(token)
            checked += 1
        if step == 5:  # recomputed from prompt + outputs: the counts come back
            harness.preempt("frequency")
    assert checked >= 50
    # The penalties changed something: a repeating greedy stream repeats less.
    assert outputs["frequency"] != outputs["plain"]


def test_min_p_keeps_the_tokens_within_its_ratio_of_the_likeliest():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    kept = apply_min_p(probs.log(), torch.tensor([0.5, 0.9])).isfinite()
    assert kept.tolist() == [[True, True, False, False], [True, True, True, True]]


def test_logit_bias_of_100_forces_a_token_and_min_p_1_is_greedy(tiny_model):
    runner = ModelRunner(ExecutorConfig(model=str(tiny_model), num_blocks=64, block_size=4))
    harness = Harness(runner)
    harness.add("forced", prompt(1, 5), SP(temperature=1.0, logit_bias=((42, 100.0),)))
    harness.add("greedy", prompt(2, 5), SP())
    harness.add("min_p", prompt(2, 5), SP(temperature=1.5, min_p=1.0, seed=3))
    for _ in range(4):
        num = {r: len(t.token_ids) - t.num_computed_tokens for r, t in harness.requests.items()}
        harness.step(num)
    requests = harness.requests
    assert requests["forced"].token_ids[5:] == [42] * 4
    assert requests["min_p"].token_ids == requests["greedy"].token_ids


@torch.no_grad()
@pytest.mark.parametrize("chunk", [64, 7], ids=["whole prompt", "chunked prefill"])
def test_prompt_logprobs_equal_transformers_log_softmax(tiny_model, reference, chunk):
    runner = ModelRunner(ExecutorConfig(model=str(tiny_model), num_blocks=256, block_size=4))
    harness = Harness(runner)
    tokens = prompt(5, 30)
    harness.add("p", tokens, SP(prompt_logprobs=3))
    harness.add("other", prompt(6, 12), SP())  # in the same steps, no prompt logprobs
    got: dict[int, tuple] = {}
    while harness.requests["p"].num_computed_tokens < len(tokens):
        num = {r: min(chunk, len(t.token_ids) - t.num_computed_tokens)
               for r, t in harness.requests.items()}  # fmt: skip
        plan = harness._send(num)
        ids = harness.sampling_ids(plan)
        out = runner.execute(plan)
        for req_id, token in zip(ids, out.token_ids, strict=True):
            harness.requests[req_id].token_ids.append(token)
        for part in out.prompt_logprobs or ():
            assert part.req_id == "p"
            assert part.token_ids == tokens[part.first_token : part.first_token + len(part.entries)]
            for i, entry in enumerate(part.entries, part.first_token):
                assert i not in got
                got[i] = entry
    assert sorted(got) == list(range(1, len(tokens)))  # every token but the first, once
    expected = reference(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    for i, (logprob, top_ids, top_values) in got.items():
        assert abs(logprob - float(expected[i - 1, tokens[i]])) < TOL
        top = expected[i - 1].topk(3)
        assert top_ids == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(top_values), top.values, atol=TOL, rtol=0)
