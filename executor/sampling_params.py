"""What a request asks of sampling, and what a step's sampling gives back: plain data,
no torch (the executor simulator and the conversions use them too)."""

from dataclasses import dataclass

from flagstop.scheduler_svc.core.output import StepOutcome
from flagstop.structured import Constraint


@dataclass(slots=True, frozen=True)
class Pooling:
    """A pooling request's (docs/pooling.md): what its prompt's last hidden state
    becomes. embed: the first `dimensions` values (0: all), unit length if normalize
    (None: as the model does); classify, score: the class probabilities, or with
    activation False the logits."""

    task: str = "embed"
    dimensions: int = 0
    normalize: bool | None = None
    activation: bool = True


@dataclass(slots=True, frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    min_tokens: int = 0
    # Every token that would end the request (EOS unless ignore_eos, and the stop
    # token ids): masked while fewer than min_tokens were generated.
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: off; n: the sampled token's and the top n
    grammar: Constraint | None = None  # set: the output is constrained
    # The prompt's last tokens that are output the grammar already covers (a request
    # resubmitted with its outputs so far in its prompt).
    num_prompt_tokens_constrained: int = 0
    # Logits processing (executor/sampling.py), neutral by default.
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None  # None: off; n: each prompt token's and the top n
    pooling: Pooling | None = None  # set: pooled at the prompt's end, never sampled

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )  # fmt: skip


# A token's logprob entry: (its logprob, the top ids, their logprobs).
TokenLogprobs = tuple[float, list[int], list[float]]


@dataclass(slots=True)
class PromptLogprobs:
    """One request's prompt tokens first_token.. of one step (a prefill chunk)."""

    req_id: str
    first_token: int
    token_ids: list[int]  # the prompt's tokens first_token..
    entries: list[TokenLogprobs]


@dataclass(slots=True)
class SampleOutput(StepOutcome):
    """A step's outcome (the core's StepOutcome: tokens, with drafts their counts, and
    the transfers that ended since the step before: loads ended on every rank or
    failed, leases of handed-off blocks a decode side no longer reads), and what only
    the router reads: logprobs per token when asked for, and prompt logprobs."""

    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[PromptLogprobs] | None = None
