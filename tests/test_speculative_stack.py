"""Speculative decoding through the whole stack (router, scheduler, executor as real
processes): greedy streams token-exact against transformers with each proposer, on
two tensor-parallel ranks with preemption forced, a constrained request, vLLM's
counters, a step's tokens of a stream in one message, and kill -9 of the executor."""

import json

import grpc
import pytest

from flagstop.v1 import generation_pb2
from tests.helpers.metrics import scrape
from tests.helpers.streams import (
    Streams,
    assert_matches_reference,
    assert_token_exact,
    long_greedy_workload,
    run_concurrently,
    short_greedy_workload,
)
from tools.stack import free_port, generate, spawn, start_stack

pytestmark = pytest.mark.processes


def _spec(**config) -> list[str]:
    return ["--speculative-config", json.dumps(config)]


@pytest.fixture(scope="module")
def tp_spec_stack(model_dir, tmp_path_factory):
    """The checkpoint drafting for itself on two ranks, a 256-token pool and a 32-token
    budget: drafts truncated by the budget, preemption, prefix hits. Admission as soon as
    a first chunk fits (--no-reserve-full-isl) fills the pool in any arrival order, so
    the requests' growth preempts; whole-sequence admission preempted or not by the
    order the concurrent requests arrived in (a CI run's 12 preempted none)."""
    stack = start_stack(
        model_dir, tmp_path_factory.mktemp("spec-tp"),
        executor_args=["--num-blocks", "16", "--tensor-parallel-size", "2",
                       *_spec(method="draft_model", model=str(model_dir),
                              num_speculative_tokens=3)],
        scheduler_args=["--max-num-batched-tokens", "32", "--max-num-seqs", "8",
                        "--no-reserve-full-isl"],
    )  # fmt: skip
    yield stack
    assert stack.stop() == {"router": 0, "scheduler": 0, "executor": 0}, stack.logs()


def test_drafts_on_two_ranks_with_preemption_equal_transformers(tp_spec_stack, reference):
    before = tp_spec_stack.stats()
    requests = short_greedy_workload(3, n=12, shared_prefix=True)
    outputs = run_concurrently(tp_spec_stack, requests)
    assert_matches_reference(reference, requests, outputs)
    after = tp_spec_stack.wait_idle()
    assert after.num_preemptions > before.num_preemptions, "the pool was meant to force preemption"
    series = scrape(tp_spec_stack.metrics_ports["scheduler"])

    def total(name: str, **labels) -> float:
        key = f"vllm:spec_decode_{name}_total" + str(sorted({"model_name": "flagstop-tiny",
                                                            **labels}.items()))  # fmt: skip
        return series[key]

    assert total("num_drafts") > 0
    assert total("num_accepted_tokens") >= 0.98 * total("num_draft_tokens")
    assert total("num_accepted_tokens_per_pos", position="0") > 0


def test_a_step_of_drafts_reaches_the_client_as_one_message(tp_spec_stack, reference):
    prompt = [0, 17, 99, 4, 250]
    chunks = list(
        tp_spec_stack.generation().Generate(
            generation_pb2.GenerateRequest(
                prompt_token_ids=prompt, max_tokens=24, temperature=0, ignore_eos=True
            ),
            timeout=60,
        )
    )
    tokens = [t for c in chunks for t in c.token_ids]
    from tests.helpers.checkpoints import reference_generate

    assert tokens == reference_generate(reference, prompt, 24)
    assert max(len(c.token_ids) for c in chunks) > 1
    assert len(chunks) < 24


def test_a_request_can_turn_speculation_off(tp_spec_stack, reference):
    tokens, _, _ = generate(
        tp_spec_stack,
        prompt_token_ids=[0, 5, 6, 7],
        max_tokens=12,
        temperature=0,
        ignore_eos=True,
        num_speculative_tokens=0,
    )
    from tests.helpers.checkpoints import reference_generate

    assert tokens == reference_generate(reference, [0, 5, 6, 7], 12)
    with pytest.raises(grpc.RpcError) as error:
        generate(tp_spec_stack, prompt_token_ids=[0, 5], max_tokens=2, num_speculative_tokens=-1)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_json_schema_request_with_drafts_returns_its_schema(tp_spec_stack):
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    _, text, last = generate(
        tp_spec_stack, prompt="give me a number", max_tokens=60, temperature=0,
        structured_outputs=generation_pb2.StructuredOutputs(json_schema=json.dumps(schema)),
    )  # fmt: skip
    assert last.finish_reason == generation_pb2.FINISH_REASON_STOP, text
    assert set(json.loads(text)) == {"n"}


def test_n_choices_and_stop_strings_with_drafts_equal_without(tp_spec_stack):
    """The OpenAI front on the same path: n > 1, a stop string that lands inside a
    step's tokens, logprobs per token; the same reply with speculation off."""
    import openai

    client = openai.OpenAI(base_url=tp_spec_stack.base_url, api_key="none", max_retries=0)
    probe = client.completions.create(model="flagstop-tiny", prompt="The scheduler",
                                      max_tokens=24, temperature=0)  # fmt: skip
    stop = probe.choices[0].text[9:13]  # somewhere past a few multi-token steps
    replies = [
        client.completions.create(
            model="flagstop-tiny",
            prompt="The scheduler",
            max_tokens=24,
            temperature=0,
            n=2,
            stop=[stop],
            logprobs=1,
            extra_body={"num_speculative_tokens": k},
        )
        for k in (None, 0)
    ]
    spec, plain = ([(c.text, c.finish_reason, c.logprobs.tokens) for c in r.choices]
                   for r in replies)  # fmt: skip
    assert spec == plain
    assert spec[0][1] == "stop" and stop not in spec[0][0]
    # Each emitted token's logprob is its own row's, as a plain step reports it.
    for with_drafts, without in zip(replies[0].choices, replies[1].choices, strict=True):
        assert with_drafts.logprobs.token_logprobs == pytest.approx(
            without.logprobs.token_logprobs, abs=1e-4
        )


def test_greedy_streams_with_ngram_drafts_equal_transformers(model_dir, tmp_path, reference):
    """The other proposers through the stack: draft_model above (two ranks), suffix in
    tests/test_replicas.py (a replica lost mid-stream, greedy and seeded streams)."""
    spec = _spec(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                 prompt_lookup_max=3)  # fmt: skip
    stack = start_stack(model_dir, tmp_path, executor_args=["--num-blocks", "256", *spec])
    try:
        requests = short_greedy_workload(9, n=8)
        assert_matches_reference(reference, requests, run_concurrently(stack, requests))
    finally:
        assert stack.stop() == {"router": 0, "scheduler": 0, "executor": 0}, stack.logs()


def test_killed_executor_then_scheduler_with_drafts_streams_stay_token_exact(
    model_dir, tmp_path, reference
):
    spec = _spec(method="draft_model", model=str(model_dir), num_speculative_tokens=3)
    stack = start_stack(model_dir, tmp_path, executor_args=["--num-blocks", "512", *spec])
    try:
        streams = Streams(stack, long_greedy_workload(4))
        streams.wait_for_tokens(10)
        stack.kill("executor")
        stack.restart("executor")
        streams.wait_for_tokens(60)
        stack.kill("scheduler")
        stack.restart("scheduler")
        assert_token_exact(reference, streams)
    finally:
        stack.stop(10)


@pytest.mark.parametrize(
    ("config", "code", "line"),
    [
        (
            {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            2,
            "prompt_lookup_min 4 exceeds prompt_lookup_max 2",
        ),  # a bad setting: usage
        (
            {"method": "draft_model", "model": "OTHER_VOCAB"},
            1,
            "has vocab_size 509, the target 512",
        ),
    ],
    ids=["bad-config", "draft-of-another-vocabulary"],
)
def test_a_bad_speculative_config_stops_start_up_with_one_line(
    model_dir, tmp_path, config, code, line
):
    if config.get("model") == "OTHER_VOCAB":
        from tests.helpers.checkpoints import write_checkpoint

        config = {
            **config,
            "model": str(write_checkpoint("qwen2-tied-odd-vocab", tmp_path / "other")),
        }
    process = spawn("executor", ["-m", "flagstop.executor", "--model", str(model_dir),
                                 "--port", str(free_port()), "--metrics-port", "0",
                                 *_spec(**config)], tmp_path)  # fmt: skip
    assert process.wait(120) == code
    last = (tmp_path / "executor.log").read_text().strip().splitlines()[-1]
    assert last.startswith("flagstop-executor: ") and line in last, last


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_eagle_heads_draft_on_two_ranks_with_preemption_equal_transformers(
    model_dir, tmp_path, reference, method
):
    """An EAGLE-3 head and an EAGLE-1 one (tools/make_eagle_head.py: random, so their
    drafts are mostly rejected), neither with an embedding of its own, on two ranks
    with the tensor-parallel stack's pool and budget: rank 0 drafts on whole copies of
    the target's embedding (and EAGLE-1's, of its LM head), EAGLE-3's from the
    target's layers captured in its forward; the streams are transformers'."""
    from tools.make_eagle_head import write_eagle1_head, write_eagle_head

    if method == "eagle3":
        head = write_eagle_head(model_dir, tmp_path / "head", own_embed=False)
    else:
        head = write_eagle1_head(model_dir, tmp_path / "head")
    stack = start_stack(
        model_dir, tmp_path / "logs",
        executor_args=["--num-blocks", "16", "--tensor-parallel-size", "2",
                       *_spec(method=method, model=str(head), num_speculative_tokens=3)],
        scheduler_args=["--max-num-batched-tokens", "32", "--max-num-seqs", "8",
                        "--no-reserve-full-isl"],
    )  # fmt: skip
    try:
        before = stack.stats()
        requests = short_greedy_workload(3, n=12, shared_prefix=True)
        assert_matches_reference(reference, requests, run_concurrently(stack, requests))
        assert stack.wait_idle().num_preemptions > before.num_preemptions
        series = scrape(stack.metrics_ports["scheduler"])
        drafts = series["vllm:spec_decode_num_drafts_total" + str(sorted(
            {"model_name": "flagstop-tiny"}.items()))]  # fmt: skip
        assert drafts > 0
    finally:
        assert stack.stop() == {"router": 0, "scheduler": 0, "executor": 0}, stack.logs()
