"""A request's KV hand-off: the blocks a transfer still reads after the request ended
(kv_connector.py's connectors make them; a request carries the one it was given)."""

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class KVHandoff:
    """Blocks a transfer still reads after their request ended, freed once the
    executor names transfer_id in finished_sending. A prefill replica's hand-off
    (disaggregation) fills in the rest: where the prompt's KV waits for its decode
    replica (the prefill executor's address and instance, the blocks, and how many of
    the prompt's tokens they hold)."""

    transfer_id: str
    endpoint: str = ""
    engine_id: str = ""
    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
