"""The batch's constrained rows, on rank 0: each constrained request's matcher (added
with its row, dropped with it), each step's logits masked by them and its tokens fed
to them, drafts cut to what they accept. The grammar engine and the tokenizer load on
the first constrained request (executor/grammar_book.py): a server that never sees one
pays nothing for them, not even their import (~3 s of llguidance's torch)."""

import logging
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from flagstop.executor.input_batch import InputBatch
from flagstop.executor.sampling_params import SampleOutput
from flagstop.executor.step_inputs import Drafts
from flagstop.scheduler_svc.core.output import SchedulerOutput
from flagstop.structured import Constraint, GrammarError

if TYPE_CHECKING:
    from flagstop.executor.grammar_book import GrammarBook

log = logging.getLogger("flagstop.executor")


class GrammarRows:
    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids, max_num_reqs: int) -> None:
        self.book_args = (model_dir, vocab_size, eos_token_ids, max_num_reqs)
        self._book: GrammarBook | None = None
        self._lock = threading.Lock()  # made from a compile thread or the step loop

    @property
    def book(self) -> "GrammarBook":
        """Compiled grammars and the rows' matchers (made on first use). Raises
        GrammarError when the checkpoint has no tokenizer."""
        with self._lock:
            if self._book is None:
                from flagstop.executor.grammar_book import GrammarBook

                self._book = GrammarBook(*self.book_args)
            return self._book

    @property
    def active(self) -> bool:
        """Whether any row is constrained (one attribute read a step without)."""
        book = self._book
        return book is not None and bool(book.matchers or book.waiting)

    def prepare(self, constraint: Constraint) -> float:
        """Compile a constraint ahead of its request (on a thread): seconds taken."""
        return self.book.compile(constraint)

    def added(self, plan: SchedulerOutput, batch: InputBatch) -> None:
        """The plan's new and resumed requests took rows: a matcher for each
        constrained one, up to date with the tokens it generated already."""
        for data in (*plan.scheduled_new_reqs, *plan.scheduled_resumed_reqs):
            params = data.sampling_params
            if params is None or params.grammar is None:
                continue
            start = data.num_prompt_tokens - params.num_prompt_tokens_constrained
            row = batch.req_rows[data.req_id]
            try:
                self.book.add(row, params.grammar, data.token_ids[start:])
            except GrammarError as e:
                # Only where the scheduler's PrepareGrammar did not run first (an
                # executor that was away): the request ends with an error (a -1 token),
                # the batch goes on; raising would fail every step that resumes it.
                log.error("request %s: %s", data.req_id, e)
                batch.failed_rows.add(row)

    def removed(self, plan: SchedulerOutput, batch: InputBatch) -> None:
        """Before the plan frees their rows: the matchers of the requests that left."""
        if not self.active:
            return
        rows = batch.req_rows
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            if (row := rows.get(req_id)) is not None:
                self._book.remove(row)

    def valid_drafts(
        self, rows: np.ndarray, proposed: list[np.ndarray]
    ) -> tuple[list[np.ndarray], np.ndarray | None]:
        """Each constrained row's drafts cut to what its grammar accepts, and the flat
        indices of those kept (None: all, no row is constrained)."""
        if not self.active:
            return proposed, None
        return self._book.valid_drafts(rows, proposed)

    def mask(self, logits: torch.Tensor, sampling_rows: np.ndarray, drafts: Drafts | None):
        """Forbid in place what each constrained row's grammar does not allow next;
        the constrained rows, for accept()."""
        if not self.active:
            return None
        if drafts is None:
            return self._book.mask(logits, sampling_rows)
        return self._book.mask_drafts(logits, sampling_rows, drafts)

    def accept(self, constrained, output: SampleOutput) -> None:
        if constrained:
            self._book.accept(constrained, output.token_ids, output.num_sampled_tokens or None)

    def reset(self) -> None:
        if self._book is not None:
            self._book.matchers.clear()
            self._book.waiting.clear()
