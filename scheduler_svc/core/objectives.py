"""What a request asks of its latency, and whom it is for: its TTFT and TPOT targets
(None: none stated), its tenant and its class. The scheduler's SLO-aware and fair
policies read them; every latency metric can be broken down by tenant and class."""

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Objectives:
    ttft_s: float | None = None
    tpot_s: float | None = None
    tenant: str = ""
    klass: str = ""  # "class" in every API; a keyword in Python

    def with_defaults(self, ttft_s: float | None, tpot_s: float | None) -> "Objectives":
        """The targets it states, the given ones where it states none."""
        return Objectives(self.ttft_s if self.ttft_s is not None else ttft_s,
                          self.tpot_s if self.tpot_s is not None else tpot_s,
                          self.tenant, self.klass)  # fmt: skip


NO_OBJECTIVES = Objectives()
