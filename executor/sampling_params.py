"""What a request asks of sampling, and what a step's sampling gives back: plain data,
no torch (the executor simulator and the conversions use them too)."""

from dataclasses import dataclass

from flagstop.structured import GrammarSpec


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
    grammar: GrammarSpec | None = None  # set: the output is constrained
    # The prompt's last tokens that are output the grammar already covers (a request
    # resubmitted with its outputs so far in its prompt).
    num_prompt_tokens_constrained: int = 0


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    # Per row, when logprobs were asked for: (sampled token's logprob, top ids, top logprobs).
    logprobs: list[tuple[float, list[int], list[float]] | None] | None = None
