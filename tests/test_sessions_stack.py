"""Agent sessions on a real stack (docs/sessions.md): a session's prompt kept past
filler traffic that evicts it under LRU (prompt_cache_retention, Anthropic's
cache_control), a ttl past --max-cache-ttl-s cut and said in a header, and salted
tenants that never hit each other's blocks; every signal a cached-token count."""

import random

import httpx
import openai
import pytest

from tools.stack import start_stack

pytestmark = pytest.mark.processes

MODEL = "flagstop-tiny"


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    # 40 blocks of 16 (640 tokens), half of which retained blocks may hold.
    stack = start_stack(model_dir, tmp_path_factory.mktemp("logs"),
                        executor_args=["--num-blocks", "40"],
                        router_args=["--max-cache-ttl-s", "1800"])  # fmt: skip
    yield stack
    assert set(stack.stop().values()) == {0}


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(3, 500) for _ in range(n)]


def cached(client, prompt: list[int], **extra) -> int:
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                      temperature=0, extra_body=extra)  # fmt: skip
    return reply.usage.prompt_tokens_details.cached_tokens


def flush(client, seed: int) -> None:
    """Filler that cycles the whole pool through (LRU evicts every older prefix)."""
    for i in range(6):
        cached(client, tokens(seed * 100 + i, 150))


def test_a_retained_session_prefix_survives_filler_and_an_ordinary_one_does_not(client):
    session, plain = tokens(1, 200), tokens(2, 200)
    cached(client, session, prompt_cache_retention="in_memory")
    cached(client, plain)
    flush(client, 3)
    assert cached(client, [*session, 7, 8]) >= 192  # its 12 full blocks
    assert cached(client, [*plain, 7, 8]) == 0


def test_a_ttl_past_the_operators_limit_is_cut_and_said(stack):
    body = {"model": MODEL, "prompt": tokens(4, 20), "max_tokens": 1,
            "prompt_cache_retention": "24h"}  # fmt: skip
    reply = httpx.post(f"{stack.base_url}/completions", json=body, timeout=60)
    assert reply.status_code == 200
    assert reply.headers["x-flagstop-cache-ttl"] == "1800; clamped"
    body["prompt_cache_retention"] = "in_memory"
    reply = httpx.post(f"{stack.base_url}/completions", json=body, timeout=60)
    assert "x-flagstop-cache-ttl" not in reply.headers


def test_tenants_under_different_salts_never_share_blocks(client):
    prompt = tokens(5, 100)
    cached(client, prompt, cache_salt="tenant-a")
    assert cached(client, [*prompt, 9], cache_salt="tenant-b") == 0
    assert cached(client, [*prompt, 9]) == 0  # unsalted: another tenant too
    assert cached(client, [*prompt, 9], cache_salt="tenant-a") >= 96


def test_anthropic_cache_control_keeps_the_marked_prefix(stack, client):
    """Through the anthropic SDK: the marked system prompt is created, then read back
    after filler, in Anthropic's usage fields."""
    import anthropic

    claude = anthropic.Anthropic(base_url=stack.base_url.removesuffix("/v1"), api_key="none",
                                 max_retries=0, timeout=60)  # fmt: skip
    system = [{"type": "text", "text": "You are a careful assistant. " * 12,
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]  # fmt: skip

    def ask(text: str):
        messages = [{"role": "user", "content": text}]
        return claude.messages.create(model=MODEL, max_tokens=2, system=system,
                                      messages=messages).usage  # fmt: skip

    first = ask("Hello there")
    flush(client, 6)
    again = ask("Another question entirely")
    assert first.cache_read_input_tokens == 0
    created = first.cache_creation_input_tokens
    assert 16 * 5 < created < first.input_tokens + created  # the system prompt
    read = again.cache_read_input_tokens
    assert read >= created // 16 * 16 - 16  # its blocks, kept through the filler
    assert again.cache_creation_input_tokens == max(0, created - read)


def test_grpc_retention_and_the_accounting(stack, client):
    from flagstop.v1 import generation_pb2
    from tests.helpers.metrics import scrape
    from tools.stack import generate

    session = tokens(7, 120)
    before = stack.stats()
    retention = generation_pb2.Retention(priority=80, ttl_s=600.0)
    generate(stack, prompt_token_ids=session, max_tokens=2, retention=retention)
    flush(client, 8)
    _, _, last = generate(stack, prompt_token_ids=[*session, 5], max_tokens=2)
    assert last.usage.cached_tokens >= 112
    after = stack.stats()
    assert after.num_retentions > before.num_retentions
    assert after.retention_hits > before.retention_hits
    metrics = scrape(stack.metrics_ports["scheduler"])
    assert any(k.startswith("flagstop:kv_retention_hits_total") and v > 0
               for k, v in metrics.items())  # fmt: skip
    [card] = httpx.get(f"{stack.base_url}/models", timeout=10).json()["data"]
    assert card["retention"] == {"share": 0.5, "max_ttl_s": 1800.0}


def test_a_sessions_turns_stay_on_one_replica_and_move_when_it_is_lost(model_dir, tmp_path):
    """Turns under one prompt_cache_key (or x-session-id) go where the last one went,
    though each starts with other text (no prefix to route by); with that replica
    killed, the next turn goes to the other and the session goes on from there."""
    from tests.helpers.metrics import scrape
    from tools.stack import start_replicas

    stack = start_replicas(model_dir, tmp_path, 2)
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0,
                               timeout=60)  # fmt: skip

        def turn(i: int, **extra) -> None:
            client.completions.create(model=MODEL, prompt=tokens(100 + i, 40), max_tokens=2,
                                      extra_body=extra)  # fmt: skip

        def routed() -> dict[str, float]:
            metrics = scrape(stack.metrics_ports["router"])
            series = "flagstop:routed_requests_total"
            return {k: v for k, v in metrics.items() if k.startswith(series) and "session" in k}

        turn(0, prompt_cache_key="agent-1")
        for i in range(1, 5):
            turn(i, prompt_cache_key="agent-1")
        [(series, count)] = routed().items()
        assert count == 4
        held = "scheduler-0" if stack.addresses["scheduler-0"] in series else "scheduler-1"
        stack.kill(held.replace("scheduler", "executor"))
        stack.kill(held)
        for i in range(5, 8):
            turn(i, prompt_cache_key="agent-1")
        moved = {k: v for k, v in routed().items() if k != series}
        assert sum(moved.values()) >= 2  # the other replica holds the session now
    finally:
        stack.stop(10)


def test_responses_and_messages_pass_retention_and_the_session_through():
    """Responses' prompt_cache_key and prompt_cache_retention, and Messages' own
    cache_control, reach the engine's request as chat's do."""
    from flagstop.router.openai.chat_request import as_chat
    from flagstop.router.openai.messages_request import MessagesRequest
    from flagstop.router.openai.responses_request import ResponsesRequest

    chat = as_chat(ResponsesRequest(model="m", input="hi", prompt_cache_key="agent-7",
                                    prompt_cache_retention="24h"))  # fmt: skip
    request = chat.choice_request([5, 6], 0)
    assert request.session_id == "agent-7" and request.retention.ttl_s == 86_400
    chat = as_chat(MessagesRequest(model="m", max_tokens=4, cache_control={"type": "ephemeral",
                   "ttl": "1h"}, messages=[{"role": "user", "content": "hi"}]))  # fmt: skip
    assert chat.retention.ttl_s == 3600 and chat.retention.through_message == 0


def test_a_short_retention_expires_and_a_long_one_holds(stack, client):
    """Two sessions retained on gRPC, one for a second and one for ten minutes: past
    the second, filler evicts the first (its retention ran out) and not the other."""
    import time

    from flagstop.v1 import generation_pb2
    from tools.stack import generate

    brief, long = tokens(11, 120), tokens(12, 120)
    for prompt, ttl_s in ((brief, 1.0), (long, 600.0)):
        retention = generation_pb2.Retention(priority=50, ttl_s=ttl_s)
        generate(stack, prompt_token_ids=prompt, max_tokens=2, retention=retention)
    time.sleep(1.5)
    before = stack.stats().retention_expiries
    flush(client, 13)
    assert stack.stats().retention_expiries > before
    assert generate(stack, prompt_token_ids=[*brief, 5], max_tokens=1)[2].usage.cached_tokens == 0
    assert generate(stack, prompt_token_ids=[*long, 5], max_tokens=1)[2].usage.cached_tokens >= 112


def test_tenant_keys_bind_a_cache_and_the_retention_bound_holds(model_dir, tmp_path):
    """Under --tenant-keys each tenant's key salts its requests: the same prompt under
    two tenants' keys never hits, whatever cache_salt a client claims, and under its
    own key always does. A tenant that marks every request retained (priority 100, an
    hour) never holds more than --retention-share of the pool, and every request of
    the others is still served."""
    keys = tmp_path / "keys.json"
    keys.write_text('{"key-acme": "acme", "key-globex": "globex"}')
    stack = start_stack(model_dir, tmp_path, executor_args=["--num-blocks", "40"],
                        router_args=["--tenant-keys", str(keys)])  # fmt: skip
    try:
        acme, globex = (openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0,
                                      timeout=60)
                        for key in ("key-acme", "key-globex"))  # fmt: skip
        prompt = tokens(21, 100)
        cached(acme, prompt)
        assert cached(globex, [*prompt, 9]) == 0
        assert cached(globex, [*prompt, 9], cache_salt="acme") == 0  # no salt crosses a key
        assert cached(acme, [*prompt, 9]) >= 96
        with pytest.raises(openai.AuthenticationError):
            cached(openai.OpenAI(base_url=stack.base_url, api_key="key-initech",
                                 max_retries=0), prompt)  # fmt: skip
        for i in range(8):  # 8 x 10 blocks retained against a bound of 20
            cached(acme, tokens(30 + i, 160), prompt_cache_retention="24h")
            assert stack.stats().num_retained_blocks <= 20
        flush(globex, 31)  # the other tenant's traffic still turns the rest over
        assert stack.wait_idle().num_retained_blocks <= 20
    finally:
        assert set(stack.stop().values()) == {0}
