"""A model of the executor's step time, fitted online from its measured steps: what
the SLO policy predicts time-to-first-token and the decodes' time per output token
by.

    seconds = a + b x scheduled tokens + c x context tokens + d x encoder tokens

(the executor simulator's cost model has this shape, less the last term; context: the scheduled
requests' tokens in the KV cache once the step ran, what attention reads; encoder
tokens: the image embedding tokens the vision encoder computed, docs/multimodal.md,
a term no text step exercises, which then stays at its prior). A term per
running request instead of per context token was tried first: on the Mooncake trace
(12k-token contexts beside 1k ones) its fit blamed long prefills' context on every
decode and starved prefill (bench/slo_bench.py). Fitted by recursive least squares
with forgetting, so it follows a model or load that changes; until steps are
measured it answers with its prior (the simulator's defaults: an 8B model on an
H200)."""

from dataclasses import dataclass, field

# Features scaled to about 1 so that the 4x4 recursion stays well conditioned.
TOKENS_SCALE, CONTEXT_SCALE, ENCODER_SCALE = 1e3, 1e5, 1e3
SCALES = (1.0, TOKENS_SCALE, CONTEXT_SCALE, ENCODER_SCALE)
P_MAX = 100.0


@dataclass(slots=True)
class StepCostModel:
    base_s: float = 0.006
    s_per_token: float = 8e-6
    s_per_context_token: float = 3e-8  # 0.03 µs
    # An image embedding token of a vision tower about a tenth of the language
    # model's size (Qwen2.5-VL-7B's 670M): its four patches cost about a text token.
    s_per_encoder_token: float = 8e-6
    forgetting: float = 0.995
    num_observed: int = 0
    # The estimate's covariance: large at first (the prior is a guess), and kept from
    # growing without bound while steps look alike (forgetting off past P_MAX).
    _p: list[list[float]] = field(
        default_factory=lambda: [[float(i == j) for j in range(4)] for i in range(4)]
    )

    def seconds(self, num_scheduled_tokens: int, num_context_tokens: int,
                num_encoder_tokens: int = 0) -> float:  # fmt: skip
        t = self.base_s + self.s_per_token * num_scheduled_tokens
        t += self.s_per_encoder_token * num_encoder_tokens
        return max(0.0, t + self.s_per_context_token * num_context_tokens)

    def tokens_within(self, seconds: float, num_context_tokens: int) -> int:
        """The most tokens a step can schedule over num_context_tokens of context
        already cached and still take at most seconds (each scheduled token is context
        too once computed); 0 when even an empty step takes longer."""
        per_token = self.s_per_token + self.s_per_context_token
        spare = seconds - self.base_s - self.s_per_context_token * num_context_tokens
        return max(0, int(spare / per_token)) if per_token > 0 else 1 << 30

    def figures(self) -> dict[str, float]:
        """The fit in the executor simulator's terms (its --simulate-* flags, and
        flagstop-replay's), with the number of steps it saw. A term the steps barely
        exercise can fit a little below 0 (measured: -0.01 µs a context token on short
        contexts): a cost is never negative, so it is written as 0."""
        return {"base_ms": max(0.0, self.base_s * 1e3),
                "us_per_scheduled_token": max(0.0, self.s_per_token * 1e6),
                "us_per_context_token": max(0.0, self.s_per_context_token * 1e6),
                "us_per_encoder_token": max(0.0, self.s_per_encoder_token * 1e6),
                "num_observed": self.num_observed}  # fmt: skip

    def observe(self, num_scheduled_tokens: int, num_context_tokens: int, seconds: float,
                num_encoder_tokens: int = 0) -> None:  # fmt: skip
        """One measured step (recursive least squares: a few dozen float operations)."""
        raw = (1.0, num_scheduled_tokens, num_context_tokens, num_encoder_tokens)
        x = [v / scale for v, scale in zip(raw, SCALES, strict=True)]
        weights = (self.base_s, self.s_per_token, self.s_per_context_token,
                   self.s_per_encoder_token)  # fmt: skip
        w = [v * scale for v, scale in zip(weights, SCALES, strict=True)]
        p, n = self._p, len(x)
        lam = self.forgetting if max(p[i][i] for i in range(n)) < P_MAX else 1.0
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        gain_den = lam + sum(x[i] * px[i] for i in range(n))
        k = [v / gain_den for v in px]
        error = seconds - sum(w[i] * x[i] for i in range(n))
        w = [w[i] + k[i] * error for i in range(n)]
        self._p = [[(p[i][j] - k[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        self.base_s, self.s_per_token, self.s_per_context_token, self.s_per_encoder_token = (
            v / scale for v, scale in zip(w, SCALES, strict=True))  # fmt: skip
        self.num_observed += 1
