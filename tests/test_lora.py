"""LoRA adapters in PEFT's layout, made by peft itself on our random base model (A and B
both random: peft initialises B to zeros, which would test nothing): logits against
peft's merged model on transformers, a batch mixing adapters and the base model, the
slots refilled least recently used first, and the adapters flagstop refuses."""

import json
import time

import pytest
import torch

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.lora.adapter import AdapterError
from flagstop.executor.model_runner import ModelRunner
from tests.helpers.adapters import http, make_adapter, merged_reference
from tests.helpers.checkpoints import TOL, load_reference, prompt, reference_logits
from tests.helpers.executor_harness import Harness

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from tests.helpers.checkpoints import write_checkpoint

    return write_checkpoint("llama", tmp_path_factory.mktemp("base"))


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
    with pytest.raises(ValueError, match="each adapter is name=DIR"):
        runner(base, {"": big})
    with pytest.raises(ValueError, match="--lora-modules needs --max-loras"):
        runner(base, {"big": big}, max_loras=0)


def test_start_up_refuses_an_adapter_named_twice_or_like_the_base_model(base, tmp_path):
    adapter = str(make_adapter(base, tmp_path / "a", "q-v", 8, seed=3))
    for modules, message in (([f"{base.name}={adapter}"], "is the base model's"),
                             ([f"a={adapter}", f"a={adapter}"], "'a' is named twice")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            ExecutorConfig(model=str(base), max_loras=2, lora_modules=modules)


@pytest.mark.processes
def test_two_ranks_give_the_logits_of_one(base, tmp_path):
    """An adapter on every module over two ranks (B's rows of each rank's outputs, A's
    columns of its inputs for o and down), beside base-model requests, through
    prefills, prefix hits, a preemption and its recompute: the logits of one rank."""
    from flagstop.executor.models.config import ModelConfig
    from tests.helpers.tp_scenarios import config, run_group, run_scenarios

    adapter = make_adapter(base, tmp_path / "a", "all", 8, seed=4)
    module = f"a={adapter}"
    vocab = ModelConfig.from_pretrained(base).vocab_size
    single = run_scenarios(Harness(ModelRunner(config(base, lora_modules=(module,)))), vocab, "a")
    parallel = run_group(base, tmp_path / "tp2.pt", 2, lora=module)
    assert len(parallel) == len(single) >= 10
    for context, one in single:
        torch.testing.assert_close(parallel[tuple(context)], one, atol=TOL, rtol=0)


# -- the stack ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(base, root / "a", "attention", 8, seed=11),
            "b": make_adapter(base, root / "b", "mlp", 16, seed=12),
            "c": make_adapter(base, root / "c", "all", 4, seed=13)}  # fmt: skip


@pytest.fixture(scope="module")
def references(base, adapters):
    out = {name: merged_reference(base, path) for name, path in adapters.items()}
    out[""] = load_reference(base)
    return out


@pytest.mark.processes
def test_the_stack_serves_adapters_by_name_loads_them_at_runtime_and_keeps_them(
    base, adapters, references, tmp_path
):
    """Two slots, adapter a from start-up: /v1/models lists it under the base; greedy
    streams of a, b and c (loaded at runtime while a streams) and the base, all at
    once, are each peft's merged model's; unknown adapters are 404 / NOT_FOUND; the
    same prompt under two adapters shares no block; a killed executor comes back with
    the adapter loaded at runtime and the streams go on token-exact."""
    import grpc

    from flagstop.v1 import generation_pb2
    from tests.helpers.checkpoints import reference_generate
    from tests.helpers.streams import Streams
    from tools.stack import generate, start_stack

    executor_args = ["--num-blocks", "256", "--max-loras", "2",
                     "--lora-modules", f"a={adapters['a']}"]  # fmt: skip
    stack = start_stack(base, tmp_path, executor_args=executor_args)
    try:
        status, listed = http(stack, "GET", "/v1/models")
        assert status == 200
        assert [(m["id"], m["parent"]) for m in listed["data"]] == [(base.name, None),
                                                                     ("a", base.name)]  # fmt: skip
        status, error = http(stack, "POST", "/v1/completions",
                             {"model": "nope", "prompt": [0, 5, 6], "max_tokens": 2})  # fmt: skip
        assert status == 404 and error["error"]["code"] == "model_not_found", error
        with pytest.raises(grpc.RpcError) as refused:
            generate(stack, prompt_token_ids=[0, 5], max_tokens=2, lora_name="nope")
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND

        prompts = {name: [0, *range(30 + 7 * i, 50 + 7 * i)] for i, name in enumerate("abc")}
        prompts[""] = prompts["a"]  # the same prompt: never a's cached blocks
        streams = Streams(stack, [(prompts["a"], 120)], lora_name="a")
        streams.wait_for_tokens(5)
        status, text = http(stack, "POST", "/v1/load_lora_adapter",
                            {"lora_name": "b", "lora_path": str(adapters["b"])})  # fmt: skip
        assert status == 200 and "added successfully" in text, text
        stub = stack.generation()
        stub.LoadLoRAAdapter(generation_pb2.LoadLoRAAdapterRequest(
            lora_name="c", lora_path=str(adapters["c"])), timeout=60)  # fmt: skip
        runs = {name: Streams(stack, [(prompts[name], 60)], lora_name=name) for name in "bc"}
        runs[""] = Streams(stack, [(prompts[""], 60)])
        assert streams.results()[0].usage.completion_tokens == 120
        assert streams.tokens[0] == reference_generate(references["a"], prompts["a"], 120)
        for name, run in runs.items():
            run.results()
            assert run.tokens[0] == reference_generate(references[name], prompts[name], 60), name
        assert stack.stats().prefix_cache_hits == 0  # a's prompt again, on the base model

        # The executor dies: the new one gets b and c back from the scheduler.
        streams = Streams(stack, [(prompts["b"], 150)], lora_name="b")
        streams.wait_for_tokens(10)
        stack.kill("executor")
        stack.restart("executor")
        streams.results()
        assert streams.tokens[0] == reference_generate(references["b"], prompts["b"], 150)

        # Constrained and seeded under an adapter: the choice holds, the seed repeats.
        choice = generation_pb2.StructuredOutputs(
            choice=generation_pb2.Choices(choices=["yes", "no", "maybe"]))  # fmt: skip
        _, text, _ = generate(stack, prompt_token_ids=[0, 5, 6], max_tokens=8, lora_name="c",
                              structured_outputs=choice)  # fmt: skip
        assert text in ("yes", "no", "maybe"), text
        sampled = dict(prompt_token_ids=[0, 5, 6], max_tokens=12, lora_name="c",
                       temperature=1.0, seed=7, ignore_eos=True)  # fmt: skip
        assert generate(stack, **sampled)[0] == generate(stack, **sampled)[0]

        # c unloaded while b streams: b goes on, token-exact; c is gone.
        streams = Streams(stack, [(prompts["b"], 60)], lora_name="b")
        streams.wait_for_tokens(3)
        status, text = http(stack, "POST", "/v1/unload_lora_adapter", {"lora_name": "c"})
        assert status == 200, text
        streams.results()
        assert streams.tokens[0] == reference_generate(references["b"], prompts["b"], 60)
        status, error = http(stack, "POST", "/v1/completions",
                             {"model": "c", "prompt": [0, 5, 6], "max_tokens": 2})  # fmt: skip
        assert status == 404, error
        status, error = http(stack, "POST", "/v1/unload_lora_adapter", {"lora_name": "c"})
        assert status == 404, error
        status, error = http(stack, "POST", "/v1/load_lora_adapter",
                             {"lora_name": "bad", "lora_path": str(tmp_path)})  # fmt: skip
        assert status == 400 and "no adapter_config.json" in error["error"]["message"], error
        stats = stack.wait_idle()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        assert stack.stop() == {"router": 0, "scheduler": 0, "executor": 0}, stack.logs()


@pytest.mark.processes
def test_an_adapters_requests_stay_on_the_replica_where_it_runs_until_that_one_is_busy(
    base, adapters, tmp_path
):
    """Two simulated replicas (a load-test tool: adapters registered, no model), both
    holding x and y, two slots each, --balance-abs-threshold 4: x's requests follow x to
    the replica it runs on (lora-warm) while that replica is not far busier than the
    other, then the next one goes where a slot is free (lora-room); the replica
    exports its running adapters as vllm:lora_requests_info."""
    from tests.helpers.metrics import scrape
    from tests.helpers.streams import Streams
    from tools.stack import start_replicas

    executor_args = ["--simulate", "--simulate-base-ms", "5", "--max-loras", "2",
                     "--lora-modules", f"x={adapters['a']},y={adapters['b']}"]  # fmt: skip
    stack = start_replicas(base, tmp_path, 2, executor_args=executor_args,
                           router_args=["--balance-abs-threshold", "4"])  # fmt: skip
    try:
        streams = []

        def running() -> list[int]:
            return [stack.stats(f"scheduler-{i}").num_running for i in range(2)]

        for k in range(6):
            streams.append(Streams(stack, [([0, 7, k + 3], 400)], lora_name="x"))
            deadline = time.monotonic() + 10
            while sum(running()) < k + 1:
                assert time.monotonic() < deadline, running()
                time.sleep(0.005)
            # Three more steps of each busy replica, each reporting its load (x running)
            # to the router, and time for the router to read them.
            busy = [i for i, n in enumerate(running()) if n]
            reported = {i: stack.stats(f"scheduler-{i}").step_id + 3 for i in busy}
            while any(stack.stats(f"scheduler-{i}").step_id < n for i, n in reported.items()):
                assert time.monotonic() < deadline
                time.sleep(0.005)
            time.sleep(0.05)
            if k == 0:
                first = running().index(1)
                info = scrape(stack.metrics_ports[f"scheduler-{first}"])
                assert any("vllm:lora_requests_info" in series and "'running_lora_adapters', 'x'"
                           in series for series in info), info  # fmt: skip
        placed = running()
        assert placed[first] == 5 and placed[1 - first] == 1, placed
        for stream in streams:
            stream.results()
    finally:
        stack.stop(10)


def test_drafts_and_preemption_under_adapters_keep_each_ones_greedy_outputs(base, adapters):
    """Speculative decoding with the base model drafting for itself (the draft runs no
    adapter, so it is accepted less often under one) and a pool that forces
    preemption, three adapters and the base over two slots: every output is what its
    merged model decodes greedily."""
    from flagstop.scheduler_svc.core.config import SchedulerConfig
    from tests.helpers.checkpoints import reference_generate
    from tools.inprocess import Job, run_engine

    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(base)}
    engine = runner(base, adapters, max_loras=2, speculative_config=spec)
    names = ["a", "b", "c", "", "a", "b"]
    jobs = [Job(prompt(40 + i, 9 + 3 * i), 30, lora_name=n) for i, n in enumerate(names)]
    config = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=16, max_model_len=256,
                             block_size=4, num_speculative_tokens=3, max_loras=2)  # fmt: skip
    run = run_engine(engine, jobs, config, num_blocks=40)
    assert run.scheduler.num_preemptions > 0
    stats = run.scheduler.drafts.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    references = {name: merged_reference(base, path) for name, path in adapters.items()}
    references[""] = load_reference(base)
    for job, out in zip(jobs, run.outputs, strict=True):
        assert out == reference_generate(references[job.lora_name], job.prompt, 30), job.lora_name


@pytest.mark.processes
def test_an_adapter_loaded_at_runtime_reaches_every_rank(base, adapters, references, tmp_path):
    """Two ranks: rank 0 reads the adapter, the other reads its share on a thread when
    rank 0 tells it (between two steps); greedy streams of it, and of the base model
    beside it, are the merged model's."""
    from flagstop.v1 import generation_pb2
    from tests.helpers.checkpoints import reference_generate
    from tests.helpers.streams import Streams
    from tools.stack import start_stack

    executor_args = ["--num-blocks", "128", "--max-loras", "1", "--tensor-parallel-size", "2"]
    stack = start_stack(base, tmp_path, executor_args=executor_args)
    try:
        plain = Streams(stack, [([0, 9, 8, 7], 80)])
        plain.wait_for_tokens(3)
        stack.generation().LoadLoRAAdapter(generation_pb2.LoadLoRAAdapterRequest(
            lora_name="c", lora_path=str(adapters["c"])), timeout=60)  # fmt: skip
        tuned = Streams(stack, [([0, 9, 8, 7], 40), ([0, 21, 22], 40)], lora_name="c")
        tuned.results()
        plain.results()
        assert plain.tokens[0] == reference_generate(references[""], [0, 9, 8, 7], 80)
        for (prompt, n), tokens in zip(tuned.requests, tuned.tokens, strict=True):
            assert tokens == reference_generate(references["c"], prompt, n)
    finally:
        assert stack.stop() == {"router": 0, "scheduler": 0, "executor": 0}, stack.logs()


def test_a_request_of_an_adapter_the_executor_lacks_fails_alone(base, tmp_path):
    """Unloaded while it ran, or never sent to this executor: its token is -1 (the
    scheduler ends it with an error), the batch goes on."""
    adapter = make_adapter(base, tmp_path / "a", "q-v", 8, seed=1)
    harness = Harness(runner(base, {"a": adapter}))
    harness.add("ghost", prompt(1, 5), lora_name="gone")
    harness.add("ok", prompt(2, 5), lora_name="a")
    assert harness.step({"ghost": 5, "ok": 5})["ghost"] == -1
    assert harness.step({"ghost": 1, "ok": 1})["ok"] >= 0
