"""Speculative decoding in the runner: each step's drafts for the scheduler's draft
slots, decided in one place. Rank 0's proposer proposes them (cut to what a
constrained row's grammar accepts) and sends them through the channel to the other
ranks, which take them, so that no two ranks can ever verify different drafts; every
rank writes them after its requests' known tokens, where the forward and the
penalties read them. At k = 0 the drafter has no proposer and no step has a slot:
`drafts` returns None before anything else."""

import numpy as np
import torch

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.grammar_rows import GrammarRows
from flagstop.executor.input_batch import InputBatch, ScheduledRows
from flagstop.executor.speculative.config import SpeculativeConfig
from flagstop.executor.speculative.draft_model import DraftModelProposer
from flagstop.executor.speculative.eagle import Eagle3Proposer
from flagstop.executor.speculative.eagle1 import Eagle1Proposer
from flagstop.executor.speculative.mtp import MtpProposer
from flagstop.executor.speculative.proposer import NgramProposer, NoProposer, Proposer
from flagstop.executor.speculative.suffix import SuffixProposer
from flagstop.executor.step_inputs import Drafts, StepInputs
from flagstop.scheduler_svc.core.output import SchedulerOutput


class LocalChannel:
    """One rank: drafts go nowhere."""

    def send(self, drafts: Drafts) -> None:
        pass


class Drafter:
    def __init__(self, proposer: Proposer, leader: bool) -> None:
        """leader: rank 0, which proposes; the others receive (set their channel)."""
        self.proposer, self.leader = proposer, leader
        # Rank 0's sends to the group (GroupDriver), another rank's receives from rank
        # 0 (worker.FollowerDrafts); wired by whoever starts the group.
        self.channel = LocalChannel()

    def added(self, plan: SchedulerOutput, batch: InputBatch) -> None:
        for data in (*plan.scheduled_new_reqs, *plan.scheduled_resumed_reqs):
            self.proposer.add(data.req_id, batch.req_rows[data.req_id], batch)

    def removed(self, plan: SchedulerOutput) -> None:
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            self.proposer.remove(req_id)

    def drafts(
        self, batch: InputBatch, scheduled: ScheduledRows, grammars: GrammarRows
    ) -> Drafts | None:
        """This step's drafts for the sampling requests' slots, written after each
        request's known tokens in the token table; None without a slot."""
        if not scheduled.slots.any():
            return None
        rows = scheduled.rows[scheduled.samples]
        slots = scheduled.slots[scheduled.samples]
        if self.leader:
            drafts = self._propose(batch, rows, slots, grammars)
            self.channel.send(drafts)
        else:
            drafts = self.channel.receive()
        token_rows = np.repeat(rows, drafts.num_drafts)
        offsets = np.arange(len(token_rows)) - np.repeat(
            np.cumsum(drafts.num_drafts) - drafts.num_drafts, drafts.num_drafts)  # fmt: skip
        batch.token_ids[token_rows, batch.num_tokens[token_rows] + offsets] = drafts.token_ids
        return drafts

    def _propose(
        self, batch: InputBatch, rows: np.ndarray, slots: np.ndarray, grammars: GrammarRows
    ) -> Drafts:
        num_drafts = np.zeros(len(rows), np.int64)
        has = np.flatnonzero(slots)
        if not len(has):
            return Drafts(num_drafts, np.zeros(0, np.int64))
        proposed, probs = self.proposer.propose(batch, rows[has], slots[has])
        proposed = [p[: int(k)] for p, k in zip(proposed, slots[has].tolist(), strict=True)]
        proposed, kept = grammars.valid_drafts(rows[has], proposed)
        num_drafts[has] = [len(p) for p in proposed]
        if probs is not None and kept is not None:
            probs = probs[torch.from_numpy(kept).to(probs.device)]
        tokens = np.concatenate(proposed) if proposed else np.zeros(0, np.int64)
        return Drafts(num_drafts, tokens.astype(np.int64), probs)

    def verified(
        self, batch: InputBatch, sampling_rows: np.ndarray, num_known: np.ndarray,
        num_sampled: list[int],
    ) -> None:  # fmt: skip
        """After rank 0's step: each sampling row had num_known tokens and took
        num_sampled (1 each without drafts)."""
        counts = np.asarray(num_sampled or [1] * len(num_known), np.int64)
        self.proposer.verified(batch, sampling_rows, num_known, counts)

    def computed(self, batch: InputBatch, inputs: StepInputs) -> None:
        """After rank 0's step: its inputs, with the forward's final hidden states (the
        mtp drafter catches up on them)."""
        self.proposer.computed(batch, inputs)

    def reset(self) -> None:
        self.proposer.reset()


def make_drafter(config: ExecutorConfig, runner, rank: int) -> Drafter:
    """runner: the target's ModelRunner (a draft model shares its device, dtype, block
    pool and attention backend). Only rank 0 proposes."""
    speculative = config.speculative_config
    leader_proposes = speculative is not None and rank == 0
    proposer = make_proposer(speculative, runner) if leader_proposes else NoProposer()
    return Drafter(proposer, leader=rank == 0)


def make_proposer(config: SpeculativeConfig, runner) -> Proposer:
    """runner: the target's ModelRunner (a draft model shares its device, dtype, block
    pool and attention backend)."""
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "mtp":
        return MtpProposer(runner)
    if config.method == "eagle3":
        return Eagle3Proposer(runner, config.model)
    if config.method == "eagle":
        return Eagle1Proposer(runner, config.model)
    if config.method == "suffix":
        return SuffixProposer(config)
    return DraftModelProposer(config, runner)
