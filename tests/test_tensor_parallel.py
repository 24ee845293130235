"""Tensor parallelism over gloo on the CPU: two ranks' logits against one rank's and
against transformers, on checkpoints that exercise the shard arithmetic."""

import json
import os
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.parallel import Shard, check_divisible
from flagstop.v1 import executor_pb2, executor_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.helpers.checkpoints import (
    TOL,
    load_reference,
    reference_generate,
    reference_logits,
    write_checkpoint,
)
from tests.helpers.executor_harness import Harness
from tests.helpers.streams import Streams, assert_greedy_under_pressure, assert_token_exact
from tests.helpers.streams import long_greedy_workload as fault_workload
from tests.helpers.streams import short_greedy_workload as workload
from tests.helpers.tp_scenarios import config, run_group, run_scenarios
from tools.make_model import embedded_vocabulary, model_config
from tools.stack import free_port, generate, spawn, start_stack, wait_serving

# (checkpoint, --expert-parallel): MoE experts sliced over the ranks (with a shared
# expert), or placed whole (with a dense layer among the sparse ones).
# A dense config.json's fields, for the arithmetic tests.
DENSE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 128,
         "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip
# And windowed models: KV cache groups, each rank on the same block ids. And DeepSeek's
# latent attention (heads split, the latent cache whole on each rank), q through its low
# rank (V3) and not (V2, whose experts are placed whole). And gated DeltaNet layers: the
# linear-attention heads split by key head (Qwen3-Next packs by them; Qwen3.5's q, k, v
# and convolution are cut from whole tensors), the states of a rank's heads in its pages.
CHECKPOINTS = [("llama", False), ("qwen2", False), ("qwen2-tied-odd-vocab", False),
               ("llama-1kv", False), ("qwen2-moe", False), ("qwen3-moe", True),
               ("qwen2-window", False), ("gemma2", False), ("gemma3", False), ("gpt-oss", False),
               ("gpt-oss", True), ("deepseek-v3", False), ("deepseek-v2", True),
               ("qwen3-next", False), ("qwen3.5", False), ("qwen3.5-moe", True),
               ("granite", False)]  # fmt: skip


@pytest.mark.processes
@pytest.mark.parametrize(("name", "expert_parallel"), CHECKPOINTS,
                         ids=[n + "-ep" * ep for n, ep in CHECKPOINTS])  # fmt: skip
def test_two_ranks_give_the_logits_of_one_and_of_transformers(name, expert_parallel, tmp_path):
    path = write_checkpoint(name, tmp_path / name)
    vocab = ModelConfig.from_pretrained(path).vocab_size
    single = run_scenarios(Harness(ModelRunner(config(path))), vocab)
    # Keyed by context: the ranks run each plan in its wire order (cached requests,
    # then new ones), so a step's samples come in another order than in one process.
    parallel = run_group(path, tmp_path / "tp2.pt", 2, expert_parallel)
    reference = load_reference(path)
    assert len(parallel) == len(single) >= 10
    for context, one in single:
        two = parallel[tuple(context)]  # the same greedy tokens were appended
        assert two.shape == (vocab,)
        torch.testing.assert_close(two, one, atol=TOL, rtol=0)
        torch.testing.assert_close(two, reference_logits(reference, context), atol=TOL, rtol=0)


@pytest.mark.processes
def test_a_group_of_one_is_the_plain_runner(tmp_path):
    """The group machinery (process group, broadcast steps) with nothing split; on a
    GPU, bench/gpu_check.sh runs the same over NCCL."""
    path = write_checkpoint("llama", tmp_path / "llama")
    single = run_scenarios(Harness(ModelRunner(config(path))), 512)
    grouped = run_group(path, tmp_path / "one.pt", 1)
    for context, logits in single:
        torch.testing.assert_close(grouped[tuple(context)], logits, atol=TOL, rtol=0)


def test_shards_cover_heads_kv_heads_and_a_padded_vocabulary():
    shards = [Shard(r, 4) for r in range(4)]
    assert [s.heads(8) for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [s.kv_heads(8) for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [s.kv_heads(2) for s in shards] == [(0, 1), (0, 1), (1, 1), (1, 1)]  # replicated
    assert [s.vocab(509) for s in shards] == [(0, 128), (128, 128), (256, 128), (384, 128)]
    dense = ModelConfig.from_hf({**DENSE, "num_attention_heads": 8, "num_key_value_heads": 2})
    assert check_divisible(dense, 4) == ""
    assert "heads" in check_divisible(replace(dense, num_heads=6), 4)
    assert "KV heads" in check_divisible(replace(dense, num_kv_heads=3), 4)
    assert "--expert-parallel: LlamaForCausalLM has no experts" in check_divisible(dense, 4, True)


def test_experts_split_whole_under_expert_parallelism_and_sliced_without():
    sliced, whole = [Shard(r, 4) for r in range(4)], [Shard(r, 4, True) for r in range(4)]
    assert [s.experts(8) for s in sliced] == [(0, 8)] * 4
    assert [s.expert_inner(64) for s in sliced] == [(0, 16), (16, 16), (32, 16), (48, 16)]
    assert [s.experts(8) for s in whole] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [s.expert_inner(64) for s in whole] == [(0, 64)] * 4
    moe = ModelConfig.from_hf({**DENSE, "architectures": ["Qwen3MoeForCausalLM"],
                               "num_experts": 6, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 48})  # fmt: skip
    assert check_divisible(moe, 4) == "" and check_divisible(moe, 2, True) == ""
    assert check_divisible(moe, 4, True) == (
        "num_experts=6 does not split into 4 ranks (--expert-parallel)")  # fmt: skip
    odd = replace(moe, moe=replace(moe.moe, intermediate_size=42))
    assert "experts' size 42 does not split into 4 ranks" in check_divisible(odd, 4)
    assert check_divisible(odd, 2, True) == ""  # whole experts: their size is not split


def children_of(pid: int) -> list[int]:
    """The processes whose parent is pid (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.fixture(scope="module")
def tp_stack(model_dir, tmp_path_factory):
    """Two ranks, a 384-token KV pool and a 32-token budget: preemption, chunked
    prefill and prefix hits through a tensor-parallel executor."""
    stack = start_stack(
        model_dir, tmp_path_factory.mktemp("tp"),
        executor_args=["--num-blocks", "24", "--tensor-parallel-size", "2"],
        scheduler_args=["--max-num-batched-tokens", "32", "--max-num-seqs", "8"],
    )  # fmt: skip
    yield stack
    assert stack.stop() == {"router": 0, "scheduler": 0, "executor": 0}, stack.logs()


@pytest.mark.processes
def test_the_stack_on_two_ranks_equals_transformers(tp_stack, reference):
    assert_greedy_under_pressure(tp_stack, reference, workload(3, n=12, shared_prefix=True))
    stub = executor_pb2_grpc.ExecutorStub(tp_stack.channel(tp_stack.executor))
    info = stub.Describe(executor_pb2.DescribeExecutorRequest(), timeout=5)
    assert info.tensor_parallel_size == 2 and info.model.num_blocks == 24


@pytest.mark.processes
def test_prompt_logprobs_on_two_ranks_equal_transformers(tp_stack, reference):
    """A 70-token prompt in 32-token chunks: the vocabulary-split logits of every prompt
    position, gathered, scored as transformers scores them."""
    ids = [0] + [(i * 37) % 500 + 2 for i in range(69)]
    _, _, last = generate(tp_stack, prompt_token_ids=ids, max_tokens=1, prompt_logprobs=2)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    got = torch.tensor([lp.logprob for lp in last.prompt_logprobs])
    want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    assert [t.token_id for t in last.prompt_logprobs[5].top] == expected[5].topk(2).indices.tolist()


@pytest.mark.processes
def test_seeded_sampling_is_the_same_on_one_rank_and_on_two(tp_stack, model_dir, tmp_path):
    fields = dict(prompt_token_ids=[0, 9, 33, 71], max_tokens=24, temperature=0.9, top_p=0.95,
                  seed=11, ignore_eos=True)  # fmt: skip
    two = generate(tp_stack, **fields)[0]
    one_rank = start_stack(model_dir, tmp_path, executor_args=["--num-blocks", "64"])
    try:
        one = generate(one_rank, **fields)[0]
    finally:
        one_rank.stop()
    assert one == two and len(set(one)) > 5


@pytest.mark.processes
def test_a_killed_rank_takes_the_group_down_and_streams_end_token_exact(
    model_dir, tmp_path, reference
):
    executor_args = ["--num-blocks", "512", "--tensor-parallel-size", "2"]
    stack = start_stack(model_dir, tmp_path, executor_args=executor_args)
    try:
        streams = Streams(stack, fault_workload(4))
        streams.wait_for_tokens(10)
        [rank1] = children_of(stack.processes["executor"].pid)
        os.kill(rank1, signal.SIGKILL)
        started = time.monotonic()
        assert stack.processes["executor"].wait(15) == 1  # the group is down, loudly
        assert time.monotonic() - started < 10
        assert "tensor-parallel group lost" in (tmp_path / "executor.log").read_text()
        stack.restart("executor")  # as a supervisor would
        assert_token_exact(reference, streams)
        stats = stack.wait_idle()
        assert stats.executor_connected and stats.num_free_blocks == stats.num_total_blocks
    finally:
        stack.stop(10)


@pytest.mark.processes
def test_two_processes_under_torchruns_contract_form_one_executor(model_dir, tmp_path, reference):
    """torchrun --nnodes=2 sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
    for each node's process; both run the same flagstop-executor command."""
    port, master = free_port(), free_port()
    command = ["-m", "flagstop.executor", "--model", str(model_dir), "--port", str(port),
               "--metrics-port", "0", "--num-blocks", "64",
               "--tensor-parallel-size", "2"]  # fmt: skip
    env = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(master)}  # fmt: skip
    ranks = [spawn(f"rank{r}", command, tmp_path, {**env, "RANK": str(r)}) for r in (1, 0)]
    try:
        wait_serving(grpc.insecure_channel(f"127.0.0.1:{port}"), ranks[1])
        stub = executor_pb2_grpc.ExecutorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        assert stub.Describe(executor_pb2.DescribeExecutorRequest()).tensor_parallel_size == 2
        scheduler = free_port()
        rest = [spawn("scheduler", ["-m", "flagstop.scheduler_svc", "--executor",
                                    f"127.0.0.1:{port}", "--port", str(scheduler),
                                    "--metrics-port", "0"], tmp_path)]  # fmt: skip
        wait_serving(grpc.insecure_channel(f"127.0.0.1:{scheduler}"), rest[0])
        router = free_port()
        rest.append(spawn("router", ["-m", "flagstop.router", "--model", str(model_dir),
                                     "--scheduler", f"127.0.0.1:{scheduler}", "--port",
                                     str(router), "--http-port", "0", "--metrics-port", "0"],
                          tmp_path))  # fmt: skip
        wait_serving(grpc.insecure_channel(f"127.0.0.1:{router}"), rest[1])
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{router}"))
        request = generation_pb2.GenerateRequest(prompt_token_ids=[0, 5, 6, 7], max_tokens=12,
                                                 temperature=0, ignore_eos=True)  # fmt: skip
        tokens = [t for chunk in stub.Generate(request, timeout=60) for t in chunk.token_ids]
        assert tokens == reference_generate(reference, [0, 5, 6, 7], 12)
        for process in reversed(rest):
            process.terminate()
            assert process.wait(30) == 0
        ranks[1].terminate()  # rank 0 tells rank 1 to stop
        assert [r.wait(30) for r in ranks] == [0, 0]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()


def run_executor(model_dir, tmp_path, *args: str, env=None, name="executor"):
    command = ["-m", "flagstop.executor", "--model", str(model_dir), "--port",
               str(free_port()), "--metrics-port", "0", *args]  # fmt: skip
    return spawn(name, command, tmp_path, env)


def last_line(process, tmp_path, name="executor") -> str:
    assert process.wait(120) == 1
    return (tmp_path / f"{name}.log").read_text().strip().splitlines()[-1]


@pytest.mark.processes
def test_heads_that_do_not_split_stop_start_up(model_dir, tmp_path):
    process = run_executor(model_dir, tmp_path, "--tensor-parallel-size", "3")
    assert last_line(process, tmp_path) == (
        "flagstop-executor: --tensor-parallel-size 3: 4 attention heads do not split into 3 ranks"
    )


@pytest.mark.processes
def test_moe_configs_the_executor_cannot_run_stop_start_up_naming_the_field(tmp_path):
    """Only config.json is read before the refusal: no weights are needed. (Each
    refusal's message: test_model_loading and the check_divisible tests here.)"""
    moe = json.loads(json.dumps(model_config("tiny", embedded_vocabulary(), "qwen3_moe")))
    cases = [
        ({"num_experts": 3}, ["--tensor-parallel-size", "2", "--expert-parallel"],
         "--tensor-parallel-size 2: num_experts=3 does not split into 2 ranks (--expert-parallel)"),
        ({"scoring_func": "sigmoid"}, [],
         "scoring_func='sigmoid': an MoE routing scheme flagstop does not run"),
    ]  # fmt: skip
    for i, (change, args, message) in enumerate(cases):
        checkpoint = tmp_path / f"moe{i}"
        checkpoint.mkdir()
        (checkpoint / "config.json").write_text(json.dumps({**moe, **change}))
        process = run_executor(checkpoint, tmp_path, *args, name=f"executor{i}")
        line = last_line(process, tmp_path, f"executor{i}")
        assert line.startswith("flagstop-executor: ") and message in line


@pytest.mark.processes
def test_a_taken_rendezvous_port_stops_start_up(model_dir, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        process = run_executor(model_dir, tmp_path, "--tensor-parallel-size", "2", env=env)
        line = last_line(process, tmp_path)
    assert line.startswith(f"flagstop-executor: cannot listen on 127.0.0.1:{port} (MASTER_ADDR/")


@pytest.mark.processes
def test_a_rank_that_cannot_load_its_shard_stops_the_group_with_its_reason(model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").unlink()  # this node lacks the weights
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    rank1 = run_executor(broken, tmp_path, "--tensor-parallel-size", "2",
                         env={**env, "RANK": "1"}, name="rank1")  # fmt: skip
    rank0 = run_executor(model_dir, tmp_path, "--tensor-parallel-size", "2",
                         env={**env, "RANK": "0"}, name="rank0")  # fmt: skip
    line = last_line(rank0, tmp_path, "rank0")
    assert line.startswith("flagstop-executor: tensor-parallel rank 1: FileNotFoundError: no "
                           "*.safetensors (or pytorch_model*.bin) in"), line  # fmt: skip
    assert rank1.wait(30) == 1


@pytest.mark.processes
def test_a_hung_rank_takes_the_group_down_within_its_timeout(model_dir, tmp_path):
    process = run_executor(model_dir, tmp_path, "--tensor-parallel-size", "2", "--tp-timeout", "3")
    try:
        wait_until_logged(tmp_path / "executor.log", "tensor parallel 2")
        [rank1] = children_of(process.pid)
        os.kill(rank1, signal.SIGSTOP)  # alive, silent: only a deadline can tell
        started = time.monotonic()
        assert process.wait(30) == 1
        assert time.monotonic() - started < 10
        assert "tensor-parallel group lost" in (tmp_path / "executor.log").read_text()
    finally:
        if process.poll() is None:
            process.kill()


def wait_until_logged(path: Path, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{text!r} never logged"
        time.sleep(0.1)
