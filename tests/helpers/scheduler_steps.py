"""Scheduler requests and steps for the in-process tests: a request with a seeded
prompt, one step with its outputs applied, steps until idle."""

import zlib

from flagstop.scheduler_svc.core.output import SchedulerOutput, StepOutcome
from flagstop.scheduler_svc.core.request import Request, StopParams
from flagstop.scheduler_svc.core.scheduler import Scheduler
from tests.helpers.scheduler_invariants import check_idle, check_invariants

EOS = 2


def make_request(rid: str, num_prompt: int = 4, max_tokens: int = 8, **kw) -> Request:
    stop_kw = {k: kw.pop(k) for k in ("min_tokens", "ignore_eos", "stop_token_ids") if k in kw}
    # crc32, not hash(): str hashes change from run to run, and prompts that collide
    # by chance would share cached prefixes the tests do not expect.
    prompt = kw.pop("prompt", [10 + (zlib.crc32(rid.encode()) + i) % 50 for i in range(num_prompt)])
    if kw.get("lora_name"):  # the service gives each adapter its identity: here one a name
        kw.setdefault("lora_id", f"files-of-{kw['lora_name']}")
    return Request(
        rid,
        kw.pop("owner", "router-0"),
        prompt,
        StopParams(max_tokens, **stop_kw),
        eos_token_ids=frozenset({EOS}),
        **kw,
    )


def step(scheduler: Scheduler, token: int = 7) -> tuple[SchedulerOutput, dict]:
    """Schedule and immediately apply outputs: every request at the end of its known
    tokens samples `token`."""
    plan = scheduler.schedule()
    check_invariants(scheduler)
    outputs = scheduler.update_from_output(plan, StepOutcome([token] * len(plan.sampling_requests)))
    check_invariants(scheduler)
    return plan, outputs


def run_to_idle(scheduler: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    plans = []
    while scheduler.has_unfinished_requests():
        assert len(plans) < max_steps
        plans.append(step(scheduler)[0])
    check_idle(scheduler)
    return plans
