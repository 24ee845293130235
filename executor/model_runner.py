"""Turns step plans into sampled tokens on one rank: the model, its paged KV cache
(executor/kv_cache.py) and the persistent batch, one forward and the sampler a step.
Each feature is a component called at a named seam, with a null variant when it is
off, so the step never asks whether one is on:
- `self.lora` (lora/manager.py; NoLoRA at --max-loras 0): each token's adapter;
- `self.drafter` (speculative/drafter.py; no proposer at k = 0): the step's drafts;
- `self.grammars` (grammar_rows.py): the constrained rows' masks, loaded on first use;
- `self.kv_worker` (kv_transfers/; NoKVWorker without one): KV beyond the pool;
- `self.media` (media.py; TextOnly for a text model): images' encoder and embeddings."""

import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from flagstop.adapters import LoadedAdapter
from flagstop.executor import kv_cache
from flagstop.executor.attention import attention_backend
from flagstop.executor.config import ExecutorConfig
from flagstop.executor.grammar_rows import GrammarRows
from flagstop.executor.input_batch import InputBatch
from flagstop.executor.kv_transfers.base import (
    POLL_WAIT_S,
    KVWorker,
    NoKVWorker,
    kv_layout,
)
from flagstop.executor.kv_transfers.factory import make_kv_worker
from flagstop.executor.lora.manager import lora_manager
from flagstop.executor.media import Images, TextOnly, pixels_from_bytes
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.loader import load_model
from flagstop.executor.parallel import SINGLE, TensorParallel
from flagstop.executor.pooler import build_pooler
from flagstop.executor.prompt_logprobs import prompt_logprobs
from flagstop.executor.rejection_sampler import verify
from flagstop.executor.sampling import sample
from flagstop.executor.sampling_params import SampleOutput, SamplingParams
from flagstop.executor.speculative.drafter import make_drafter
from flagstop.executor.step_inputs import StepInputs, prepare_inputs
from flagstop.scheduler_svc.core.kv_connector import NO_TRANSFERS
from flagstop.scheduler_svc.core.kv_groups import kv_cache_groups
from flagstop.scheduler_svc.core.output import SchedulerOutput
from flagstop.structured import Constraint
from flagstop.utils import cdiv


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(dtypes)} or auto")
    return dtypes[name]


def media_component(config: ExecutorConfig, mc: ModelConfig, dtype: torch.dtype,
                    device: torch.device) -> Images | TextOnly:  # fmt: skip
    """Every rank runs the whole vision tower (replicated: docs/multimodal.md)."""
    if mc.vision is None:
        return TextOnly()
    return Images(config.model, mc, dtype, device, config.media_store_bytes)


class ModelRunner:
    """A Runner (executor/runner.py): one rank's model, KV cache and persistent batch.
    Under tensor parallelism every rank runs each step's forward in lockstep; rank 0
    samples (execute), the others compute their shard (execute_shard) and append the
    sampled tokens when the next step brings them (advance_sampled)."""

    def __init__(
        self,
        config: ExecutorConfig,
        tp: TensorParallel = SINGLE,
        after_load: Callable[[], None] | None = None,
        device: str | None = None,
    ) -> None:
        """after_load: run once this rank's weights are in (the group's rendezvous)."""
        self.config, self.tp = config, tp
        self.device = resolve_device(device or config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        self.attention_backend = attention_backend(config.attention_backend, self.device)
        self.model = load_model(config.model, self.dtype, self.device, tp, self.attention_backend,
                                config.hf_overrides)  # fmt: skip
        self.kv_cache_dtype = self.dtype if config.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        self.model.set_kv_cache_dtype(self.kv_cache_dtype)
        self.max_loras = config.max_loras
        self.lora = lora_manager(self.model, config.max_loras, config.max_lora_rank,
                                 config.lora_module_paths)  # fmt: skip
        if after_load is not None:
            after_load()
        self.model_config = mc = self.model.config
        self.num_kv_heads = tp.shard.kv_heads(mc.num_kv_heads)[1]  # this rank's
        # The layers as the scheduler builds its KV cache groups from them (Describe).
        self.kv_layers = mc.kv_layers(self.num_kv_heads, self.kv_cache_dtype.itemsize,
                                        config.disable_hybrid_kv_cache_manager)  # fmt: skip
        self.kv_groups = kv_cache_groups(self.kv_layers)
        self.model.set_kv_groups(self.kv_groups)
        self.max_model_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len)
        self.block_size = kv_cache.block_size_for(mc, self.kv_layers, config.block_size, tp.size)
        self.model.block_size = self.block_size
        self.num_speculative_tokens = config.num_speculative_tokens
        self.speculative_method = config.speculative_method
        self.drafter = make_drafter(config, self, tp.rank)
        self.media = media_component(config, mc, self.dtype, self.device)
        self.pooler = build_pooler(mc, config.model, self.device)
        self.grammars = GrammarRows(config.model, mc.vocab_size, mc.eos_token_ids,
                                    config.max_num_seqs)  # fmt: skip
        self.last_inputs: StepInputs | None = None  # ranks > 0: awaiting sampled tokens
        self.transfers = NO_TRANSFERS  # what the last step found ended, for its result
        self.kv_worker: KVWorker = NoKVWorker()  # the real one once the cache is sized
        # Every rank holds the same block ids: the pool is the smallest rank's (on
        # CUDA a warm-up forward measures it, with everything above in place).
        self.batch = self._new_batch()
        self.num_blocks = tp.min_over_ranks(
            kv_cache.num_blocks(config, self.device, self.block_bytes, self._warm_up)
        )
        self._allocate(self.num_blocks)
        self.drafter.proposer.allocate(self.num_blocks)  # a draft model's, on the same blocks
        # A new one every start: an older instance's leases and addresses are void.
        self.kv_engine_id = uuid.uuid4().hex[:12]
        self.kv_layout = self._kv_layout()
        self.kv_worker = make_kv_worker(
            config, tp, self._all_kv_caches, self.block_bytes, self.kv_layout,
            self.kv_engine_id, self.num_blocks,
        )  # fmt: skip
        self.num_host_blocks = self.kv_worker.num_host_blocks

    # -- the KV cache ------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """A block's bytes on this rank, a draft model's cache included."""
        own = kv_cache.block_bytes(self.kv_layers, self.kv_groups, self.block_size)
        return own + self.drafter.proposer.block_bytes

    def _allocate(self, num_blocks: int) -> None:
        """The cache's tensors (kv_pairs, each once) and each layer's (kv_caches)."""
        self.kv_pairs, self.kv_caches = kv_cache.allocate(
            self.attention_backend, self.model_config, self.kv_groups, self.num_kv_heads,
            num_blocks, self.block_size, self.kv_cache_dtype, self.device,
        )  # fmt: skip

    @property
    def _all_kv_caches(self) -> list[torch.Tensor]:
        """Every KV tensor of this rank, a draft model's after the model's own."""
        pairs = [*self.kv_pairs, *self.drafter.proposer.kv_caches]
        return [t for pair in pairs for t in pair]

    def _kv_layout(self) -> str:
        mc, caches = self.model_config, self._all_kv_caches
        return kv_layout(Path(self.config.model).name, {
            "arch": mc.architecture, "dtype": str(self.kv_cache_dtype).removeprefix("torch."),
            "block_size": self.block_size, "tensor_parallel": self.tp.size,
            "tensors": f"{len(caches)}x{list(caches[0].shape[1:])}",
            "block_bytes": self.block_bytes,
        })  # fmt: skip

    def _warm_up(self, num_tokens: int) -> int:
        """The largest step once, on a cache just its size (CUDA profiling): that
        cache's bytes."""
        num_tokens = min(num_tokens, self.max_model_len - 1)
        self._allocate(cdiv(num_tokens, self.block_size))
        plan = kv_cache.warmup_plan(num_tokens, self.block_size, self.model_config.vocab_size,
                                    SamplingParams(), len(self.kv_groups))  # fmt: skip
        self.compute_logits(plan)
        self.batch = self._new_batch()
        self.model.take_expert_tokens()  # the warm-up's are no step's
        kv_bytes = sum(t.numel() * t.element_size() for pair in self.kv_pairs for t in pair)
        self.kv_pairs, self.kv_caches = [], []
        return kv_bytes

    def _new_batch(self) -> InputBatch:
        return InputBatch(
            self.config.max_num_seqs, self.max_model_len, self.block_size,
            self.model_config.vocab_size, speculative=self.num_speculative_tokens > 0,
            num_groups=len(self.kv_groups),
            recurrent_groups=tuple(g for g, x in enumerate(self.kv_groups) if x.is_recurrent),
        )  # fmt: skip

    # -- a step ------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every request (a new scheduler stream). The cache contents need no
        clearing: nothing is read that the new scheduler has not had written (a load
        still copying is waited out)."""
        self.kv_worker.reset()
        self.transfers = NO_TRANSFERS
        self.batch = self._new_batch()
        self.last_inputs = None
        self.grammars.reset()
        self.drafter.reset()

    @torch.inference_mode()
    def compute_logits(
        self, plan: SchedulerOutput
    ) -> tuple[torch.Tensor | None, StepInputs] | None:
        """Apply the diff and run the forward: logits [num_sampling, vocab] in plan
        order (with drafts, 1 + drafts rows per sampling request; on rank 0, None on
        the other ranks); None without scheduled tokens."""
        self._apply(plan)
        if not plan.num_scheduled_tokens:
            self.transfers = self.kv_worker.finished()
            return None
        scheduled = self.batch.scheduled_rows(plan)
        drafts = self.drafter.drafts(self.batch, scheduled, self.grammars)
        inputs = prepare_inputs(self.batch, scheduled, self.device, drafts)
        self.lora.set_rows(self.batch, inputs.rows, inputs.token_rows)
        positions, embeds = self.media.inputs(self.batch, inputs)
        hidden = self.model(inputs.input_ids, positions, self.kv_caches, inputs.attention, embeds)
        inputs.hidden = hidden  # for a drafter that reads them (drafter.computed)
        inputs.aux_hidden = self.model.aux_hidden.taken()
        logits = self.model.compute_logits(hidden[inputs.all_logits_indices])
        if plan.kv_connector:
            self.kv_worker.after_forward(plan.kv_connector)  # saves what it computed
        self.transfers = self.kv_worker.finished()
        return logits, inputs

    def _apply(self, plan: SchedulerOutput) -> None:
        """The plan's diff to the persistent batch, and its transfers started (copied
        while the forward runs)."""
        self.grammars.removed(plan, self.batch)
        self.drafter.removed(plan)
        self.batch.apply(plan)
        self.media.apply(plan, self.batch)
        if self.tp.rank == 0:  # the rank that samples
            self.grammars.added(plan, self.batch)
            self.drafter.added(plan, self.batch)
        if plan.kv_connector:
            self.kv_worker.start(plan.kv_connector)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> SampleOutput:
        """One step: the tokens of the requests that sample, in plan order."""
        result = self.compute_logits(plan)
        if result is None:
            return self._with_transfers(SampleOutput([]))
        logits, inputs = result
        assert logits is not None, "only rank 0 samples"
        prompt_logits = None
        if inputs.prompt_chunks:
            num_sampling = len(inputs.logits_indices)
            logits, prompt_logits = logits[:num_sampling], logits[num_sampling:]
        output = self._with_transfers(self._sample(logits, inputs))
        output.pooled = self.pooler.outputs(self.batch, inputs)
        if prompt_logits is not None:
            output.prompt_logprobs = prompt_logprobs(prompt_logits, inputs, plan, self.batch)
        num_known = self.batch.num_tokens[inputs.sampling_rows]
        self.advance(inputs, output.token_ids, output.num_sampled_tokens or None)
        self.drafter.verified(self.batch, inputs.sampling_rows, num_known,
                              output.num_sampled_tokens)  # fmt: skip
        self.drafter.computed(self.batch, inputs)
        if self.batch.failed_rows:  # after advance: a step in flight may still decode them
            rows = inputs.sampling_rows
            if output.num_sampled_tokens:
                rows = np.repeat(rows, output.num_sampled_tokens)
            output.token_ids = self.batch.fail_tokens(rows, output.token_ids)
        return output

    def _sample(self, logits: torch.Tensor, inputs: StepInputs) -> SampleOutput:
        """A token per sampling request, or with drafts their verification. The
        logprobs are those of the masked distribution."""
        constrained = self.grammars.mask(logits, inputs.sampling_rows, inputs.drafts)
        if inputs.drafts is None:
            output = sample(logits, inputs.sampling)
        else:
            output = verify(logits, inputs.sampling, inputs.drafts)
        self.grammars.accept(constrained, output)
        return output

    def _with_transfers(self, output: SampleOutput) -> SampleOutput:
        output.transfers, self.transfers = self.transfers, NO_TRANSFERS
        return output

    async def step(self, plan: SchedulerOutput) -> SampleOutput:
        """The Runner's step: execute() on the event loop's own thread. The next step
        waits in gRPC's buffers anyway, and a forward on a worker thread ran ~20%
        slower on the CPU (measured with bench/peers.py), its threads contending with
        the loop. A step with nothing to compute, while transfers are under way, gives
        them a moment to end first (the loop serves gRPC meanwhile)."""
        if not plan.polls_only:
            return self.execute(plan)
        self._apply(plan)
        await self.kv_worker.wait(POLL_WAIT_S)
        self.transfers = self.kv_worker.finished()
        return self._with_transfers(SampleOutput([]))

    def advance(
        self, inputs: StepInputs, token_ids: list[int], num_sampled: list[int] | None = None
    ) -> None:
        # Computed: the tokens before the drafts (the accepted drafts are counted from
        # num_sampled).
        self.model.after_verify(num_sampled)
        num_scheduled = inputs.num_scheduled
        if inputs.drafts is not None:
            num_scheduled = num_scheduled.copy()
            num_scheduled[np.isin(inputs.rows, inputs.sampling_rows)] -= inputs.drafts.num_drafts
        self.batch.advance(inputs.rows, num_scheduled, inputs.sampling_rows, token_ids,
                           num_sampled)  # fmt: skip

    @torch.inference_mode()
    def execute_shard(self, plan: SchedulerOutput) -> None:
        """A rank other than 0: this step's forward, its shard of it."""
        result = self.compute_logits(plan)
        self.last_inputs = None if result is None else result[1]

    def advance_sampled(self, token_ids: list[int], num_sampled: list[int] | None = None) -> None:
        """A rank other than 0: the tokens rank 0 sampled in the last step (with
        drafts, num_sampled of them per sampling request)."""
        if self.last_inputs is not None:
            self.advance(self.last_inputs, token_ids, num_sampled or None)
            self.last_inputs = None

    # -- what the service asks -----------------------------------------------------

    def prepare_grammar(self, grammar: Constraint) -> float:
        """Compile a constraint ahead of its request (on a thread): seconds taken."""
        return self.grammars.prepare(grammar)

    def prepare_media(self, key: bytes, pixels: bytes, shape: list[int], dtype: str,
                      grid: list[int]) -> None:  # fmt: skip
        self.media.put(key, pixels_from_bytes(pixels, shape, dtype, grid))

    def lora_adapters(self) -> dict[str, LoadedAdapter]:
        return self.lora.summaries()

    def load_lora(self, name: str, path: str) -> LoadedAdapter:
        return self.lora.register(name, path).summary()

    def unload_lora(self, name: str) -> bool:
        return self.lora.unregister(name)

    def take_expert_tokens(self) -> list[int] | None:
        return self.model.take_expert_tokens()

    @property
    def tensor_parallel_size(self) -> int:
        return self.tp.size
