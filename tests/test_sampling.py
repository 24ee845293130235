import pytest
import torch

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling import SamplingMetadata, apply_top_k_top_p, sample
from flagstop.executor.sampling_params import SamplingParams as SP
from tests.helpers.checkpoints import write_checkpoint
from tests.helpers.executor_harness import Harness


def metadata(n: int, temperature=1.0, top_k=None, top_p=1.0, **kw) -> SamplingMetadata:
    vocab = kw.pop("vocab", 4)
    temp = torch.full((n,), float(temperature))
    return SamplingMetadata(
        temperature=temp,
        top_p=torch.full((n,), float(top_p)),
        top_k=torch.full((n,), top_k or vocab),
        all_greedy=bool((temp == 0).all()),
        needs_top_k_top_p=top_k is not None or top_p < 1,
        seeded=kw.pop("seeded", []),
        banned=kw.pop("banned", []),
        num_logprobs=kw.pop("num_logprobs", None),
    )


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20_000
    tokens = sample(probs.log().repeat(n, 1), metadata(n)).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=4) / n
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_temperature_zero_is_greedy_beside_sampled_rows():
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]] * 64)
    meta = metadata(64)
    meta.temperature[::2] = 0
    tokens = sample(logits, meta).token_ids
    assert all(t == 1 for t in tokens[::2])
    assert 2 in tokens[1::2], "sampled rows should sometimes pick the close second"


def test_top_k_and_top_p_masks():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    kept = lambda out: (out > float("-inf")).squeeze(0).tolist()  # noqa: E731
    assert kept(apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))) == [
        False,
        True,
        True,
        False,
    ]
    # Softmax of [4, 3, 2, 1] is about [0.64, 0.24, 0.09, 0.03]: 0.8 needs the top two.
    assert kept(apply_top_k_top_p(logits, torch.tensor([4]), torch.tensor([0.8]))) == [
        False,
        True,
        True,
        False,
    ]
    assert kept(apply_top_k_top_p(logits, torch.tensor([4]), torch.tensor([0.1]))) == [
        False,
        True,
        False,
        False,
    ]
    assert all(kept(apply_top_k_top_p(logits, torch.tensor([4]), torch.tensor([1.0]))))


def test_min_tokens_bans_the_stop_tokens():
    logits = torch.tensor([[0.0, 9.0, 1.0, 0.0]])
    assert sample(logits.clone(), metadata(1, temperature=0, banned=[(0, (1,))])).token_ids == [2]


def test_logprobs_of_the_sampled_and_top_tokens():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.0, 0.0, 5.0, 0.0]])
    out = sample(logits.clone(), metadata(2, temperature=0, num_logprobs=[2, None]))
    expected = logits[0].log_softmax(-1)
    chosen, top_ids, top_values = out.logprobs[0]
    assert out.token_ids == [1, 2] and top_ids == [1, 2] and out.logprobs[1] is None
    assert chosen == pytest.approx(expected[1].item())
    assert top_values == pytest.approx(expected[[1, 2]].tolist())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


def run(model_dir, requests: dict[str, tuple[list[int], SP]], steps: int, preempt_at=None):
    runner = ModelRunner(ExecutorConfig(model=str(model_dir), num_blocks=256, block_size=4))
    harness = Harness(runner)
    for req_id, (prompt, params) in requests.items():
        harness.add(req_id, prompt, params)
    outputs = {r: [] for r in requests}
    for step in range(steps):
        if step == preempt_at:
            for req_id in requests:
                harness.preempt(req_id)
        num_tokens = {
            r: len(t.token_ids) - t.num_computed_tokens for r, t in harness.requests.items()
        }
        for req_id, token in harness.step(num_tokens).items():
            outputs[req_id].append(token)
    return outputs


def test_a_seeded_request_gives_the_same_tokens_alone_and_batched(tiny_model):
    seeded = ([0, 40, 41, 42, 43], SP(temperature=1.0, top_p=0.95, top_k=200, seed=1234))
    alone = run(tiny_model, {"s": seeded}, 12)["s"]
    others = {f"o{i}": ([0, 7 + i, 9, 11 * i], SP(temperature=0.8, seed=None)) for i in range(5)}
    greedy = {"g": ([0, 3, 4], SP())}
    batched = run(tiny_model, {**others, "s": seeded, **greedy}, 12)["s"]
    assert batched == alone
    # And across a preemption, recomputed: the noise depends on seed and position only.
    assert run(tiny_model, {"s": seeded, **greedy}, 12, preempt_at=6)["s"] == alone
    differently_seeded = run(tiny_model, {"s": (seeded[0], SP(temperature=1.0, seed=99))}, 12)
    assert differently_seeded["s"] != alone
