"""--step-cost-out PATH: the step-cost model the scheduler fits from its executor's
measured steps (core/step_cost.py), written as JSON every few seconds and at drain,
in the executor simulator's terms, so that flagstop-replay --cost-model PATH replays
traffic with this stack's own step times (docs/policy.md, "Calibrating the replay").
Written to a temporary file and renamed: a reader never sees half of one."""

import json
import os
import time
from pathlib import Path

from flagstop.scheduler_svc.core.step_cost import StepCostModel

WRITE_EVERY_S = 2.0


class NoCostRecord:
    def step_measured(self, cost: StepCostModel) -> None:
        pass

    def write(self, cost: StepCostModel) -> None:
        pass


class CostRecord:
    def __init__(self, path: Path) -> None:
        self.path, self.written_at = path, 0.0

    def step_measured(self, cost: StepCostModel) -> None:
        if time.monotonic() - self.written_at >= WRITE_EVERY_S:
            self.write(cost)

    def write(self, cost: StepCostModel) -> None:
        self.written_at = time.monotonic()
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps(cost.figures(), indent=2) + "\n")
        os.replace(temporary, self.path)


def cost_record(path: Path | None) -> NoCostRecord | CostRecord:
    return NoCostRecord() if path is None else CostRecord(path)
