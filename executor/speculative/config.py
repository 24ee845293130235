"""--speculative-config: vLLM's JSON, validated once (a bad one stops start-up with
one line naming the field)."""

import importlib.util
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

# vLLM's MAX_SPEC_LEN: past it the verification rows cost more than they save.
MAX_SPEC_TOKENS = 32
# vLLM's default n-gram window when neither bound is given ("arbitrarily chosen").
DEFAULT_PROMPT_LOOKUP = 5
# vLLM's older per-model names of mtp, which model cards still print.
MTP_ALIASES = ("deepseek_mtp", "qwen3_next_mtp", "glm4_moe_mtp", "qwen3_5_mtp")


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    method: Literal["ngram", "draft_model", "suffix", "mtp", "eagle3", "eagle"]
    """ngram: prompt lookup; draft_model: a smaller checkpoint of the same tokenizer;
    suffix: suffix decoding over the prompt and earlier outputs (arctic-inference);
    mtp: the checkpoint's own multi-token prediction layer (DeepSeek-V3, GLM-4.5,
    Qwen3-Next, Qwen3.5; vLLM's older names qwen3_next_mtp, deepseek_mtp ... too);
    eagle3: an EAGLE-3 draft head (`model`: its directory) fed three of the target's
    layers' hidden states; eagle: an EAGLE-1 head, fed its final hidden states"""
    num_speculative_tokens: int = Field(3, ge=1, le=MAX_SPEC_TOKENS)
    """draft tokens a request gets a step at most (suffix: the cap of its adaptive length)"""
    prompt_lookup_min: PositiveInt | None = None
    """ngram: the shortest suffix to match (one bound given: the other mirrors it; none: 5)"""
    prompt_lookup_max: PositiveInt | None = None
    """ngram: the longest suffix to match"""
    model: str | None = None
    """draft_model: the draft checkpoint directory; eagle3, eagle: the head's"""
    draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"
    """draft_model: greedy drafts, or drafts sampled from the draft's distribution
    (its probabilities go to the rejection sampler)"""
    suffix_decoding_max_tree_depth: PositiveInt = 24
    suffix_decoding_max_cached_requests: int = Field(10000, ge=0)
    suffix_decoding_max_spec_factor: float = Field(1.0, gt=0)
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0, le=1)

    @field_validator("method", mode="before")
    @classmethod
    def _mtp_by_another_name(cls, method: object) -> object:
        return "mtp" if method in MTP_ALIASES else method

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram" and (lo or hi):
            raise ValueError("prompt_lookup_min/max are for method ngram")
        if self.method == "ngram":
            lo = lo or hi or DEFAULT_PROMPT_LOOKUP
            hi = hi or lo
            if lo > hi:
                raise ValueError(f"prompt_lookup_min {lo} exceeds prompt_lookup_max {hi}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        if (self.method in ("draft_model", "eagle3", "eagle")) != (self.model is not None):
            raise ValueError("model (the draft checkpoint or head) is needed by, and only by, "
                             "draft_model, eagle3 and eagle")  # fmt: skip
        if self.method == "suffix" and importlib.util.find_spec("arctic_inference") is None:
            raise ValueError("method suffix needs arctic-inference: pip install "
                             "'flagstop[suffix]' (make venv installs it)")  # fmt: skip
        return self
