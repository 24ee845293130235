"""The executor simulator: a LOAD-TEST TOOL, NOT A MODEL. It speaks executor.proto and
keeps the persistent batch exactly as the model runner does (new, cached, resumed,
finished and preempted requests; which rows sample), but instead of a forward it
waits the time a GPU would take, from a cost model, and returns deterministic tokens
(a hash of each request's own tokens). With it the router, the scheduler and gateways
are load-tested at GPU step rates on a CPU machine, in the manner of llm-d's
inference simulator. It imports no torch. A pooling model's requests (docs/pooling.md)
get outputs seeded by a hash of their tokens, the right size and not a model's: an
embedding model's a unit vector, a classifier's probabilities a class.

    flagstop-executor --simulate --model DIR [--simulate-base-ms 6] ...

DIR only lends its config.json (vocabulary, EOS ids, length), so that the router's
tokenizer and limits match; no weights are read. A step takes
    base_ms + us_per_scheduled_token x scheduled tokens + us_per_context_token x context
(defaults like an 8B model on an H200: about 7 ms for a 256-request decode step at 1k
context, a 512-token prefill chunk about 4 ms more), and steps run back to back like
on a device: one that arrives while another runs starts when it ends.

With --speculative-config it fills the scheduler's draft slots without proposing
anything: each draft is accepted with --simulate-acceptance-rate (a hash, not a
model), so a request emits 1 + accepted tokens a step, and load tests see
multi-token steps, rollbacks and block trims.

With --max-loras it registers LoRA adapters by their adapter_config.json (the rank and
target modules it names; no weights are read, no low-rank product is run), so that
adapter-aware scheduling and routing are load-tested too.

With --kv-role it takes its side of prefill/decode disaggregation: a prefill
simulator holds the leases and answers the handshake as a real prefill executor does;
a decode simulator asks for them the same way and "reads" the blocks in the time
--simulate-kv-transfer-us-per-token says. So the router's splitting and both
schedulers' hand-offs run at GPU step rates too.
"""

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flagstop.adapters import LoadedAdapter, adapter_digest
from flagstop.executor.config import ExecutorConfig
from flagstop.executor.input_batch import InputBatch
from flagstop.executor.kv_transfers.base import POLL_WAIT_S, KVWorker, NoKVWorker, kv_layout
from flagstop.executor.kv_transfers.decode import DecodeSide, SimulatedTransport
from flagstop.executor.kv_transfers.prefill import PrefillSide
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.sampling_params import SampleOutput, SamplingParams
from flagstop.scheduler_svc.core.kv_groups import kv_cache_groups
from flagstop.scheduler_svc.core.output import SchedulerOutput
from flagstop.structured import Constraint
from flagstop.v1 import executor_pb2

_A, _B, _C = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35  # odd 32-bit mixers
MAX_STOP_IDS = 16  # stop ids kept per row, the first of them emitted as a stop


@dataclass(frozen=True, slots=True)
class CostModel:
    base_ms: float
    us_per_scheduled_token: float
    us_per_context_token: float

    def seconds(self, num_scheduled: int, num_context: int) -> float:
        us = self.us_per_scheduled_token * num_scheduled + self.us_per_context_token * num_context
        return self.base_ms / 1e3 + us / 1e6


class SimulatedBatch(InputBatch):
    """The persistent batch with each row's stop ids as an array too: the simulator
    picks its stop tokens for the whole batch at once (the model runner's sampler
    reads them from the request's params)."""

    def __init__(self, max_num_reqs: int, *args, **kwargs) -> None:
        super().__init__(max_num_reqs, *args, **kwargs)
        self.stop_ids = np.full((max_num_reqs, MAX_STOP_IDS), -1, np.int64)
        self.stop_counts = np.zeros(max_num_reqs, np.int64)

    def _set_sampling(self, row: int, p: SamplingParams) -> None:
        super()._set_sampling(row, p)
        stops = p.stop_token_ids[:MAX_STOP_IDS]
        self.stop_ids[row] = -1
        self.stop_ids[row, : len(stops)] = stops
        self.stop_counts[row] = len(stops)


class SimulatedRunner:
    """A Runner (executor/runner.py) without a model."""

    tensor_parallel_size = 1
    device = "simulated"
    num_host_blocks = 0  # no host tier: --kv-offload-bytes needs the real model

    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model, config.hf_overrides)
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len)
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks or config.simulate_num_blocks
        # The model's layers as a real executor describes them (bf16 K and V), so that
        # the scheduler's block accounting under load is the model's.
        self.kv_layers = mc.kv_layers(mc.num_kv_heads, 2, config.disable_hybrid_kv_cache_manager)
        self.kv_groups = kv_cache_groups(self.kv_layers)
        self.cost = CostModel(config.simulate_base_ms, config.simulate_us_per_scheduled_token,
                              config.simulate_us_per_context_token)  # fmt: skip
        self.mean_output_tokens = config.simulate_mean_output_tokens
        self.num_speculative_tokens = config.num_speculative_tokens
        self.speculative_method = config.speculative_method
        self.acceptance_rate = config.simulate_acceptance_rate
        self.busy_until = self.last_step_seconds = 0.0
        self.batch = self._new_batch()
        self.max_loras = config.max_loras
        self.adapters: dict[str, LoadedAdapter] = {}
        for name, path in config.lora_module_paths:
            self.load_lora(name, path)
        self.kv_engine_id = uuid.uuid4().hex[:12]
        self.kv_layout = kv_layout(Path(config.model).name, {
            "arch": mc.architecture, "simulated": True, "block_size": self.block_size,
        })  # fmt: skip
        self.kv_worker = self._kv_worker()

    def _kv_worker(self) -> KVWorker:
        """--kv-role: its side of disaggregation, without bytes."""
        config = self.config
        if config.kv_role == "prefill":
            ranks = [executor_pb2.KVRank(session="simulated")]
            return PrefillSide(self.kv_layout, self.kv_engine_id, self.num_blocks,
                               config.kv_lease_s, lambda: ranks)  # fmt: skip
        if config.kv_role == "decode":
            block_s = config.simulate_kv_transfer_us_per_token * self.block_size / 1e6
            return DecodeSide(0, self.kv_layout, SimulatedTransport(block_s),
                              lambda values: values)  # fmt: skip
        return NoKVWorker()

    def lora_adapters(self) -> dict[str, LoadedAdapter]:
        return dict(self.adapters)

    def load_lora(self, name: str, path: str) -> LoadedAdapter:
        """Registered by its adapter_config.json alone (see the module's docstring),
        its identity the digest of its files, as the executor's."""
        if not self.max_loras:
            raise ValueError("LoRA is off: start the executor with --max-loras")
        try:
            settings = json.loads((Path(path) / "adapter_config.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a PEFT adapter directory ({e})") from None
        modules = tuple(settings.get("target_modules") or ())
        loaded = LoadedAdapter(path, adapter_digest(path), int(settings.get("r", 8)), modules)
        self.adapters[name] = loaded
        return loaded

    def unload_lora(self, name: str) -> bool:
        return self.adapters.pop(name, None) is not None

    def _new_batch(self) -> SimulatedBatch:
        return SimulatedBatch(self.config.max_num_seqs, self.max_model_len, self.block_size,
                              self.model_config.vocab_size, self.num_speculative_tokens > 0,
                              len(self.kv_groups))  # fmt: skip

    def reset(self) -> None:
        self.batch = self._new_batch()
        self.kv_worker.reset()

    def take_expert_tokens(self) -> None:
        return None  # the simulator routes nothing

    def prepare_media(self, key: bytes, pixels: bytes, shape: list[int], dtype: str,
                      grid: list[int]) -> None:  # fmt: skip
        raise ValueError("the executor simulator (a load-test tool) serves no images")

    def prepare_grammar(self, grammar: Constraint) -> float:
        """Nothing to compile: the simulator's tokens are not sampled from a model, so
        a constrained request runs unconstrained here (a load-test tool)."""
        return 0.0

    async def step(self, plan: SchedulerOutput) -> SampleOutput:
        """The step's tokens, once the simulated device would have finished it (and the
        transfers that ended meanwhile)."""
        output = self.execute(plan)
        start = max(time.monotonic(), self.busy_until)
        self.busy_until = start + self.last_step_seconds
        await asyncio.sleep(self.busy_until - time.monotonic())
        if plan.polls_only:
            await self.kv_worker.wait(POLL_WAIT_S)
        output.transfers = self.kv_worker.finished()
        return output

    def execute(self, plan: SchedulerOutput) -> SampleOutput:
        """One step's tokens at once; last_step_seconds is what it would have taken."""
        batch = self.batch
        batch.apply(plan)
        if plan.kv_connector:
            self.kv_worker.start(plan.kv_connector)
        self.last_step_seconds = 0.0
        if not plan.num_scheduled_tokens:
            return SampleOutput([])
        rows, num_scheduled, seq_lens, samples, slots, pooled = batch.scheduled_rows(plan)
        sampling_rows = rows[samples]
        num_computed = int(num_scheduled.sum() + slots.sum())
        self.last_step_seconds = self.cost.seconds(num_computed, int(seq_lens.sum()))
        if not slots.any():
            tokens = self._tokens(sampling_rows)
            batch.advance(rows, num_scheduled, sampling_rows, tokens)
            return SampleOutput(tokens, pooled=self._pooled(rows[pooled]))
        slots = slots[samples]
        counts = self._accepted(sampling_rows, slots) + 1
        tokens = self._token_runs(sampling_rows, counts)
        batch.advance(rows, num_scheduled, sampling_rows, tokens, counts.tolist())
        return SampleOutput(tokens, num_sampled_tokens=counts.tolist(),
                            num_draft_tokens=slots.tolist(),
                            pooled=self._pooled(rows[pooled]))  # fmt: skip

    def _pooled(self, rows: np.ndarray) -> list[bytes]:
        """A pooling request's output, seeded by a hash of its tokens (the same alone or
        batched): an embedding model's a unit vector cut to the dimensions it asked
        for, a classifier's probabilities a class (one class: a sigmoid's)."""
        b, size, pooling = self.batch, self.model_config.hidden_size, self.model_config.pooling
        classes = len(pooling.classifier.labels) if pooling and pooling.classifier else 0
        out = []
        for row in rows.tolist():
            seed = int(self._tokens(np.array([row]))[0])
            vector = np.random.default_rng(seed).standard_normal(classes or size)
            if classes:
                vector = np.exp(vector) / (np.exp(vector).sum() + (classes == 1))
            else:
                vector = vector[: b.sampling_params[row].pooling.dimensions or size]
                vector = vector / np.linalg.norm(vector)
            out.append(vector.astype("<f4").tobytes())
        return out

    def _accepted(self, rows: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """How many of each row's drafts are accepted: leading hashed coin flips."""
        b, k = self.batch, int(slots.max())
        n = b.num_tokens[rows].astype(np.uint64)[:, None] + np.arange(k, dtype=np.uint64)
        last = b.token_ids[rows, b.num_tokens[rows] - 1].astype(np.uint64)[:, None]
        mixed = (n * _A + last * _C + np.uint64(0x5BD1E995)) & np.uint64(0xFFFFFFFF)
        mixed ^= mixed >> np.uint64(13)
        accepted = (mixed % np.uint64(10000)).astype(np.float64) < self.acceptance_rate * 10000
        accepted &= np.arange(k)[None, :] < slots[:, None]
        return np.cumprod(accepted, axis=1).sum(axis=1)

    def _token_runs(self, rows: np.ndarray, counts: np.ndarray) -> list[int]:
        """counts[i] tokens of rows[i], each hashed from the ones before, flattened."""
        b, runs = self.batch, [[] for _ in rows]
        saved = b.num_tokens[rows].copy()
        for j in range(int(counts.max())):
            active = np.flatnonzero(counts > j)
            tokens = self._tokens(rows[active])
            b.token_ids[rows[active], b.num_tokens[rows[active]]] = tokens
            b.num_tokens[rows[active]] += 1
            for i, token in zip(active.tolist(), tokens, strict=True):
                runs[i].append(token)
        b.num_tokens[rows] = saved
        return [token for run in runs for token in run]

    def _tokens(self, rows: np.ndarray) -> list[int]:
        """A hash of each request's last token, first token and length: the same tokens
        alone or batched, and again after a preemption."""
        b = self.batch
        n = b.num_tokens[rows]
        last = b.token_ids[rows, n - 1].astype(np.uint64)
        first = b.token_ids[rows, 0].astype(np.uint64)
        mixed = (last * _A + n.astype(np.uint64) * _B + first * _C) & np.uint64(0xFFFFFFFF)
        mixed ^= mixed >> np.uint64(15)
        tokens = (mixed % np.uint64(self.model_config.vocab_size)).astype(np.int64)
        stop_ids, stop_count = b.stop_ids[rows], b.stop_counts[rows]
        allowed = n - b.num_prompt_tokens[rows] >= b.min_tokens[rows]
        if self.mean_output_tokens:
            # Like a model asked to stop: a stop token now and then, never before min_tokens.
            stops = (mixed >> np.uint64(7)) % np.uint64(self.mean_output_tokens) == 0
            stops &= allowed & (stop_count > 0)
            tokens = np.where(stops, stop_ids[:, 0], tokens)
        else:
            stops = np.zeros(len(rows), np.bool_)
        # Otherwise never a stop token by chance: it would end the request early.
        collide = (stop_ids == tokens[:, None]).any(axis=1) & ~stops
        tokens[collide] = (tokens[collide] + 1) % self.model_config.vocab_size
        return tokens.tolist()
