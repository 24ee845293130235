"""A request's service objectives, resolved once at the router: its TTFT and TPOT
targets and its tenant and class, from (first found) the request's own fields, the
headers gateways send (llm-d's x-llm-d-slo-ttft-ms / x-llm-d-slo-tpot-ms; ours for
tenant and class), the "tenant" label, and the --slo-defaults for its tenant, its
class, or everyone ("*")."""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, PositiveFloat

from flagstop.scheduler_svc.core.limits import RequestRejected
from flagstop.v1 import generation_pb2, scheduler_pb2

TTFT_HEADER, TPOT_HEADER = "x-llm-d-slo-ttft-ms", "x-llm-d-slo-tpot-ms"
TENANT_HEADER, CLASS_HEADER = "x-flagstop-tenant", "x-flagstop-class"


class SLOTarget(BaseModel):
    """Targets in milliseconds (None: no target)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ttft_ms: PositiveFloat | None = None
    tpot_ms: PositiveFloat | None = None


@dataclass(slots=True, frozen=True)
class RequestObjectives:
    ttft_ms: float = 0.0  # 0: no target
    tpot_ms: float = 0.0
    tenant: str = ""
    klass: str = ""

    def fill(self, add: scheduler_pb2.AddRequest) -> None:
        add.slo_ttft_ms, add.slo_tpot_ms = self.ttft_ms, self.tpot_ms
        add.tenant, add.request_class = self.tenant, self.klass

    def attained(self, ttft_s: float, tpot_s: float | None) -> str:
        """met, missed_ttft, missed_tpot, or no_target (a label for the SLO counter)."""
        if not (self.ttft_ms or self.tpot_ms):
            return "no_target"
        if self.ttft_ms and ttft_s * 1e3 > self.ttft_ms:
            return "missed_ttft"
        if self.tpot_ms and tpot_s is not None and tpot_s * 1e3 > self.tpot_ms:
            return "missed_tpot"
        return "met"


class ObjectiveDefaults:
    def __init__(self, defaults: Mapping[str, SLOTarget]) -> None:
        self.defaults = defaults

    def resolve(
        self, request: generation_pb2.GenerateRequest, metadata: Iterable[tuple[str, str]]
    ) -> RequestObjectives:
        """Raises RequestRejected for a target that is not a positive number."""
        headers = {k.lower(): v for k, v in metadata if isinstance(v, str)}
        tenant = (request.tenant or headers.get(TENANT_HEADER) or request.labels.get("tenant")
                  or "")  # fmt: skip
        klass = request.request_class or headers.get(CLASS_HEADER) or ""
        ttft = _target(request, "slo_ttft_ms", headers, TTFT_HEADER)
        tpot = _target(request, "slo_tpot_ms", headers, TPOT_HEADER)
        for key in (f"tenant:{tenant}", f"class:{klass}", "*"):
            default = self.defaults.get(key)
            if default is not None:
                ttft = ttft if ttft is not None else default.ttft_ms
                tpot = tpot if tpot is not None else default.tpot_ms
        return RequestObjectives(ttft or 0.0, tpot or 0.0, tenant, klass)


def _target(request, field: str, headers: dict[str, str], header: str) -> float | None:
    if request.HasField(field):
        value, where = getattr(request, field), field
    elif header in headers:
        where = f"header {header}"
        try:
            value = float(headers[header])
        except ValueError:
            raise RequestRejected(f"{where} must be a number of milliseconds, got "
                                  f"{headers[header]!r}", field) from None  # fmt: skip
    else:
        return None
    if not value > 0:
        raise RequestRejected(f"{where} must be > 0 milliseconds, got {value}", field)
    return value


def check_default_keys(defaults: Mapping[str, SLOTarget]) -> Mapping[str, SLOTarget]:
    for key in defaults:
        if key != "*" and not key.startswith(("tenant:", "class:")):
            raise ValueError(f"--slo-defaults key {key!r}: use \"tenant:NAME\", \"class:NAME\" "
                             "or \"*\"")  # fmt: skip
    return defaults
