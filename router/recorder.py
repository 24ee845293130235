"""--record-workload PATH: every request the router served or refused, one JSON line
as it ends, in flagstop-replay's workload format (docs/policy.md): when it arrived,
its prompt's length and 512-token prefix-block hashes (equal ids: an equal prefix,
so a replay sees the same cache hits; no token is written), its output length, its
objectives, and its session and retention where it has them. A request the router
refused (a full queue, a prompt too long, no replica serving...) is recorded too, as
it arrived, with finish "refused" and the reason: a record taken in an overload holds
all of the load. Replay it with
`flagstop-replay PATH --policy ...`.

Lines are appended with one write each on an O_APPEND descriptor, so router
processes (--processes) can share the file."""

import os
from pathlib import Path

import grpc
import orjson

from flagstop.router.pending import Pending, RequestFailed
from flagstop.router.validation import prompt_ids
from flagstop.scheduler_svc.core.kv_cache_manager import chain_hashes, prefix_root
from flagstop.scheduler_svc.core.limits import RequestRejected
from flagstop.scheduler_svc.core.objectives import ms_of
from flagstop.scheduler_svc.core.request import FinishReason
from flagstop.v1.scheduler_pb2 import AddRequest

RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
BLOCK_TOKENS = 512  # the traces' (Mooncake's) block: replay's TRACE_BLOCK_TOKENS


class NoRecorder:
    def record(self, pending: Pending) -> None:
        pass

    def refused(self, request, tokenizer, arrival: float, failure: RequestFailed) -> None:
        pass


class WorkloadRecorder:
    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(self, pending: Pending) -> None:
        trace, request = pending.trace, pending.request
        objectives = trace.objectives
        num_output = len(pending.generated)
        entry = {
            "arrival_s": pending.add.arrival_time,
            "prompt_tokens": len(pending.prompt_token_ids),
            "output_tokens": num_output or (request.max_tokens if request.HasField("max_tokens")
                                            else 1),
            "block_hashes": block_ids(pending.prompt_token_ids, pending.add),
            "tenant": objectives.tenant, "class": objectives.request_class,
            "ttft_ms": ms_of(objectives.ttft_s) or None,
            "tpot_ms": ms_of(objectives.tpot_s) or None,
            "finish": _finish(pending),
        }  # fmt: skip
        self._write(entry | _session(pending.add))

    def refused(self, request, tokenizer, arrival: float, failure: RequestFailed) -> None:
        """A request refused before it was queued: its arrival, its prompt (when it
        tokenizes) and what it asked for, and why it was refused."""
        try:
            token_ids = prompt_ids(request, tokenizer)
        except RequestRejected:
            token_ids = list(request.prompt_token_ids)
        entry = {
            "arrival_s": arrival, "prompt_tokens": len(token_ids),
            "output_tokens": request.max_tokens if request.HasField("max_tokens") else 1,
            "block_hashes": block_ids(token_ids), "tenant": request.tenant,
            "class": request.request_class,
            "ttft_ms": request.slo_ttft_ms if request.HasField("slo_ttft_ms") else None,
            "tpot_ms": request.slo_tpot_ms if request.HasField("slo_tpot_ms") else None,
            "finish": "refused", "reason": f"{failure.code.name}: {failure.message}",
        }  # fmt: skip
        self._write(entry)

    def _write(self, entry: dict) -> None:
        os.write(self.fd, orjson.dumps(entry) + b"\n")


def block_ids(token_ids: list[int], add: AddRequest | None = None) -> list[int]:
    """One id per full 512-token block, chained (equal ids: equal prefixes), short
    enough to read: the first 8 bytes of the scheduler's own block hash, from its
    root (its adapter and cache salt: a replay sees two tenants' blocks apart)."""
    root = prefix_root(add.lora_id, add.cache_salt) if add is not None else b""
    hashes = chain_hashes(token_ids, BLOCK_TOKENS, parent_hash=root)
    return [int.from_bytes(h[:8], "big") for h in hashes]


def _session(add: AddRequest) -> dict:
    """Its session and its retention, where it has them (replay models both)."""
    entry = {"session": add.session_id} if add.session_id else {}
    if add.HasField("retention") and add.retention.priority > 0:
        r = add.retention
        entry["retention"] = {"priority": r.priority, "ttl_s": r.ttl_s,
                              "num_tokens": r.num_tokens}  # fmt: skip
    return entry


def _finish(pending: Pending) -> str:
    if pending.error is not None:
        return "shed" if pending.error.code == RESOURCE_EXHAUSTED else "error"
    if pending.finish_reason:
        return FinishReason(pending.finish_reason).label
    return "cancelled"


def recorder(path: Path | None) -> NoRecorder | WorkloadRecorder:
    return NoRecorder() if path is None else WorkloadRecorder(path)
