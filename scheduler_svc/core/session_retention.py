"""What the built-in slo and fair policies keep of a request's KV once it ends
(docs/sessions.md): an agent session's next turn comes within a tool call's gap
(seconds to minutes) and resends the whole of this one, prompt and output, so a
session's turn is retained; a batch job's prefix is rarely asked again, so a batch
request's is not, whatever it asked. Requests neither, and a session's turn that asked
its own retention, keep what they asked."""

from collections.abc import Callable, Iterable

from flagstop.scheduler_svc.core.request import ALL_TOKENS, Request, Retention

# Anthropic's default cache lifetime (5m): the tool-call gaps of bench/session_bench.py's
# agents (lognormal, median 6 s, 99th percentile about 80 s) end well within it.
SESSION_TTL_S = 300.0
# OpenAI's in-memory prompt_cache_retention's (the router's): a policy's session is
# kept as long as a client's ask.
SESSION_PRIORITY = 50
BATCH_CLASS = "batch"


def session_retention(
    waiting: Iterable[Request], priority: Callable[[Request], int] = lambda r: SESSION_PRIORITY
) -> dict[str, Retention | None]:
    """The waiting requests whose retention the policy changes, and to what (a
    request's first step applies it: a request is decided once)."""
    retain = {}
    for request in waiting:
        if (wanted := _wanted(request, priority)) != request.retention:
            retain[request.request_id] = wanted
    return retain


def _wanted(request: Request, priority: Callable[[Request], int]) -> Retention | None:
    if request.objectives.request_class == BATCH_CLASS:
        return None
    if request.session_id and request.retention is None:
        return Retention(priority(request), SESSION_TTL_S, ALL_TOKENS)
    return request.retention
