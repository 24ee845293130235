"""A model of the executor's step time, fitted online from its measured steps: what
the SLO policy predicts time-to-first-token and the decodes' time per output token
by.

    seconds = a + b x scheduled tokens + c x context tokens

(the executor simulator's cost model has this shape; context: the scheduled
requests' tokens in the KV cache once the step ran, what attention reads). A term per
running request instead of per context token was tried first: on the Mooncake trace
(12k-token contexts beside 1k ones) its fit blamed long prefills' context on every
decode and starved prefill (bench/slo_bench.py). Fitted by recursive least squares
with forgetting, so it follows a model or load that changes; until steps are
measured it answers with its prior (the simulator's defaults: an 8B model on an
H200)."""

from dataclasses import dataclass, field

# Features scaled to about 1 so that the 3x3 recursion stays well conditioned.
TOKENS_SCALE, CONTEXT_SCALE = 1e3, 1e5
P_MAX = 100.0


@dataclass(slots=True)
class StepCostModel:
    base_s: float = 0.006
    s_per_token: float = 8e-6
    s_per_context_token: float = 3e-8  # 0.03 µs
    forgetting: float = 0.995
    num_observed: int = 0
    # The estimate's covariance: large at first (the prior is a guess), and kept from
    # growing without bound while steps look alike (forgetting off past P_MAX).
    _p: list[list[float]] = field(
        default_factory=lambda: [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    )

    def seconds(self, num_scheduled_tokens: int, num_context_tokens: int) -> float:
        t = self.base_s + self.s_per_token * num_scheduled_tokens
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
                "num_observed": self.num_observed}  # fmt: skip

    def observe(self, num_scheduled_tokens: int, num_context_tokens: int, seconds: float) -> None:
        """One measured step (recursive least squares: a few dozen float operations)."""
        x = (1.0, num_scheduled_tokens / TOKENS_SCALE, num_context_tokens / CONTEXT_SCALE)
        w = [self.base_s, self.s_per_token * TOKENS_SCALE, self.s_per_context_token * CONTEXT_SCALE]
        p = self._p
        lam = self.forgetting if max(p[0][0], p[1][1], p[2][2]) < P_MAX else 1.0
        px = [sum(p[i][j] * x[j] for j in range(3)) for i in range(3)]
        gain_den = lam + sum(x[i] * px[i] for i in range(3))
        k = [v / gain_den for v in px]
        error = seconds - sum(w[i] * x[i] for i in range(3))
        w = [w[i] + k[i] * error for i in range(3)]
        self._p = [[(p[i][j] - k[i] * px[j]) / lam for j in range(3)] for i in range(3)]
        self.base_s = w[0]
        self.s_per_token, self.s_per_context_token = w[1] / TOKENS_SCALE, w[2] / CONTEXT_SCALE
        self.num_observed += 1
