"""What the shell's parts share of the core: the scheduler once the executor has
described itself (None until then: requests are refused meanwhile), the model's EOS
ids, and whether the service still admits (false once it drains). The service, the
composition root, fills it in; the parts read it, and never the service itself."""

from dataclasses import dataclass

from flagstop.scheduler_svc.core.scheduler import Scheduler


@dataclass(slots=True)
class CoreHandle:
    scheduler: Scheduler | None = None
    eos_token_ids: frozenset[int] = frozenset()
    accepting: bool = True
