"""The rules a request must meet to be served at all, written once: the router applies
them before queueing (INVALID_ARGUMENT), the scheduler again on admission (its own
limits may be tighter, and a resubmitted remainder is checked anew)."""

from flagstop.scheduler_svc.core.request import Request


class RequestRejected(ValueError):
    """The request can never be served as asked; the message says why, and param names
    the field to change when there is one (the OpenAI API reports it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_request_length(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, kv_capacity_tokens: int,
    pools: bool = False,
) -> None:  # fmt: skip
    """max_tokens None: up to max_model_len (at least one token is generated). pools:
    a pooling request's, which generates none (its input is all it computes)."""
    if num_prompt_tokens == 0:
        raise RequestRejected("the prompt is empty: send at least one token", "prompt")
    if pools:
        return _check_input_length(num_prompt_tokens, max_model_len, kv_capacity_tokens)
    if max_tokens is not None and max_tokens < 1:
        raise RequestRejected(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    total = num_prompt_tokens + (max_tokens or 1)
    what = f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens or 1})"
    if total > max_model_len:
        raise RequestRejected(
            f"{what} exceeds the model's max_model_len of {max_model_len}: "
            "shorten the prompt or lower max_tokens",
            "max_tokens",
        )
    if total > kv_capacity_tokens:
        # It could never finish: alone on the engine it would still run out of blocks.
        raise RequestRejected(
            f"{what} exceeds the whole KV cache ({kv_capacity_tokens} tokens): "
            "shorten the prompt or lower max_tokens",
            "max_tokens",
        )


def _check_input_length(num_tokens: int, max_model_len: int, kv_capacity_tokens: int) -> None:
    limit, what = min(max_model_len, kv_capacity_tokens), "max_model_len"
    if kv_capacity_tokens < max_model_len:
        what = "whole KV cache"
    if num_tokens > limit:
        raise RequestRejected(f"the input ({num_tokens} tokens) exceeds the model's {what} of "
                              f"{limit} tokens: shorten it", "input")  # fmt: skip


def check_admissible(request: Request, max_model_len: int, kv_capacity_tokens: int,
                     max_loras: int) -> None:  # fmt: skip
    """What the scheduler checks again on admission: the length against its own
    limits, and that a LoRA request can run here under a known identity."""
    check_request_length(request.num_prompt_tokens, request.stop.max_tokens, max_model_len,
                         kv_capacity_tokens, request.pools)  # fmt: skip
    name = request.lora_name
    if name and not max_loras:
        raise RequestRejected(f"LoRA adapter {name!r}: this engine serves none (start the "
                              "executor with --max-loras)")  # fmt: skip
    if name and not request.lora_id:
        # Keyed by name alone, its blocks would be hit after the name is loaded again
        # from other files: the service always resolves the identity.
        raise RequestRejected(f"LoRA adapter {name!r}: no identity (lora_id) given")
