"""--max-loras as one admission rule: the distinct LoRA adapters a step's batch may
run. A request joins if its adapter runs already or a seat is left; the seats are
counted once a step from the running requests, then taken as requests are admitted."""

from collections.abc import Iterable
from dataclasses import dataclass, field

from flagstop.scheduler_svc.core.request import Request


@dataclass(slots=True)
class AdapterSeats:
    max_loras: int
    names: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, running: Iterable[Request], max_loras: int) -> "AdapterSeats":
        """The seats the running requests hold (none counted without --max-loras)."""
        names = {r.lora_name for r in running if r.lora_name} if max_loras else set()
        return cls(max_loras, names)

    def admits(self, request: Request) -> bool:
        name = request.lora_name
        return not name or name in self.names or len(self.names) < self.max_loras

    def take(self, request: Request) -> None:
        if request.lora_name:
            self.names.add(request.lora_name)
