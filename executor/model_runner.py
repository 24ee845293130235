"""Turns step plans into sampled tokens: the model, its paged KV cache, the persistent
batch and the sampler, on one device."""

import logging
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from flagstop.adapters import LoadedAdapter
from flagstop.executor.attention import attention_backend
from flagstop.executor.config import ExecutorConfig
from flagstop.executor.input_batch import InputBatch
from flagstop.executor.kv_offload import HostTier
from flagstop.executor.kv_pull import DecodeSide, StoreBoard
from flagstop.executor.kv_worker import (
    POLL_WAIT_S,
    KVWorker,
    PrefillFollower,
    PrefillSide,
    kv_layout,
)
from flagstop.executor.lora.adapter import AdapterError
from flagstop.executor.lora.manager import LoRAManager
from flagstop.executor.models.llama import KVCache
from flagstop.executor.models.loader import load_model
from flagstop.executor.parallel import SINGLE, TensorParallel
from flagstop.executor.rejection_sampler import verify
from flagstop.executor.sampling import sample
from flagstop.executor.sampling_params import PromptLogprobs, SampleOutput, SamplingParams
from flagstop.executor.spec.proposer import Proposer, make_proposer
from flagstop.executor.step_inputs import Drafts, StepInputs, prepare_inputs
from flagstop.scheduler_svc.core.kv_connector import NO_TRANSFERS
from flagstop.scheduler_svc.core.output import NewRequestData, SchedulerOutput
from flagstop.structured import GrammarError, GrammarSpec
from flagstop.utils import cdiv

if TYPE_CHECKING:
    from flagstop.executor.structured import GrammarBook

log = logging.getLogger("flagstop.executor")


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
        self.model = load_model(config.model, self.dtype, self.device, tp, self.attention_backend)
        self.kv_cache_dtype = self.dtype if config.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        self.model.set_kv_cache_dtype(self.kv_cache_dtype)
        self.lora: LoRAManager | None = None
        self.max_loras = config.max_loras
        if config.max_loras:
            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank)
            for name, path in config.lora_module_paths:
                try:
                    self.lora.register(name, path)
                except AdapterError as e:
                    raise AdapterError(f"--lora-modules {name}: {e}") from None
        if after_load is not None:
            after_load()
        self.model_config = mc = self.model.config
        self.num_kv_heads = tp.shard.kv_heads(mc.num_kv_heads)[1]  # this rank's
        self.max_model_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len)
        self.block_size = config.block_size
        spec = config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens if spec else 0
        self.speculative_method = spec.method if spec else ""
        # Drafts are decided on rank 0 alone; the other ranks take them from it
        # (draft_channel), so that no two ranks can ever verify different drafts.
        self.proposer: Proposer | None = None
        if spec is not None and tp.rank == 0:
            self.proposer = make_proposer(spec, self)
        self.draft_channel = None  # under tensor parallelism: set by the group's driver
        self.last_inputs: StepInputs | None = None  # ranks > 0: awaiting sampled tokens
        # Rank 0 (which samples), on the first constrained request: loading the
        # tokenizer and the grammar engine costs a server that never sees one nothing.
        self._grammars: GrammarBook | None = None
        self._grammars_lock = threading.Lock()
        # Rows whose grammar failed here (see _add_matchers): their token is -1.
        self._failed_rows: set[int] = set()
        # The KV connector's side (set once the cache is), and the transfers the last
        # step found ended (on every rank), for its result.
        self.kv_worker: KVWorker | None = None
        self.transfers = NO_TRANSFERS
        # Every rank holds the same block ids: the pool is the smallest rank's (on
        # CUDA a warm-up forward measures it, with everything above in place).
        self.num_blocks = tp.min_over_ranks(self._determine_num_blocks())
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        if hasattr(self.proposer, "allocate"):  # a draft model's cache, on the same blocks
            self.proposer.allocate(self.num_blocks)
        # A new one every start: an older instance's leases and addresses are void.
        self.kv_engine_id = uuid.uuid4().hex[:12]
        self.kv_layout = self._kv_layout()
        self.kv_worker = self._kv_worker()
        tier = self.kv_worker if isinstance(self.kv_worker, HostTier) else None
        self.num_host_blocks = 0 if tier is None else tier.num_slots
        self.batch = self._new_batch()

    @property
    def _all_kv_caches(self) -> list[torch.Tensor]:
        """Every KV tensor of this rank, a draft model's after the model's own."""
        caches = [t for pair in self.kv_caches for t in pair]
        return caches + [t for pair in getattr(self.proposer, "kv_caches", ()) for t in pair]

    def _kv_layout(self) -> str:
        mc, caches = self.model_config, self._all_kv_caches
        return kv_layout(Path(self.config.model).name, {
            "arch": mc.architecture, "dtype": str(self.kv_cache_dtype).removeprefix("torch."),
            "block_size": self.block_size, "tensor_parallel": self.tp.size,
            "tensors": f"{len(caches)}x{list(caches[0].shape[1:])}",
            "block_bytes": self.block_bytes,
        })  # fmt: skip

    def _kv_worker(self) -> KVWorker | None:
        """--kv-offload-bytes: the host tier over every KV tensor of this rank;
        --kv-role: its side of disaggregation, over Mooncake's transfer engine."""
        config = self.config
        if config.kv_offload_bytes:
            num_slots = self.tp.min_over_ranks(config.kv_offload_bytes // self.block_bytes)
            if num_slots < 1:
                raise ValueError(f"--kv-offload-bytes {config.kv_offload_bytes} holds no block "
                                 f"of {self.block_bytes} bytes: raise it")  # fmt: skip
            return HostTier(self._all_kv_caches, num_slots, self.tp, config.kv_offload_path)
        if config.kv_role == "both":
            return None
        return self._disaggregation_side()

    def _disaggregation_side(self) -> KVWorker:
        """--kv-role: every rank's KV tensors registered with Mooncake's transfer engine,
        and its side: reads (decode), or leases and the handshake (prefill, rank 0)."""
        from flagstop.executor.mooncake_transport import MooncakeTransport

        config, tp = self.config, self.tp
        transport = MooncakeTransport(self._all_kv_caches, config.kv_transfer_host or "127.0.0.1",
                                      config.kv_transfer_timeout_s)  # fmt: skip
        if config.kv_role == "decode":
            board = StoreBoard(tp.store) if tp.size > 1 else None
            return DecodeSide(tp.rank, self.kv_layout, transport, tp.mins_over_ranks, board)
        if tp.size > 1:  # every rank's regions, for rank 0's handshake
            tp.store.set(f"flagstop/kv-rank/{tp.rank}", transport.rank.SerializeToString())
        if tp.rank != 0:
            return PrefillFollower(transport)

        def ranks() -> list:
            others = [type(transport.rank).FromString(tp.store.get(f"flagstop/kv-rank/{r}"))
                      for r in range(1, tp.size)]  # fmt: skip
            return [transport.rank, *others]

        return PrefillSide(self.kv_layout, self.kv_engine_id, self.num_blocks,
                           config.kv_lease_s, ranks)  # fmt: skip

    def reset(self) -> None:
        """Forget every request (a new scheduler stream). The cache contents need no
        clearing: nothing is read that the new scheduler has not had written (a load
        still copying is waited out)."""
        if self.kv_worker is not None:
            self.kv_worker.reset()
        self.transfers = NO_TRANSFERS
        self.batch = self._new_batch()
        self.last_inputs = None
        if self._grammars is not None:
            self._grammars.matchers.clear()
        self._failed_rows.clear()
        if self.proposer is not None:
            self.proposer.reset()

    @property
    def grammars(self) -> "GrammarBook":
        """Rank 0's grammars (made on first use, from a compile thread or the step
        loop). Raises GrammarError when the checkpoint has no tokenizer."""
        with self._grammars_lock:
            if self._grammars is None:
                from flagstop.executor.structured import GrammarBook

                self._grammars = GrammarBook(
                    self.config.model, self.model_config.vocab_size,
                    self.model_config.eos_token_ids, self.config.max_num_seqs,
                )  # fmt: skip
            return self._grammars

    def prepare_grammar(self, spec: GrammarSpec) -> float:
        """Compile a constraint ahead of its request (on a thread): seconds taken."""
        return self.grammars.compile(spec)

    def _new_batch(self) -> InputBatch:
        return InputBatch(
            self.config.max_num_seqs, self.max_model_len, self.block_size,
            self.model_config.vocab_size, speculative=self.num_speculative_tokens > 0,
        )  # fmt: skip

    @property
    def block_bytes(self) -> int:
        """A block's bytes on this rank, a draft model's cache included."""
        mc = self.model_config
        itemsize = self.kv_cache_dtype.itemsize
        per_token = 2 * mc.num_layers * self.num_kv_heads * mc.head_dim * itemsize
        return per_token * self.block_size + getattr(self.proposer, "block_bytes", 0)

    def _allocate_kv_caches(self, num_blocks: int) -> list[KVCache]:
        mc = self.model_config
        shape = self.attention_backend.kv_cache_shape(
            num_blocks, self.block_size, self.num_kv_heads, mc.head_dim
        )
        return [
            (
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
            )
            for _ in range(mc.num_layers)
        ]

    def _determine_num_blocks(self) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        if self.device.type != "cuda":
            return max(1, self.config.kv_cache_bytes // self.block_bytes)
        return self._profile_num_blocks()

    def _profile_num_blocks(self) -> int:
        """Like vLLM's profiling: run the largest step once, on a cache just big enough
        for it, then give the KV cache what gpu_memory_utilization leaves at that peak."""
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len - 1)
        self.kv_caches = self._allocate_kv_caches(cdiv(num_tokens, self.block_size))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.batch = self._new_batch()
        self.compute_logits(warmup_plan(num_tokens, self.block_size, self.model_config.vocab_size))
        self.batch = self._new_batch()
        self.model.take_expert_tokens()  # the warm-up's are no step's
        kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)
        torch.cuda.synchronize()
        self.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        # Other processes and the CUDA context; the weights are in the peak below.
        used_elsewhere = total - free - torch.cuda.memory_reserved()
        peak_without_kv = torch.cuda.max_memory_allocated() - kv_bytes
        budget = total * self.config.gpu_memory_utilization - used_elsewhere - peak_without_kv
        if budget < self.block_bytes:
            raise RuntimeError(
                f"no room for the KV cache at gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization}: raise it or lower max_num_batched_tokens"
            )
        return int(budget // self.block_bytes)

    @torch.inference_mode()
    def compute_logits(
        self, plan: SchedulerOutput
    ) -> tuple[torch.Tensor | None, StepInputs] | None:
        """Apply the diff and run the forward: logits [num_sampling, vocab] in plan
        order (with drafts, 1 + drafts rows per sampling request; on rank 0, None on
        the other ranks); None without scheduled tokens."""
        self._apply(plan)
        if not plan.num_scheduled_tokens:
            self._collect_transfers()
            return None
        scheduled = self.batch.schedule(plan)
        drafts = self._drafts(scheduled) if scheduled[4].any() else None
        inputs = prepare_inputs(self.batch, scheduled, self.device, drafts)
        if self.lora is not None:
            self._set_lora_step(inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attention)
        logits = self.model.compute_logits(hidden[inputs.all_logits_indices])
        if self.kv_worker is not None:
            if plan.kv_connector:
                self.kv_worker.after_forward(plan.kv_connector)  # saves what it computed
            self._collect_transfers()
        return logits, inputs

    def _apply(self, plan: SchedulerOutput) -> None:
        """The plan's diff to the persistent batch, and its transfers started (copied
        while the forward runs)."""
        if self._failed_rows or (self._grammars is not None and self._grammars.matchers):
            self._drop_matchers(plan)
        if self.proposer is not None:
            for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
                self.proposer.remove(req_id)
        self.batch.apply(plan)
        if self.tp.rank == 0:
            self._add_matchers(plan)
            if self.proposer is not None:
                for data in (*plan.scheduled_new_reqs, *plan.scheduled_resumed_reqs):
                    self.proposer.add(data.req_id, self.batch.req_rows[data.req_id], self.batch)
        if self.kv_worker is not None and plan.kv_connector:
            self.kv_worker.start(plan.kv_connector)

    def _collect_transfers(self) -> None:
        """What ended (on every rank), for the step's result."""
        if self.kv_worker is not None:
            self.transfers = self.kv_worker.finished()

    def _set_lora_step(self, inputs: StepInputs) -> None:
        """Each token's adapter. A request whose adapter is not registered (unloaded
        while it ran, or never sent to this executor) ends with an error, as a failed
        grammar does; it runs on the base model meanwhile."""
        names, lora = self.batch.lora_names, self.lora
        rows = {row: names[row] for row in inputs.rows.tolist()}
        for row, name in rows.items():
            if name is not None and name not in lora:
                log.error("adapter %r is not loaded here: its request fails", name)
                names[row] = rows[row] = None
                self._failed_rows.add(row)
        lora.set_step(rows, inputs.token_rows)

    def lora_adapters(self) -> dict[str, LoadedAdapter]:
        return {} if self.lora is None else self.lora.summaries()

    def load_lora(self, name: str, path: str) -> LoadedAdapter:
        if self.lora is None:
            raise AdapterError("LoRA is off: start the executor with --max-loras")
        return self.lora.register(name, path).summary()

    def unload_lora(self, name: str) -> bool:
        return self.lora is not None and self.lora.unregister(name)

    def _drafts(self, scheduled: tuple[np.ndarray, ...]) -> Drafts:
        """This step's drafts for the sampling requests' slots: proposed on rank 0 and
        sent to the other ranks, which take them; written after each request's known
        tokens in the token table (where the forward and the penalties read them)."""
        rows, _, _, samples, slots = scheduled
        rows, slots = rows[samples], slots[samples]
        if self.tp.rank == 0:
            drafts = self._propose(rows, slots)
            if self.draft_channel is not None:
                self.draft_channel.send(drafts)
        else:
            drafts = self.draft_channel.receive()
        token_rows = np.repeat(rows, drafts.num_drafts)
        offsets = np.arange(len(token_rows)) - np.repeat(
            np.cumsum(drafts.num_drafts) - drafts.num_drafts, drafts.num_drafts)  # fmt: skip
        self.batch.token_ids[token_rows, self.batch.num_tokens[token_rows] + offsets] = (
            drafts.token_ids)  # fmt: skip
        return drafts

    def _propose(self, rows: np.ndarray, slots: np.ndarray) -> Drafts:
        num_drafts = np.zeros(len(rows), np.int64)
        has = np.flatnonzero(slots)
        if self.proposer is None or not len(has):  # an executor without speculation
            return Drafts(num_drafts, np.zeros(0, np.int64))
        proposed, probs = self.proposer.propose(self.batch, rows[has], slots[has])
        proposed = [p[: int(k)] for p, k in zip(proposed, slots[has].tolist(), strict=True)]
        kept = None
        if self._grammars is not None and self._grammars.matchers:
            proposed, kept = self._grammars.valid_drafts(rows[has], proposed)
        num_drafts[has] = [len(p) for p in proposed]
        if probs is not None and kept is not None:
            probs = probs[torch.from_numpy(kept).to(probs.device)]
        tokens = np.concatenate(proposed) if proposed else np.zeros(0, np.int64)
        return Drafts(num_drafts, tokens.astype(np.int64), probs)

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
        if prompt_logits is not None:
            output.prompt_logprobs = self._prompt_logprobs(prompt_logits, inputs, plan)
        num_known = self.batch.num_tokens[inputs.sampling_rows]
        self.advance(inputs, output.token_ids, output.num_sampled_tokens or None)
        if self.proposer is not None:
            counts = np.asarray(output.num_sampled_tokens or [1] * len(num_known), np.int64)
            self.proposer.verified(self.batch, inputs.sampling_rows, num_known, counts)
        if self._failed_rows:  # after advance: a step in flight may still decode them
            rows = inputs.sampling_rows
            if output.num_sampled_tokens:
                rows = np.repeat(rows, output.num_sampled_tokens)
            output.token_ids = [
                -1 if row in self._failed_rows else token
                for row, token in zip(rows.tolist(), output.token_ids, strict=True)
            ]
        return output

    def _sample(self, logits: torch.Tensor, inputs: StepInputs) -> SampleOutput:
        """A token per sampling request, or with drafts their verification. The
        logprobs are those of the masked distribution."""
        grammars, drafts = self._grammars, inputs.drafts
        constrained = None
        if grammars is not None and grammars.matchers:
            if drafts is None:
                constrained = grammars.mask(logits, inputs.sampling_rows)
            else:
                constrained = grammars.mask_drafts(logits, inputs.sampling_rows, drafts)
        if drafts is None:
            output = sample(logits, inputs.sampling)
        else:
            output = verify(logits, inputs.sampling, drafts)
        if constrained:
            grammars.accept(constrained, output.token_ids, output.num_sampled_tokens or None)
        return output

    def _prompt_logprobs(
        self, logits: torch.Tensor, inputs: StepInputs, plan: SchedulerOutput
    ) -> list[PromptLogprobs]:
        """The model's own logprobs of the prompt tokens this step's chunks score (no
        penalties, no temperature: what transformers' log-softmax gives)."""
        batch, req_ids = self.batch, list(plan.num_scheduled_tokens)
        chunks = [(req_ids[i], int(inputs.rows[i]), first, n)
                  for i, first, n in inputs.prompt_chunks or ()]  # fmt: skip
        targets = np.concatenate([batch.token_ids[row, first : first + n]
                                  for _, row, first, n in chunks])  # fmt: skip
        logprobs = logits.float().log_softmax(dim=-1)
        target_ids = torch.from_numpy(targets.astype(np.int64)).to(logprobs.device)
        chosen = logprobs.gather(1, target_ids.unsqueeze(1)).squeeze(1).tolist()
        num_top = int(max(batch.num_prompt_logprobs[row] for _, row, _, _ in chunks))
        top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
        top_v = top_values.tolist() if top_values is not None else None
        top_i = top_ids.tolist() if top_ids is not None else None
        out, start = [], 0
        for req_id, row, first, n in chunks:
            k = int(batch.num_prompt_logprobs[row])
            entries = [(chosen[j], top_i[j][:k] if k else [], top_v[j][:k] if k else [])
                       for j in range(start, start + n)]  # fmt: skip
            out.append(PromptLogprobs(req_id, first, targets[start : start + n].tolist(), entries))
            start += n
        return out

    def _drop_matchers(self, plan: SchedulerOutput) -> None:
        rows = self.batch.req_rows
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            if (row := rows.get(req_id)) is not None:
                self._failed_rows.discard(row)
                if self._grammars is not None:
                    self._grammars.remove(row)

    def _add_matchers(self, plan: SchedulerOutput) -> None:
        for data in (*plan.scheduled_new_reqs, *plan.scheduled_resumed_reqs):
            params = data.sampling_params
            if params is None or params.grammar is None:
                continue
            start = data.num_prompt_tokens - params.num_prompt_tokens_constrained
            row = self.batch.req_rows[data.req_id]
            try:
                self.grammars.add(row, params.grammar, data.token_ids[start:])
            except GrammarError as e:
                # Only where the scheduler's PrepareGrammar did not run first (an
                # executor that was away): the request ends with an error (a -1 token),
                # the batch goes on; raising would fail every step that resumes it.
                log.error("request %s: %s", data.req_id, e)
                self._failed_rows.add(row)

    def _with_transfers(self, output: SampleOutput) -> SampleOutput:
        output.transfers, self.transfers = self.transfers, NO_TRANSFERS
        return output

    async def step(self, plan: SchedulerOutput) -> SampleOutput:
        """The Runner's step: execute() on the event loop's own thread. The next step
        waits in gRPC's buffers anyway, and a forward on a worker thread ran ~20%
        slower on the CPU (measured with bench/peers.py), its threads contending with
        the loop. A step with nothing to compute, while transfers are under way, gives
        them a moment to end first (the loop serves gRPC meanwhile)."""
        if self.kv_worker is None or not plan.polls_only:
            return self.execute(plan)
        self._apply(plan)
        await self.kv_worker.wait(POLL_WAIT_S)
        self._collect_transfers()
        return self._with_transfers(SampleOutput([]))

    def take_expert_tokens(self) -> list[int] | None:
        return self.model.take_expert_tokens()

    @property
    def tensor_parallel_size(self) -> int:
        return self.tp.size

    def advance(
        self, inputs: StepInputs, token_ids: list[int], num_sampled: list[int] | None = None
    ) -> None:
        # Computed: the tokens before the drafts (the accepted drafts are counted from
        # num_sampled).
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


def warmup_plan(num_tokens: int, block_size: int, vocab_size: int) -> SchedulerOutput:
    token_ids = [i % vocab_size for i in range(num_tokens)]
    blocks = list(range(cdiv(num_tokens, block_size)))
    request = NewRequestData("warmup", token_ids, num_tokens, SamplingParams(), blocks)
    return SchedulerOutput(
        scheduled_new_reqs=[request], num_scheduled_tokens={"warmup": num_tokens}
    )
