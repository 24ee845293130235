"""How an MoE router turns its logits into each token's experts and weights: the rule,
read from the config without torch (the simulator imports the config); moe.py's
select_experts runs it.

The plain rule (Mixtral, Qwen-MoE, gpt-oss) is a softmax and its top-k. DeepSeek's
families add: sigmoid scores; a choice limited to the topk_group best of n_group
expert groups; for V3 (`noaux_tc`) a per-expert correction bias that steers the choice
but not the weights, and groups ranked by their two best biased scores (V2's
`group_limited_greedy` ranks them by their best score); and the chosen weights scaled by
routed_scaling_factor. transformers' DeepseekV2/V3 and Glm4Moe routers are the
reference (tests/test_moe_routing.py)."""

from dataclasses import dataclass
from typing import Any

from flagstop.executor.models.quantization import ConfigError

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(slots=True, frozen=True)
class Routing:
    scoring: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = False
    scaling: float = 1.0

    @property
    def corrected(self) -> bool:
        """A correction bias (e_score_correction_bias) steers the choice."""
        return self.topk_method == "noaux_tc"

    @property
    def plain(self) -> bool:
        """The softmax top-k (renormalised or not)."""
        return self.scoring == "softmax" and self.topk_method == "greedy" and self.scaling == 1.0

    @classmethod
    def deepseek(cls, hf: dict[str, Any], version: int) -> "Routing":
        """DeepSeek-V3's (and GLM-4.5's, Kimi-K2's) or V2's rule from its config: V3
        always scores by sigmoid and chooses by noaux_tc, whatever scoring_func says
        (transformers' router does the same); V2 scores by softmax."""
        n_group, topk_group = hf.get("n_group") or 1, hf.get("topk_group") or 1
        num_experts = hf.get("n_routed_experts") or hf.get("num_experts") or 0
        if n_group <= 0 or num_experts % n_group or not 0 < topk_group <= n_group:
            raise ConfigError(f"n_group={n_group}, topk_group={topk_group}: the experts "
                              f"({num_experts}) split into n_group equal groups, of which "
                              f"topk_group (1..n_group) are chosen")  # fmt: skip
        method = "noaux_tc" if version == 3 else hf.get("topk_method", "greedy")
        if method not in TOPK_METHODS:
            raise ConfigError(f"topk_method={method!r}: one of {TOPK_METHODS}")
        return cls(
            scoring="sigmoid" if version == 3 else "softmax",
            topk_method=method,
            n_group=n_group,
            topk_group=topk_group,
            renormalize=version == 3 and bool(hf.get("norm_topk_prob", True)),
            scaling=float(hf.get("routed_scaling_factor") or 1.0),
        )
