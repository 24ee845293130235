"""What a request asks of its latency, and whom it is for: its TTFT and TPOT targets
(None: none stated), its tenant and its class. One type from the router's front to
the policies: the router resolves it (router/objective_defaults.py), the scheduler's
SLO-aware and fair policies read it, every latency metric is broken down by its
tenant and class.

Seconds everywhere inside; the wire (HTTP fields and headers, --slo-defaults,
AddRequest, the policy protocol, a recorded trace) speaks milliseconds with 0 for no
target, converted by `seconds_of` and `ms_of` where a message is read or written."""

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Objectives:
    ttft_s: float | None = None
    tpot_s: float | None = None
    tenant: str = ""
    request_class: str = ""  # "class" in every API

    def with_defaults(self, defaults: "Objectives") -> "Objectives":
        """The targets it states, the defaults' where it states none."""
        return Objectives(self.ttft_s if self.ttft_s is not None else defaults.ttft_s,
                          self.tpot_s if self.tpot_s is not None else defaults.tpot_s,
                          self.tenant, self.request_class)  # fmt: skip

    def attained(self, ttft_s: float, tpot_s: float | None) -> str:
        """met, missed_ttft, missed_tpot, or no_target (a label for the SLO counter)."""
        if self.ttft_s is None and self.tpot_s is None:
            return "no_target"
        if self.ttft_s is not None and ttft_s > self.ttft_s:
            return "missed_ttft"
        if self.tpot_s is not None and tpot_s is not None and tpot_s > self.tpot_s:
            return "missed_tpot"
        return "met"


NO_OBJECTIVES = Objectives()


def seconds_of(ms: float) -> float | None:
    """A wire target in milliseconds (0: none) in seconds (None: none)."""
    return ms / 1e3 if ms else None


def ms_of(seconds: float | None) -> float:
    """A target in seconds (None: none) in the wire's milliseconds (0: none), to the
    nanosecond: a target stated in ms comes back as stated (1001, not 1000.9999...)."""
    return 0.0 if seconds is None else round(seconds * 1e3, 6)
