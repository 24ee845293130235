"""Constrained sampling on rank 0: grammars compiled against the model's vocabulary
(cached by canonical form), one matcher per constrained row of the persistent batch,
and each step's token bitmask applied to the constrained rows' logits in one
vectorised operation. A batch without constrained rows pays a dict lookup."""

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch

from flagstop.structured import NONE, Constraint, GrammarError, refusal_of, to_grammar

log = logging.getLogger("flagstop.executor")
MAX_CACHED_GRAMMARS = 128
PARALLEL_MASK_CORES = 8


class GrammarBook:
    """Compiled grammars by canonical key (a fresh matcher of each, which requests'
    matchers are copied from), and the matchers of the batch's rows."""

    def __init__(
        self, model_dir: str, vocab_size: int, eos_token_ids: Sequence[int], max_num_reqs: int
    ) -> None:
        """Loads the checkpoint's tokenizer (its vocabulary is what the masks cover).
        Raises GrammarError when there is none."""
        self.vocab_size = vocab_size
        self.tokenizer = _tokenizer(model_dir, vocab_size, eos_token_ids)
        self.compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.lock = threading.Lock()  # compiles run on threads beside the step loop
        self.matchers: dict[int, llguidance.LLMatcher] = {}  # by batch row
        self.waiting: dict[int, Waiting] = {}  # by batch row: constraints not started yet
        self.bitmask = llguidance.torch.allocate_token_bitmask(max_num_reqs, vocab_size)
        # Bit b of a mask word is token 32 * word + b.
        self.bits = torch.arange(32, dtype=torch.int32)
        # The masks of a step's rows on the engine's threads where there are cores to
        # spare; on 2 cores one after another was faster (16 rows: 0.14 vs 0.20 ms).
        cores = os.cpu_count() or 1
        self.executor = llguidance.LLExecutor(cores // 2) if cores >= PARALLEL_MASK_CORES else None

    def compile(self, constraint: Constraint) -> float:
        """Compile (or find) a grammar: the seconds it took, 0 when cached. Raises
        GrammarError."""
        if constraint.kind == NONE or self._cached(constraint.key) is not None:
            return 0.0
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(self.tokenizer, to_grammar(constraint), log_level=0)
        if matcher.is_error():
            raise GrammarError(refusal_of(constraint, matcher.get_error()))
        # The first mask builds the lexer's start: part of compiling, not of a step.
        llguidance.torch.fill_next_token_bitmask(matcher, self.bitmask[-1:].clone(), 0)
        with self.lock:
            self.compiled[constraint.key] = matcher
            while len(self.compiled) > MAX_CACHED_GRAMMARS:
                self.compiled.popitem(last=False)
        return time.perf_counter() - started

    def _cached(self, key: str) -> "llguidance.LLMatcher | None":
        with self.lock:
            compiled = self.compiled.get(key)
            if compiled is not None:
                self.compiled.move_to_end(key)
            return compiled

    def add(self, row: int, constraint: Constraint, output_token_ids: Sequence[int]) -> None:
        """A constrained request took a row: its matcher, brought up to date by
        replaying the tokens it already generated (a resumed or resubmitted request);
        or, while its trigger (the end of its reasoning) has not appeared, a Waiting
        that starts the matcher when it does. Compiles here if nothing did before (an
        executor restarted under running requests): the one case where the step waits
        for a grammar."""
        if constraint.after_token_ids:
            waiting = Waiting(row, constraint, constraint.after_token_ids)
            constrained = waiting.feed(list(output_token_ids))
            if constrained is None:
                self.waiting[row] = waiting
                return
            output_token_ids = constrained
        if constraint.kind != NONE:  # NONE: a budget alone, nothing after its trigger
            self.matchers[row] = self._matcher(constraint, output_token_ids)

    def _matcher(self, constraint: Constraint, output_token_ids: Sequence[int]):
        compiled = self._cached(constraint.key)
        if compiled is None:
            self.compile(constraint)
            compiled = self._cached(constraint.key)
        matcher = compiled.deep_copy()
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            raise GrammarError(f"the request's output breaks its grammar: {matcher.get_error()}")
        return matcher

    def remove(self, row: int) -> None:
        self.matchers.pop(row, None)
        self.waiting.pop(row, None)

    def _waiting_rows(self, sampling_rows: np.ndarray) -> list[tuple[int, "Waiting"]]:
        """(logits row, Waiting) of the rows whose constraint has not started: unmasked,
        their tokens watched for the trigger by accept()."""
        waiting = self.waiting
        if not waiting:
            return []
        return [(i, w) for i, row in enumerate(sampling_rows.tolist()) if (w := waiting.get(row))]

    def mask(self, logits: torch.Tensor, sampling_rows: np.ndarray) -> list[tuple[int, Any]]:
        """Forbid what each constrained row's grammar does not allow next: logits
        [S, V] in place; a waiting row past its budget is forced to its trigger.
        Returns (logits row, matcher or Waiting) of those rows, for accept(). A
        complete grammar allows only EOS."""
        waiting = self._waiting_rows(sampling_rows)
        _force(logits, waiting)
        return self._mask_matchers(logits, sampling_rows) + waiting

    def _mask_matchers(self, logits: torch.Tensor, sampling_rows: np.ndarray) -> list:
        matchers = self.matchers
        constrained = [
            (i, m) for i, row in enumerate(sampling_rows.tolist()) if (m := matchers.get(row))
        ]
        if not constrained:
            return constrained
        n = len(constrained)
        bitmask = self.bitmask[:n]
        if self.executor is not None:
            llguidance.torch.fill_next_token_bitmask_par(
                self.executor, [(m, k) for k, (_, m) in enumerate(constrained)], bitmask
            )
        else:
            for k, (_, matcher) in enumerate(constrained):
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, k)
        # Then one masked fill for every constrained row (on a GPU, queued behind the
        # forward: the masks above were computed while it ran).
        allowed = (bitmask.unsqueeze(-1) >> self.bits) & 1
        forbidden = (allowed.view(n, -1)[:, : logits.shape[1]] == 0).to(logits.device)
        if n == logits.shape[0]:  # every row, in order: in place
            logits.masked_fill_(forbidden, float("-inf"))
        else:
            rows = torch.tensor([i for i, _ in constrained], device=logits.device)
            logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))
        return constrained

    def valid_drafts(
        self, rows: np.ndarray, drafts: list[np.ndarray]
    ) -> tuple[list[np.ndarray], np.ndarray]:
        """Each constrained row's drafts cut to the longest prefix its grammar accepts
        (vLLM's validate_tokens); the flat indices of the drafts kept."""
        out, kept, start = [], [], 0
        for row, draft in zip(rows.tolist(), drafts, strict=True):
            matcher = self.matchers.get(row)
            n = len(draft)
            if matcher is not None and n:
                n = 0 if matcher.is_stopped() else matcher.validate_tokens(draft.tolist())
            elif (waiting := self.waiting.get(row)) is not None:
                n = min(n, waiting.drafts_allowed())
            out.append(draft[:n])
            kept.extend(range(start, start + n))
            start += len(draft)
        return out, np.asarray(kept, np.int64)

    def mask_drafts(self, logits: torch.Tensor, sampling_rows: np.ndarray, drafts) -> list:
        """mask() for a step with drafts: each constrained request's 1 + d rows, row j
        masked by its grammar after drafts 1..j (consumed, then rolled back)."""
        num_rows = drafts.num_rows
        starts = (np.cumsum(num_rows) - num_rows).tolist()
        draft_starts = (np.cumsum(drafts.num_drafts) - drafts.num_drafts).tolist()
        matchers, tokens = self.matchers, drafts.token_ids.tolist()
        waiting = self._waiting_rows(sampling_rows)
        _force(logits, waiting, starts)  # valid_drafts gave a forced row no drafts
        constrained = [
            (i, m) for i, row in enumerate(sampling_rows.tolist()) if (m := matchers.get(row))
        ]
        if not constrained:
            return waiting
        n = sum(int(num_rows[i]) for i, _ in constrained)
        bitmask = llguidance.torch.allocate_token_bitmask(n, self.vocab_size)
        logit_rows, k = [], 0
        for i, matcher in constrained:
            d = int(drafts.num_drafts[i])
            for j in range(d + 1):
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, k)
                logit_rows.append(starts[i] + j)
                k += 1
                if j < d and not matcher.consume_token(tokens[draft_starts[i] + j]):
                    raise RuntimeError("a validated draft broke its grammar")
            if d:
                matcher.rollback(d)
        allowed = (bitmask.unsqueeze(-1) >> self.bits) & 1
        forbidden = (allowed.view(n, -1)[:, : logits.shape[1]] == 0).to(logits.device)
        index = torch.tensor(logit_rows, device=logits.device)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
        return constrained + waiting

    def accept(
        self, constrained: list[tuple[int, Any]], token_ids: list[int],
        num_sampled: list[int] | None = None,
    ) -> None:  # fmt: skip
        """The step's tokens into their matchers (with drafts, num_sampled[i] each).
        A stopped matcher took EOS already: its request ends, and a step that was in
        flight meanwhile samples once more for it (a token nobody reads)."""
        if num_sampled is None:
            by_request = [[t] for t in token_ids]
        else:
            ends = np.cumsum(num_sampled).tolist()
            by_request = [token_ids[e - n : e] for e, n in zip(ends, num_sampled, strict=True)]
        for i, matcher in constrained:
            tokens = by_request[i]
            if isinstance(matcher, Waiting):
                if (after := matcher.feed(tokens)) is None:
                    continue
                row, constraint = (
                    matcher.row,
                    matcher.constraint,
                )  # its trigger came: the constraint starts
                del self.waiting[row]
                if constraint.kind == NONE:
                    continue
                matcher = self.matchers[row] = self._matcher(constraint, [])
                tokens = after
            for token in tokens:
                if matcher.is_stopped():
                    break
                if not matcher.consume_token(token):
                    log.error("sampled token %d is outside its grammar", token)


@dataclass(slots=True)
class Waiting:
    """A row whose constraint applies after its trigger tokens first appear in its
    output (a reasoning model's end of thinking: the answer is constrained, the
    reasoning before it is free, as vLLM has it)."""

    row: int
    constraint: Constraint
    trigger: tuple[int, ...]
    seen: list[int] = field(default_factory=list)  # the output's last tokens, for a match
    count: int = 0  # output tokens so far
    head: list[int] = field(default_factory=list)  # its first ones, for the opening

    def feed(self, tokens: list[int]) -> list[int] | None:
        """The tokens after the trigger, once it has appeared (possibly none); None
        while it has not."""
        opening = len(self.constraint.open_token_ids)
        if len(self.head) < opening:
            self.head += tokens[: opening - len(self.head)]
        self.count += len(tokens)
        n = len(self.trigger)
        seen = self.seen + tokens
        for end in range(n, len(seen) + 1):
            if tuple(seen[end - n : end]) == self.trigger:
                return seen[end:]
        self.seen = seen[-(n - 1) :] if n > 1 else []
        return None

    def forced(self) -> int | None:
        """The trigger's next token, when the budget is spent (a thinking-token budget:
        the reasoning is ended for the model); None otherwise."""
        budget = self.constraint.force_after_within
        if not budget or self._spent() < budget:
            return None
        trigger, seen = self.trigger, self.seen
        begun = next((k for k in range(min(len(seen), len(trigger) - 1), 0, -1)
                      if tuple(seen[-k:]) == trigger[:k]), 0)  # fmt: skip
        return trigger[begun]

    def drafts_allowed(self) -> int:
        """Draft tokens this row may verify: none reaching the budget (where a token
        is forced instead of verified)."""
        budget = self.constraint.force_after_within
        return max(0, budget - self._spent() - 1) if budget else 1 << 30

    def _spent(self) -> int:
        """The reasoning's tokens so far, as the budget counts them: from the opening
        tokens when the model opens its reasoning itself (none if its output does not
        start with them: there is no reasoning to end)."""
        opening = self.constraint.open_token_ids
        if not opening:
            return self.count
        if len(self.head) < len(opening) or tuple(self.head) != opening:
            return 0
        return self.count - len(opening)


def _force(logits: torch.Tensor, waiting: list[tuple[int, Waiting]], rows=None) -> None:
    """Each waiting row past its budget samples its trigger's next token, whatever the
    model's logits say (logits row rows[i] of sampling index i; None: row i)."""
    for i, row in waiting:
        if (token := row.forced()) is not None:
            at = i if rows is None else rows[i]
            logits[at].fill_(float("-inf"))
            logits[at, token] = 0.0


def _tokenizer(model_dir: str, vocab_size: int, eos_token_ids: Sequence[int]):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:
        raise GrammarError(
            f"structured outputs need the model's tokenizer, which {model_dir} lacks ({e})"
        ) from None
    return llguidance.hf.from_tokenizer(
        tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids)
    )
