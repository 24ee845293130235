"""A request's service objectives (core/objectives.py), resolved once at the router:
its TTFT and TPOT targets and its tenant and class, from (first found) the request's own fields, the
headers gateways send (llm-d's x-llm-d-slo-ttft-ms / x-llm-d-slo-tpot-ms; ours for
tenant and class), the "tenant" label, and the --slo-defaults for its tenant, its
class, or everyone ("*")."""

from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, PositiveFloat

from flagstop.scheduler_svc.core.limits import RequestRejected
from flagstop.scheduler_svc.core.objectives import Objectives, seconds_of
from flagstop.v1 import generation_pb2

TTFT_HEADER, TPOT_HEADER = "x-llm-d-slo-ttft-ms", "x-llm-d-slo-tpot-ms"
TENANT_HEADER, CLASS_HEADER = "x-flagstop-tenant", "x-flagstop-class"


class SLOTarget(BaseModel):
    """An --slo-defaults entry: targets in milliseconds (None: no target)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ttft_ms: PositiveFloat | None = None
    tpot_ms: PositiveFloat | None = None

    def objectives(self) -> Objectives:
        return Objectives(seconds_of(self.ttft_ms or 0), seconds_of(self.tpot_ms or 0))


class ObjectiveDefaults:
    """The one place a request's targets default: the router's --slo-defaults."""

    def __init__(self, defaults: Mapping[str, SLOTarget]) -> None:
        self.defaults = {key: target.objectives() for key, target in defaults.items()}

    def resolve(
        self, request: generation_pb2.GenerateRequest, metadata: Iterable[tuple[str, str]],
        key_tenant: str = "",
    ) -> Objectives:  # fmt: skip
        """key_tenant: the tenant the request's API key binds, whatever it claims.
        Raises RequestRejected for a target that is not a positive number."""
        headers = {k.lower(): v for k, v in metadata if isinstance(v, str)}
        tenant = (key_tenant or request.tenant or headers.get(TENANT_HEADER)
                  or request.labels.get("tenant") or "")  # fmt: skip
        request_class = request.request_class or headers.get(CLASS_HEADER) or ""
        objectives = Objectives(_target(request, "slo_ttft_ms", headers, TTFT_HEADER),
                                _target(request, "slo_tpot_ms", headers, TPOT_HEADER),
                                tenant, request_class)  # fmt: skip
        for key in (f"tenant:{tenant}", f"class:{request_class}", "*"):
            default = self.defaults.get(key)
            if default is not None:
                objectives = objectives.with_defaults(default)
        return objectives


def _target(request, field: str, headers: dict[str, str], header: str) -> float | None:
    """The target in seconds the request's field or header states in milliseconds."""
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
    return seconds_of(value)


def check_default_keys(defaults: Mapping[str, SLOTarget]) -> Mapping[str, SLOTarget]:
    for key in defaults:
        if key != "*" and not key.startswith(("tenant:", "class:")):
            raise ValueError(f"--slo-defaults key {key!r}: use \"tenant:NAME\", \"class:NAME\" "
                             "or \"*\"")  # fmt: skip
    return defaults
