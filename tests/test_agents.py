"""What reasoning models and agents need, through the real SDKs (openai, anthropic)
against a real stack serving a thinking model (the embedded one with <think> tokens
and Qwen3's switch): reasoning split from the answer in chat, streamed and whole, and
in the Responses API, for each --reasoning-parser; the thinking switch reaching the
template; an output constraint that waits for the reasoning's end; tool calls read
from the answer; "required" calls given out as each closes, and cut by max_tokens
(the cut one content); the prompt fields on every chat-shaped route; Anthropic's
Messages API (text, tools, thinking, its events' order, its errors, the x-api-key);
the Responses fields that were once dropped; unknown routes, /version and the
engine's series on the router's /metrics.

Outputs are scripted with output constraints (a router started with
--structured-outputs-in-reasoning lets them cover the reasoning too)."""

import json
import re
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

from tests.helpers.metrics import scrape
from tools.make_model import END_THINK, THINK, VOCAB_SIZE, write_model
from tools.stack import free_port, spawn, start_stack, wait_serving

pytestmark = pytest.mark.processes

MODEL = "flagstop-thinking"
CITY = {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": CITY}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
THOUGHT, ANSWER = "Oslo is in Norway.", "It is sunny."
# A qwen3-style output: reasoning between tags, then the answer.
THINKING_OUTPUT = f"<think>{THOUGHT}</think>{ANSWER}"
# deepseek_r1's templates open the reasoning in the prompt: the output only closes it.
R1_OUTPUT = f"{THOUGHT}</think>{ANSWER}"


# The thinking model's added tokens (after the embedded vocabulary).
THINK_IDS = {THINK: VOCAB_SIZE, END_THINK: VOCAB_SIZE + 1}


def script(text: str) -> dict:
    """The output constraint that makes the model write text, its <think> and </think>
    as the tokens a thinking model writes (llguidance takes added tokens of the form
    <...> as special ones, which a grammar names by id)."""
    parts = [p for p in re.split("(</?think>)", text) if p]
    items = [f"<[{THINK_IDS[p]}]>" if p in THINK_IDS else json.dumps(p) for p in parts]
    return {"structured_outputs": {"grammar": "start: " + " ".join(items)}}


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model") / MODEL, thinking=True)


@pytest.fixture(scope="module")
def stack(thinking_model, tmp_path_factory):
    stack = start_stack(
        thinking_model, tmp_path_factory.mktemp("logs"), executor_args=["--num-blocks", "200"],
        router_args=["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                     "--structured-outputs-in-reasoning"],
    )  # fmt: skip
    yield stack
    assert set(stack.stop().values()) == {0}
    assert "Traceback" not in (stack.log_dir / "router.log").read_text()


def extra_router(stack, model_dir, log_dir, *args: str, key: str | None = None):
    """Another router on the stack's scheduler: (its process, its HTTP root)."""
    port, http = free_port(), free_port()
    command = ["-m", "flagstop.router", "--model", str(model_dir), "--scheduler",
               stack.scheduler, "--port", str(port), "--http-port", str(http),
               "--metrics-port", "0", *args]  # fmt: skip
    env = {"FLAGSTOP_ROUTER_API_KEY": key} if key else None
    router = spawn(f"router-{http}", command, log_dir, env=env)
    wait_serving(stack.channel(f"127.0.0.1:{port}"), router)
    return router, f"http://127.0.0.1:{http}"


@pytest.fixture(scope="module")
def strict(stack, thinking_model, tmp_path_factory):
    """A router whose output constraints wait for the reasoning's end (the default),
    behind an API key. deepseek_r1: the output starts inside the reasoning."""
    router, root = extra_router(stack, thinking_model, tmp_path_factory.mktemp("strict"),
                                "--reasoning-parser", "deepseek_r1", key="sesame")  # fmt: skip
    yield root
    router.terminate()
    assert router.wait(30) == 0


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


def root(stack) -> str:
    return stack.base_url.removesuffix("/v1")


def reasoning_of(message) -> str | None:
    extra = message.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")
    return extra.get("reasoning")


def streamed(stream) -> tuple[str, str, list, str | None]:
    reasoning = content = ""
    calls, finish = [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning") or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


@pytest.mark.parametrize(("flags", "line"), [
    (["--reasoning-parser", "qwen3"], "flagstop-router: --reasoning-parser qwen3: the model's "
     "tokenizer has no single token for '</think>'"),
    (["--reasoning-parser", "openai_gptoss"], "flagstop-router: --reasoning-parser "
     "openai_gptoss needs gpt-oss' tokenizer (o200k_harmony)"),
    (["--tool-call-parser", "openai"], "flagstop-router: --tool-call-parser openai reads "
     "gpt-oss's harmony format: set --reasoning-parser openai_gptoss with it"),
])  # fmt: skip
def test_a_parser_the_model_cannot_serve_stops_start_up_naming_it(model_dir, flags, line):
    """The embedded model writes neither <think> tags nor harmony."""
    command = [sys.executable, "-m", "flagstop.router", "--model", str(model_dir), "--port",
               "0", "--http-port", str(free_port()), "--metrics-port", "0", *flags]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode in (1, 2)  # 2: the settings' own check, as argparse exits
    assert done.stderr.strip().splitlines()[-1].startswith(line)


# -- reasoning output ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_chat_splits_reasoning_from_the_answer(client, stream):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=64, stream=stream,
        extra_body=script(THINKING_OUTPUT),
    )  # fmt: skip
    if stream:
        reasoning, content, _, finish = streamed(reply)
    else:
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        reasoning, content = reasoning_of(message), message.content
        assert reply.usage.completion_tokens_details.reasoning_tokens > 0
    assert (reasoning, content, finish) == (THOUGHT, ANSWER, "stop")


def test_include_reasoning_false_leaves_it_out(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=64,
        extra_body={**script(THINKING_OUTPUT), "include_reasoning": False},
    )  # fmt: skip
    assert reasoning_of(reply.choices[0].message) is None
    assert reply.choices[0].message.content == ANSWER


PARSERS = {  # parser: what the model writes in its format
    "deepseek_r1": R1_OUTPUT, "deepseek_v3": THINKING_OUTPUT, "glm45": THINKING_OUTPUT,
    "kimi_k2": THINKING_OUTPUT,
}  # fmt: skip


@pytest.fixture(scope="module")
def parser_routers(stack, thinking_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("parsers")
    routers = {name: extra_router(stack, thinking_model, log_dir, "--reasoning-parser", name,
                                  "--structured-outputs-in-reasoning")
               for name in PARSERS}  # fmt: skip
    yield {name: url for name, (_, url) in routers.items()}
    for router, _ in routers.values():
        router.terminate()
        assert router.wait(30) == 0


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_each_reasoning_parser_in_chat_and_responses(parser_routers, parser):
    client = openai.OpenAI(base_url=f"{parser_routers[parser]}/v1", api_key="none",
                           max_retries=0, timeout=120)  # fmt: skip
    script_ = script(PARSERS[parser])
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64,
                                           extra_body=script_)  # fmt: skip
    assert (reasoning_of(reply.choices[0].message), reply.choices[0].message.content) == (
        THOUGHT, ANSWER)  # fmt: skip
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64,
                                            stream=True, extra_body=script_)  # fmt: skip
    assert streamed(stream)[:2] == (THOUGHT, ANSWER)
    response = client.responses.create(model=MODEL, input="Weather in Oslo?",
                                       max_output_tokens=64, extra_body=script_)  # fmt: skip
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    assert response.output[0].content[0].text == THOUGHT
    assert response.output_text == ANSWER
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens


def test_a_responses_stream_gives_the_reasoning_events_first(client):
    events = list(client.responses.create(
        model=MODEL, input="Weather?", max_output_tokens=64, stream=True,
        extra_body=script(THINKING_OUTPUT),
    ))  # fmt: skip
    kinds = [e.type for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.delta") < first_text
    assert kinds.index("response.reasoning_text.done") < first_text
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == THOUGHT and events[-1].type == "response.completed"


def test_enable_thinking_false_changes_the_rendered_prompt(stack):
    def rendered(**fields) -> str:
        tokens = httpx.post(f"{root(stack)}/tokenize", json={"messages": ASK, **fields})
        text = httpx.post(f"{root(stack)}/detokenize", json={"tokens": tokens.json()["tokens"]})
        return text.json()["prompt"]

    thinking, switched_off = rendered(), rendered(chat_template_kwargs={"enable_thinking": False})
    assert switched_off == thinking + "<think>\n\n</think>\n\n"
    assert rendered(chat_template_kwargs={"add_generation_prompt": False}) == thinking.removesuffix(
        "<|assistant|>\n")  # fmt: skip


def test_with_thinking_off_the_whole_output_is_the_answer(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=64,
        extra_body={**script(ANSWER), "chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    message = reply.choices[0].message
    assert (reasoning_of(message), message.content) == (None, ANSWER)


def test_an_output_constraint_waits_for_the_reasoning_to_end(strict, thinking_model):
    """The reasoning is free (here: random text), the answer after </think> is held to
    the constraint (three digits)."""
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(thinking_model).convert_tokens_to_ids("</think>")
    client = openai.OpenAI(base_url=f"{strict}/v1", api_key="sesame", max_retries=0)
    found = []
    for seed in range(8):
        message = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=48, temperature=1.0, seed=seed,
            logit_bias={str(end): 6}, extra_body={"guided_regex": "[0-9]{3}"},
        ).choices[0].message  # fmt: skip
        if (reasoning := reasoning_of(message)) and not reasoning.strip().isdigit():
            found.append((reasoning, message.content))
    assert found, "no seed gave a reasoning of other text"
    for _, content in found:
        assert re.fullmatch("[0-9]{3}", content), content


def test_a_thinking_budget_ends_the_reasoning_then_the_constraint_holds(strict):
    """The random model never ends its reasoning by itself; with a budget of 5 tokens
    its end is forced there, and the answer after it is held to the constraint."""
    client = openai.OpenAI(base_url=f"{strict}/v1", api_key="sesame", max_retries=0)
    free = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, seed=1,
                                          temperature=1.0)  # fmt: skip
    assert free.usage.completion_tokens_details.reasoning_tokens == 24, "reasons to the end"
    for extra, answer in (({}, ".+"), ({"guided_regex": "[0-9]{3}"}, "[0-9]{3}")):
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=24, seed=1, temperature=1.0,
            extra_body={"thinking_token_budget": 5, **extra},
        )  # fmt: skip
        message = reply.choices[0].message
        assert reply.usage.completion_tokens_details.reasoning_tokens <= 6  # and </think>
        assert reasoning_of(message) and re.fullmatch(answer, message.content, re.S)


def test_messages_thinking_budget_tokens_is_the_budget(strict):
    claude = anthropic.Anthropic(base_url=strict, api_key="sesame", max_retries=0)
    message = claude.messages.create(
        model=MODEL, max_tokens=24, messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 4}, extra_body={"seed": 1},
    )  # fmt: skip
    assert [b.type for b in message.content] == ["thinking", "text"]


def test_the_prompt_fields_reach_the_template_on_every_chat_shaped_route(client, claude):
    """chat_template and add_generation_prompt, once dropped by Messages and Responses:
    each route serves the prompt chat serves for the same fields."""

    def prompt_tokens(**fields) -> tuple[int, int, int]:
        extra = {"extra_body": fields} if fields else {}
        by_chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, **extra)
        by_responses = client.responses.create(model=MODEL, input=ASK, max_output_tokens=1,
                                               **extra)  # fmt: skip
        by_messages = claude.messages.create(model=MODEL, max_tokens=1, messages=ASK, **extra)
        return (by_chat.usage.prompt_tokens, by_responses.usage.input_tokens,
                by_messages.usage.input_tokens)  # fmt: skip

    plain = prompt_tokens()
    for fields in ({"add_generation_prompt": False},
                   {"chat_template": "{{ messages[0]['content'] }}"}):  # fmt: skip
        counts = prompt_tokens(**fields)
        assert len(set(counts)) == 1 and counts != plain, (fields, counts, plain)


# -- tool calls ------------------------------------------------------------------------


def test_tool_calls_are_read_from_the_answer_after_the_reasoning(client):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=96,
        extra_body=script(f"<think>{THOUGHT}</think>{call}"),
    )  # fmt: skip
    choice = choice0 = reply.choices[0]
    assert reasoning_of(choice.message) == THOUGHT and choice0.finish_reason == "tool_calls"
    [tool_call] = choice.message.tool_calls
    assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == (
        "get_weather", {"city": "Oslo"})  # fmt: skip


def required(client, max_tokens: int, stream: bool = False, **fields):
    return client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=max_tokens,
        stream=stream, temperature=0.8, seed=3, **fields,
    )  # fmt: skip


def test_required_calls_come_whole_each_as_it_closes(client):
    """A call is given out in one delta (id, name, its whole arguments) when its
    object closes, before the output ends (tool_parsers/base.py)."""
    chunks = [c for c in required(client, 300, stream=True) if c.choices]
    whole = required(client, 300).choices[0].message.tool_calls
    assert len(whole) > 1, "seed 3 writes several calls"
    deltas = [(i, d) for i, c in enumerate(chunks) for d in c.choices[0].delta.tool_calls or ()]
    assert [d.index for _, d in deltas] == list(range(len(whole)))
    assert [(d.function.name, d.function.arguments) for _, d in deltas] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert all(d.id.startswith("call_") for _, d in deltas)
    assert deltas[0][0] < len(chunks) - 1, "the first call came before the output ended"
    assert json.loads(whole[0].function.arguments)["city"] in CITY["enum"]


def test_a_required_list_cut_by_max_tokens_keeps_its_complete_calls_and_the_cut_one_as_text(
    client,
):
    whole = required(client, 300, logprobs=True).choices[0]
    tokens = [t.token for t in whole.logprobs.content]
    text = "".join(tokens)
    last = text.rindex('{"name"')  # where the last call's object begins
    cut_at = next(i for i in range(len(tokens)) if len("".join(tokens[: i + 1])) > last + 3) + 1
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    for stream in (False, True):
        if stream:
            _, content, deltas, finish = streamed(required(client, cut_at, stream=True))
            kept = [(d.function.name, d.function.arguments) for d in deltas]
        else:
            cut = required(client, cut_at).choices[0]
            content, finish = cut.message.content, cut.finish_reason
            kept = [(c.function.name, c.function.arguments) for c in cut.message.tool_calls]
        assert finish == "length" and kept == calls[:-1], "the complete calls are calls"
        assert content == "".join(tokens[:cut_at])[last:], "the cut one is its text"


# -- the Anthropic Messages API ----------------------------------------------------------


@pytest.fixture(scope="module")
def claude(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=root(stack), api_key="none", max_retries=0, timeout=120)


def test_messages_answers_text_with_usage(claude):
    message = claude.messages.create(
        model=MODEL, max_tokens=8, system="Be brief.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8
    assert message.usage.input_tokens > 0 and message.content[0].type == "text"


def test_messages_thinking_text_and_stop_sequences(claude):
    message = claude.messages.create(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "Weather?"}],
        stop_sequences=["sunny"], extra_body=script(THINKING_OUTPUT),
    )  # fmt: skip
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == THOUGHT and message.content[1].text == "It is "
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "sunny")


def test_messages_streams_events_in_anthropics_order(claude):
    with claude.messages.stream(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "Weather?"}],
        extra_body=script(THINKING_OUTPUT),
    ) as stream:  # fmt: skip
        kinds = [e.type for e in stream if not e.type.startswith(("text", "thinking"))]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    blocks = kinds[1:-2]
    assert set(blocks) == {"content_block_start", "content_block_delta", "content_block_stop"}
    starts = [i for i, k in enumerate(blocks) if k == "content_block_start"]
    stops = [i for i, k in enumerate(blocks) if k == "content_block_stop"]
    assert len(starts) == len(stops) == 2 and starts[0] < stops[0] < starts[1] < stops[1]
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[1].text) == (THOUGHT, ANSWER)
    assert final.stop_reason == "end_turn"


def test_messages_tools_and_their_results(claude):
    tool = {"name": "get_weather", "description": "Weather now", "input_schema": WEATHER_SCHEMA}
    message = claude.messages.create(
        model=MODEL, max_tokens=100, tools=[tool], messages=[{"role": "user", "content": "Oslo?"}],
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and use.name == "get_weather"
    assert use.input["city"] in CITY["enum"]
    follow_up = claude.messages.create(
        model=MODEL, max_tokens=4, tools=[tool], extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Oslo?"},
                  {"role": "assistant", "content": [use.model_dump()]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "sunny"}]}],
    )  # fmt: skip
    assert follow_up.usage.output_tokens == 4
    with claude.messages.stream(
        model=MODEL, max_tokens=100, tools=[tool], messages=[{"role": "user", "content": "?"}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:  # fmt: skip
        deltas = [e for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    [use] = [b for b in final.content if b.type == "tool_use"]
    assert len(deltas) == 1 and use.input["city"] in CITY["enum"]  # a call comes whole
    assert final.stop_reason == "tool_use"


def test_messages_count_tokens_equals_the_prompt_it_serves(claude):
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], system="Be brief.")
    counted = claude.messages.count_tokens(**body).input_tokens
    served = claude.messages.create(**body, max_tokens=1).usage.input_tokens
    assert counted == served > 0


def test_messages_errors_come_in_anthropics_shape(claude, stack):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="nope", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    reply = httpx.post(f"{root(stack)}/v1/messages", json={"model": MODEL, "messages": ASK})
    assert reply.status_code == 400
    assert reply.json()["type"] == "error" and "max_tokens" in reply.json()["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError, match="image"):
        claude.messages.create(model=MODEL, max_tokens=4,
                               messages=[{"role": "user", "content": [image]}])  # fmt: skip


def test_messages_take_the_api_key_as_x_api_key(strict):
    good = anthropic.Anthropic(base_url=strict, api_key="sesame", max_retries=0)
    assert good.messages.create(model=MODEL, max_tokens=2, messages=ASK).usage.output_tokens
    bad = anthropic.Anthropic(base_url=strict, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=MODEL, max_tokens=2, messages=ASK)


# -- the Responses fields once dropped, routes, metrics -----------------------------------


def test_responses_honours_seed_ignore_eos_stop_and_logprobs(client):
    def create(**fields):
        return client.responses.create(model=MODEL, input="Once upon a time",
                                       max_output_tokens=12, temperature=1.0, **fields)  # fmt: skip

    seeded = [create(extra_body={"seed": 7, "ignore_eos": True}) for _ in range(2)]
    assert seeded[0].output_text == seeded[1].output_text
    assert seeded[0].usage.output_tokens == 12
    stopped = create(extra_body={"seed": 7, "ignore_eos": True,
                                 "stop": [seeded[0].output_text[2:4]]})  # fmt: skip
    assert len(stopped.output_text) < len(seeded[0].output_text)
    scored = create(top_logprobs=2, include=["message.output_text.logprobs"],
                    extra_body={"seed": 7, "ignore_eos": True})  # fmt: skip
    logprobs = scored.output[0].content[0].logprobs
    assert len(logprobs) == 12 and all(len(lp.top_logprobs) == 2 for lp in logprobs)


def test_responses_takes_outputs_as_parts_and_refuses_what_it_cannot_serve(client):
    conversation = [
        {"type": "message", "role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "sunny"}]},
    ]  # fmt: skip
    reply = client.responses.create(model=MODEL, input=conversation, max_output_tokens=2)
    assert reply.usage.output_tokens > 0
    refused = (({"include": ["reasoning.encrypted_content"]}, "include"),
               ({"truncation": "auto"}, "truncation"),
               ({"extra_body": {"conversation": "conv_1"}}, "conversation"))  # fmt: skip
    for fields, words in refused:
        with pytest.raises(openai.BadRequestError, match=words):
            client.responses.create(model=MODEL, input="x", max_output_tokens=2, **fields)
    bad = [*conversation[:2], {**conversation[2], "call_id": "c9"}]
    with pytest.raises(openai.BadRequestError, match="'c9' answers no call"):
        client.responses.create(model=MODEL, input=bad, max_output_tokens=2)


def test_unknown_routes_name_the_path_and_version_answers(stack):
    reply = httpx.post(f"{root(stack)}/v1/audio/speech", json={"input": "x"})
    assert reply.status_code == 404
    message = reply.json()["error"]["message"]
    assert "POST /v1/audio/speech" in message and "/openapi.json" in message
    assert httpx.get(f"{root(stack)}/version").json()["version"]


def test_the_routers_metrics_carry_the_engines_series(stack, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    series = scrape(int(stack.http.rsplit(":", 1)[1]))
    label = str([("engine", "0"), ("model_name", MODEL)])
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):  # fmt: skip
        assert name + label in series, name
    # What llm-d's endpoint picker reads too (docs/llm-d.md): the prefix-cache counters
    # (reported with the steps' load) and the pool's shape.
    deadline = time.monotonic() + 10
    while series.get("vllm:prefix_cache_queries_total" + label, 0) <= 0:
        assert time.monotonic() < deadline, "no prefix-cache queries reported"
        time.sleep(0.1)
        series = scrape(int(stack.http.rsplit(":", 1)[1]))
    assert 0 <= series["vllm:prefix_cache_hits_total" + label] <= series[
        "vllm:prefix_cache_queries_total" + label]  # fmt: skip
    [config] = [k for k in series if k.startswith("vllm:cache_config_info")]
    assert "'block_size'" in config and "'num_gpu_blocks'" in config and MODEL in config
