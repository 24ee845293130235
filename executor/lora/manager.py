"""This rank's adapters: those registered (read from disk and sliced to this rank's
share in host memory, off the step loop) and the max_loras device slots the step's
adapters run from, refilled least recently used first. Filling a slot is a copy of
the adapter's host tensors into every layer's slot (a few MB at most, on the step
that first runs the adapter, as vLLM's activate_adapter does)."""

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from flagstop.adapters import LoadedAdapter
from flagstop.executor.lora.adapter import AdapterError, LoRAAdapter, read_adapter
from flagstop.executor.lora.layers import attach, shard_adapter
from flagstop.executor.lora.mapping import LoRAMapping

log = logging.getLogger("flagstop.executor")


class LoRAManager:
    def __init__(self, model, max_loras: int, max_rank: int) -> None:
        self.model, self.config, self.shard = model, model.config, model.tp.shard
        self.max_loras, self.max_rank = max_loras, max_rank
        self.state, self.layers = attach(model, max_loras, max_rank)
        self.device = model.norm.weight.device
        self.adapters: dict[str, LoRAAdapter] = {}
        self.pieces: dict[str, dict] = {}  # name -> its pieces per layer, this rank's share
        self.slots: OrderedDict[str, int] = OrderedDict()  # resident, least recent first
        self._lock = threading.Lock()  # register/unregister run on the service's threads
        self.pending: dict[str, Future] = {}  # register_in_background's, by name
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="lora")

    def register(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter (raises AdapterError); replaces one of that name."""
        adapter = read_adapter(name, path, self.config, self.max_rank)
        pieces = shard_adapter(adapter, self.layers, self.config, self.shard)
        pieces = {key: [None if p is None else tuple(t.to(self.model.norm.weight.dtype)
                                                     for t in p) for p in parts]
                  for key, parts in pieces.items()}  # fmt: skip
        with self._lock:
            self.adapters[name], self.pieces[name] = adapter, pieces
            self.slots.pop(name, None)  # a replaced adapter refills its slot when next run
        return adapter

    def unregister(self, name: str) -> bool:
        if (future := self.pending.pop(name, None)) is not None:
            future.result()  # read meanwhile: drop it as read
        with self._lock:
            self.slots.pop(name, None)
            self.pieces.pop(name, None)
            return self.adapters.pop(name, None) is not None

    def __contains__(self, name: str) -> bool:
        return name in self.adapters or name in self.pending

    def summaries(self) -> dict[str, LoadedAdapter]:
        return {name: adapter.summary() for name, adapter in self.adapters.items()}

    def register_in_background(self, name: str, path: str) -> None:
        """A rank other than 0: rank 0 read the adapter already, so this rank reads its
        share on a thread while steps go on; the first step that runs it waits for it."""
        self.pending[name] = self.reader.submit(self.register, name, path)

    def set_rows(self, batch, rows: np.ndarray, token_rows: np.ndarray) -> None:
        """The step's adapter of each scheduled row (batch.lora_names) and each token's
        row. A request whose adapter is not registered (unloaded while it ran, or never
        sent to this executor) runs on the base model and fails (batch.failed_rows)."""
        names = batch.lora_names
        by_row = {row: names[row] for row in rows.tolist()}
        for row, name in by_row.items():
            if name is not None and name not in self:
                log.error("adapter %r is not loaded here: its request fails", name)
                names[row] = by_row[row] = None
                batch.failed_rows.add(row)
        self.set_step(by_row, token_rows)

    def set_step(self, names: dict[int, str | None], token_rows: np.ndarray) -> None:
        """This step's adapter per batch row (None: the base model alone) and each
        token's row: fills the slots of adapters not resident and gives the layers
        the step's mapping."""
        used = {n for n in names.values() if n is not None}
        if not used:
            self.state.mapping = None
            return
        slots = self._slots_for(used)
        row_slot = np.full(max(names) + 1, -1, np.int64)
        for row, name in names.items():
            if name is not None:
                row_slot[row] = slots[name]
        self.state.mapping = LoRAMapping.of(row_slot[token_rows], self.device)

    def _slots_for(self, used: set[str]) -> dict[str, int]:
        for name in used & self.pending.keys():
            self.pending.pop(name).result()  # raises what the read raised: ranks disagree
        if len(used) > self.max_loras:
            raise AdapterError(f"{len(used)} adapters in one step, above --max-loras "
                               f"{self.max_loras}")  # fmt: skip
        with self._lock:
            for name in used:
                if name in self.slots:
                    self.slots.move_to_end(name)
            for name in used - set(self.slots):
                self.slots[name] = self._free_slot(used)
                self._fill(self.slots[name], self.pieces[name])
            return {name: self.slots[name] for name in used}

    def _free_slot(self, used: set[str]) -> int:
        taken = set(self.slots.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            return free[0]
        victim = next(n for n in self.slots if n not in used)  # least recently run
        return self.slots.pop(victim)

    @torch.inference_mode()
    def _fill(self, slot: int, pieces: dict) -> None:
        for key, layer in self.layers.items():
            layer.load(slot, pieces.get(key, [None] * len(layer.parts)))


class NoLoRA:
    """--max-loras 0: no slot, no adapter; a step runs the base model alone."""

    def set_rows(self, batch, rows: np.ndarray, token_rows: np.ndarray) -> None:
        pass

    def register(self, name: str, path: str) -> LoRAAdapter:
        raise AdapterError("LoRA is off: start the executor with --max-loras")

    register_in_background = register

    def unregister(self, name: str) -> bool:
        return False

    def summaries(self) -> dict[str, LoadedAdapter]:
        return {}


def lora_manager(model, max_loras: int, max_rank: int, modules: list[tuple[str, str]]):
    """The adapters' manager (NoLoRA without slots), --lora-modules registered:
    refused naming the one that failed."""
    if not max_loras:
        return NoLoRA()
    config = model.config
    if config.mla is not None or config.recurrent is not None:
        kind = "latent attention" if config.mla is not None else "gated DeltaNet layers"
        raise AdapterError(f"--max-loras: LoRA on a model with {kind} ({config.architecture}) "
                           "is not served; start without --max-loras")  # fmt: skip
    manager = LoRAManager(model, max_loras, max_rank)
    for name, path in modules:
        try:
            manager.register(name, path)
        except AdapterError as e:
            raise AdapterError(f"--lora-modules {name}: {e}") from None
    return manager
