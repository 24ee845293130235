"""What the executor service drives, declared once: the model runner
(executor/model_runner.py, a real model on a paged KV cache) and the executor
simulator (executor/simulator.py, a load-test tool) both implement it."""

from typing import TYPE_CHECKING, Protocol

from flagstop.adapters import LoadedAdapter
from flagstop.executor.config import ExecutorConfig
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.sampling_params import SampleOutput
from flagstop.scheduler_svc.core.kv_groups import KVCacheGroup, KVLayer
from flagstop.scheduler_svc.core.output import SchedulerOutput
from flagstop.structured import Constraint

if TYPE_CHECKING:
    from flagstop.executor.kv_transfers.base import KVWorker


class Runner(Protocol):
    config: ExecutorConfig
    model_config: ModelConfig
    max_model_len: int
    block_size: int
    num_blocks: int  # the KV pool, in blocks of block_size tokens
    # The layers as the KV cache holds them, and the groups they make (kv_groups.py):
    # Describe sends the layers, the scheduler builds the same groups from them.
    kv_layers: list[KVLayer]
    kv_groups: list[KVCacheGroup]
    num_host_blocks: int  # its host tier (--kv-offload-bytes), in blocks; 0: none
    tensor_parallel_size: int
    # Speculative decoding: the most draft tokens a request gets a step (0: off),
    # and how they are proposed.
    num_speculative_tokens: int
    speculative_method: str
    # The KV connector's executor side (executor/kv_transfers/base.py; NoKVWorker without
    # one); the KV layout two executors must share to exchange blocks, and this
    # instance's id.
    kv_worker: "KVWorker"
    kv_layout: str
    kv_engine_id: str

    @property
    def device(self) -> object:
        """Where it runs, for the start-up line."""
        ...

    def reset(self) -> None:
        """Forget every request: a new scheduler stream starts from an empty batch."""
        ...

    async def step(self, plan: SchedulerOutput) -> SampleOutput:
        """Apply the plan to the persistent batch, run the step and return the tokens
        of the requests that sample, in plan order."""
        ...

    def take_expert_tokens(self) -> list[int] | None:
        """A Mixture-of-Experts model: the (token, expert) pairs each expert took over
        its sparse layers since the last call (the step span's); None otherwise."""
        ...

    max_loras: int  # LoRA slots (0: no LoRA)

    def lora_adapters(self) -> dict[str, LoadedAdapter]:
        """The adapters registered, by name."""
        ...

    def load_lora(self, name: str, path: str) -> LoadedAdapter:
        """Read and register an adapter (called on a thread), replacing one of that
        name (the service refuses that unless asked). Raises ValueError naming what
        is refused."""
        ...

    def unload_lora(self, name: str) -> bool:
        """Drop an adapter; False when none of that name is registered."""
        ...

    def prepare_media(self, key: bytes, pixels: bytes, shape: list[int], dtype: str,
                      grid: list[int]) -> None:  # fmt: skip
        """An image's pixels (the router's processor's), kept by its hash until an
        encoder step needs them. Raises ValueError (a text-only model, bad pixels)."""
        ...

    def prepare_grammar(self, grammar: Constraint) -> float:
        """Compile a request's output constraint ahead of it (called on a thread);
        the seconds it took. Raises GrammarError."""
        ...
