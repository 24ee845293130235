"""The OpenAI front's wider surface through the official openai SDK against a real
stack: tool calls (required and named valid against their schema, none, auto, the
history), echo and prompt logprobs against transformers (chunked prefill, after a
prefix hit), penalties against their formulas, the Responses API and its stream's
events, vLLM's tokenizer routes, usage details, and inputs that once gave a 500."""

import json
import re

import grpc
import httpx
import jsonschema
import openai
import pytest
import torch

from flagstop.executor.sampling_params import SamplingParams
from flagstop.v1 import generation_pb2
from tests.helpers.checkpoints import TOL, prompt
from tests.helpers.logits_reference import reference_greedy
from tests.helpers.metrics import scrape
from tools.stack import generate, start_stack

pytestmark = pytest.mark.processes

MODEL = "flagstop-tiny"
CITY = {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}
DAYS = {"type": "integer", "minimum": 1, "maximum": 7}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": CITY, "days": DAYS},
                  "required": ["city", "days"]}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    # A 32-token budget: the long prompts below are prefilled in chunks.
    stack = start_stack(
        model_dir, tmp_path_factory.mktemp("logs"), executor_args=["--num-blocks", "200"],
        scheduler_args=["--max-num-batched-tokens", "32"],
        router_args=["--tool-call-parser", "hermes"],
    )  # fmt: skip
    yield stack
    assert set(stack.stop().values()) == {0}
    assert "Traceback" not in (stack.log_dir / "router.log").read_text()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


def root(stack) -> str:
    return stack.base_url.removesuffix("/v1")


def valid_call(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


# -- tool calls ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_required_calls_are_valid_against_their_schema(client, seed):
    # One call: a random model's array of parallel calls need not end within max_tokens.
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
        temperature=1.0, seed=seed, parallel_tool_calls=False,
    )  # fmt: skip
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls and all(
        c.id.startswith("call_") for c in choice.message.tool_calls
    )
    for call in choice.message.tool_calls:
        valid_call(call)


def test_a_named_call_streams_arguments_that_match_its_schema(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=200, stream=True,
        temperature=0.8, seed=5,
    )  # fmt: skip
    deltas, finish = [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        deltas += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)
    assert {d.index for d in deltas} == {0} and deltas[0].id.startswith("call_")


# What a model that calls tools writes, scripted by a regex constraint: auto's hermes
# parser reads it out of the text, through the whole stack.
HERMES_TEXT = (
    'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_calls_a_model_writes(client, stream):
    regex = re.escape(HERMES_TEXT).replace("\\ ", " ")
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=200,
        stream=stream, extra_body={"guided_regex": regex},
    )  # fmt: skip
    if stream:
        content, calls, finish = "", [], None
        for chunk in reply:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            calls += delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        names = [c.function.name for c in calls if c.id]  # a call's first delta names it
        pieces = ["".join(c.function.arguments or "" for c in calls if c.index == i)
                  for i in range(len(names))]  # fmt: skip
        arguments = [json.loads(piece) for piece in pieces]
    else:
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        content = message.content
        names = [c.function.name for c in message.tool_calls]
        arguments = [valid_call(c) for c in message.tool_calls]
    assert (content, names, arguments) == ("Sure.", ["get_weather"], [{"city": "Oslo", "days": 2}])
    assert finish == "tool_calls"


def test_tool_choice_none_and_auto_answer_with_content(client):
    # ignore_eos: unseeded sampling on the random model once drew its end of turn after
    # 5 tokens (CI, seed 31393); the count asserts that nothing cut the content short.
    for choice in ("none", "auto"):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                               tool_choice=choice, max_tokens=8,
                                               extra_body={"ignore_eos": True})  # fmt: skip
        message = reply.choices[0].message
        assert message.tool_calls is None and reply.usage.completion_tokens == 8


def test_a_history_with_calls_and_their_results_is_rendered(stack, client):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4,
                                           extra_body={"ignore_eos": True})  # fmt: skip
    assert reply.usage.completion_tokens == 4
    tokens = httpx.post(f"{root(stack)}/tokenize", json={"messages": history, "tools": TOOLS})
    text = httpx.post(f"{root(stack)}/detokenize", json={"tokens": tokens.json()["tokens"]})
    rendered = text.json()["prompt"]
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}' in rendered
    )
    assert "<tool_response>sunny</tool_response>" in rendered and '"get_time"' in rendered
    assert tokens.json()["count"] == reply.usage.prompt_tokens


# -- echo, prompt logprobs, usage -------------------------------------------------------


def expected_prompt_logprobs(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logprobs = reference(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def test_echo_with_max_tokens_0_scores_the_prompt_as_transformers(client, reference):
    ids = prompt(11, 70)  # three prefill chunks of 32
    reply = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    [choice] = reply.choices
    logprobs = choice.logprobs
    assert [int(t.removeprefix("token_id:")) for t in logprobs.tokens] == ids
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    got = torch.tensor(logprobs.token_logprobs[1:])
    torch.testing.assert_close(got, expected_prompt_logprobs(reference, ids), atol=TOL, rtol=0)
    assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])
    assert reply.usage.completion_tokens == 0 and choice.finish_reason == "length"


def test_echo_leads_the_completion_with_the_prompt(client):
    reply = client.completions.create(model=MODEL, prompt="A continuous batching server",
                                      max_tokens=5, echo=True, temperature=0)  # fmt: skip
    plain = client.completions.create(model=MODEL, prompt="A continuous batching server",
                                      max_tokens=5, temperature=0)  # fmt: skip
    assert reply.choices[0].text == "A continuous batching server" + plain.choices[0].text


def test_prompt_logprobs_after_a_prefix_hit_are_recomputed(client, reference):
    ids = prompt(12, 50)
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 32  # full blocks of 16
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=2,
                                       extra_body={"prompt_logprobs": 1})  # fmt: skip
    [choice] = scored.choices
    entries = choice.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    got = torch.tensor([entries[i][str(ids[i])]["logprob"] for i in range(1, len(ids))])
    torch.testing.assert_close(got, expected_prompt_logprobs(reference, ids), atol=TOL, rtol=0)
    assert scored.usage.prompt_tokens_details.cached_tokens == 0  # it skipped the cache


def test_chat_prompt_logprobs_and_continuous_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    used = [c.usage.completion_tokens for c in chunks]
    assert used == sorted(used) and used[-1] == 6
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                           extra_body={"prompt_logprobs": 0})  # fmt: skip
    entries = reply.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == reply.usage.prompt_tokens


# -- penalties -------------------------------------------------------------------------


@pytest.mark.parametrize("fields", [
    {"frequency_penalty": 1.5},
    {"presence_penalty": 1.0, "repetition_penalty": 1.4},
    {"repetition_penalty": 0.7, "logit_bias": {"7": 4.0, "300": -100}},
])  # fmt: skip
def test_penalties_and_bias_equal_their_formulas(client, reference, fields):
    ids = prompt(13, 12)
    bias = tuple(sorted((int(k), v) for k, v in fields.get("logit_bias", {}).items()))
    params = SamplingParams(
        repetition_penalty=fields.get("repetition_penalty", 1.0),
        frequency_penalty=fields.get("frequency_penalty", 0.0),
        presence_penalty=fields.get("presence_penalty", 0.0), logit_bias=bias,
    )  # fmt: skip
    expected = reference_greedy(reference, ids, 12, params)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    body = {k: v for k, v in fields.items() if k != "repetition_penalty"}
    if "repetition_penalty" in fields:
        extra["repetition_penalty"] = fields["repetition_penalty"]
    reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                      logprobs=0, extra_body=extra, **body)  # fmt: skip
    tokens = [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]
    assert tokens == expected


def test_min_p_1_is_greedy(client):
    greedy = client.completions.create(model=MODEL, prompt="The router", max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    sampled = client.completions.create(model=MODEL, prompt="The router", max_tokens=8,
                                        temperature=1.5, seed=4,
                                        extra_body={"min_p": 1.0, "ignore_eos": True})  # fmt: skip
    assert sampled.choices[0].text == greedy.choices[0].text


# -- the Responses API -----------------------------------------------------------------

EVENTS = re.compile(
    r"response\.created response\.in_progress response\.output_item\.added "
    r"response\.content_part\.added (response\.output_text\.delta )+response\.output_text\.done "
    r"response\.content_part\.done response\.output_item\.done response\.(completed|incomplete)"
)


def test_a_responses_stream_gives_its_events_in_order(client):
    fields = dict(model=MODEL, input="Hello", instructions="Answer briefly.",
                  max_output_tokens=10, temperature=0)  # fmt: skip
    whole = client.responses.create(**fields)
    events = list(client.responses.create(**fields, stream=True))
    assert EVENTS.fullmatch(" ".join(e.type for e in events)), [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens == 10
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"


def test_responses_with_a_required_tool_and_a_json_schema(client):
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
    reply = client.responses.create(model=MODEL, input=ASK, tools=tools, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=200)  # fmt: skip
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls and reply.status == "completed"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    reply = client.responses.create(
        model=MODEL, input="Is it fine?", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "ok", "schema": schema, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(reply.output_text), schema)


def test_responses_takes_a_conversation_with_function_calls(client):
    call = {"type": "function_call", "call_id": "call_9", "name": "get_time",
            "arguments": '{"utc": true}'}  # fmt: skip
    output = {"type": "function_call_output", "call_id": "call_9", "output": "noon"}
    conversation = [*ASK, call, output]
    # Greedy: unseeded sampling on the random model once drew its end of turn after 2
    # tokens (CI); the count asserts that the whole conversation was taken and answered.
    reply = client.responses.create(model=MODEL, input=conversation, max_output_tokens=3,
                                    temperature=0)  # fmt: skip
    assert reply.usage.output_tokens == 3 and reply.status == "incomplete"
    with pytest.raises(openai.BadRequestError, match="stores no responses"):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")


# -- vLLM's extras -----------------------------------------------------------------------


def test_models_tokenize_detokenize_and_tokenizer_info(stack, client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    base = root(stack)
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": "hello world",
                                                  "return_token_strs": True}).json()  # fmt: skip
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["max_model_len"] == 2048
    text = httpx.post(f"{base}/detokenize", json={"tokens": tokens["tokens"][1:]}).json()
    assert text == {"prompt": "hello world"}
    info = httpx.get(f"{base}/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and "<tool_call>" in info["chat_template"]
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [512]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_the_render_routes_give_the_engines_token_ids(stack):
    """What llm-d's picker hashes (docs/llm-d.md): the token ids /tokenize gives."""
    base, messages = root(stack), [{"role": "user", "content": "hello"}]
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    for prompts, expected in ((["hello world", "hello world"], [tokens, tokens]),
                              ([[5, 6]], [[5, 6]])):  # fmt: skip
        rendered = httpx.post(f"{base}/v1/completions/render",
                              json={"model": MODEL, "prompt": prompts}).json()  # fmt: skip
        assert [r["token_ids"] for r in rendered] == expected
    chat = httpx.post(f"{base}/tokenize", json={"messages": messages}).json()["tokens"]
    rendered = httpx.post(
        f"{base}/v1/chat/completions/render", json={"model": MODEL, "messages": messages}
    ).json()
    assert rendered == {"model": MODEL, "token_ids": chat, "features": None}
    unknown = httpx.post(
        f"{base}/v1/chat/completions/render", json={"model": "gpt-9", "messages": messages}
    )
    assert unknown.status_code == 404


def test_a_generator_refuses_embeddings_saying_why(client):
    with pytest.raises(openai.BadRequestError, match="generates text; it makes no embeddings"):
        client.embeddings.create(model=MODEL, input="hello")


def test_the_scheduler_exports_each_series_once(stack, client):
    client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    series = scrape(stack.metrics_ports["scheduler"])
    assert not [name for name in series if "('model_name', '')" in name]
    assert any("vllm:num_requests_running" in name for name in series)


def test_a_stream_survives_clients_that_split_lines_like_splitlines(stack):
    """U+2028, U+2029 and U+0085 in the text are escaped: httpx's aiter_lines() (which
    splits at them) still reads one JSON event a line."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 30, "stream": True,
            "guided_regex": "a\u2028b\u0085c\u2029d"}  # fmt: skip
    text = ""
    with httpx.stream("POST", f"{stack.base_url}/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == "a\u2028b\u0085c\u2029d"


# -- what once answered 500 -------------------------------------------------------------

HUGE = {
    "prompt token past int32": ("/v1/completions", {"prompt": [2147483648]}, "prompt.0"),
    "max_tokens past int32": ("/v1/completions", {"max_tokens": 4294967297}, "max_tokens"),
    "seed past int64": ("/v1/completions", {"seed": 2**64}, "seed"),
    "top_k past int32": ("/v1/completions", {"top_k": 2**31}, "top_k"),
    "min_tokens past int32": ("/v1/completions", {"min_tokens": 2**40}, "min_tokens"),
    "priority past int32": ("/v1/completions", {"priority": -(2**40)}, "priority"),
    "logprobs 1e20": ("/v1/completions", {"logprobs": 10**20}, "logprobs"),
    "top_logprobs 1e20": ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 10**20},
                          "top_logprobs"),
    "stop token past int32": ("/v1/completions", {"stop_token_ids": [2**33]}, "stop_token_ids.0"),
    "a schema's integer past 64 bits": ("/v1/completions", {"guided_json": {
        "type": "integer", "maximum": 301080516666493503537152}}, "structured_outputs"),
    "a logit_bias key that is no token": ("/v1/completions", {"logit_bias": {"x": 1}}, None),
    "a logit_bias token outside the vocabulary": ("/v1/completions", {"logit_bias": {"9999": 1}},
                                                  "logit_bias"),
    "legacy functions": ("/v1/chat/completions", {"functions": [{"name": "f"}]}, None),
    "beam search (vLLM's)": ("/v1/completions", {"use_beam_search": True}, None),
    "chat echo (vLLM's)": ("/v1/chat/completions", {"echo": True}, None),
}  # fmt: skip
SURROGATES = {
    "prompt": ("/v1/completions", '{"model": "flagstop-tiny", "prompt": "a\\ud800b"}'),
    "stop": ("/v1/completions", '{"model": "flagstop-tiny", "prompt": "a", "stop": ["\\udc00"]}'),
    "chat content": ("/v1/chat/completions",
                     '{"model": "flagstop-tiny", "messages": [{"role": "user", '
                     '"content": "a\\ud800"}]}'),
    "responses input": ("/v1/responses", '{"model": "flagstop-tiny", "input": "\\udfff"}'),
    "a key": ("/v1/completions",
              '{"model": "flagstop-tiny", "prompt": "a", "guided_json": {"\\ud800": 1}}'),
}  # fmt: skip


@pytest.mark.parametrize("case", HUGE)
def test_numbers_past_what_the_wire_takes_are_400_naming_the_field(stack, case):
    path, fields, param = HUGE[case]
    body = {"model": MODEL, "max_tokens": 2, **fields}
    if "chat" in path:
        body["messages"] = ASK
    else:
        body.setdefault("prompt", "x")
    reply = httpx.post(f"{root(stack)}{path}", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("case", SURROGATES)
def test_text_that_is_not_unicode_is_400(stack, case):
    path, raw = SURROGATES[case]
    reply = httpx.post(f"{root(stack)}{path}", content=raw,
                       headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
    assert reply.status_code == 400, reply.text
    assert "not valid Unicode" in reply.json()["error"]["message"]


def test_the_grpc_front_refuses_the_same_with_invalid_argument(stack, reference):
    raw = stack.channel(stack.router).unary_stream(
        "/flagstop.v1.Generation/Generate", request_serializer=lambda b: b,
        response_deserializer=generation_pb2.GenerateResponse.FromString,
    )  # fmt: skip
    with pytest.raises(grpc.RpcError) as bad_utf8:
        list(raw(b"\x0a\x04a\xed\xa0\x80\x38\x02", timeout=30))  # prompt "a\xed\xa0\x80"
    schema = generation_pb2.StructuredOutputs(
        json_schema='{"type":"integer","maximum":301080516666493503537152}'
    )
    for fields in ({"structured_outputs": schema}, {"frequency_penalty": 9.0},
                   {"min_p": float("nan")}, {"logit_bias": {600: 1.0}}):  # fmt: skip
        with pytest.raises(grpc.RpcError) as refused:
            generate(stack, prompt="x", max_tokens=2, **fields)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
    assert bad_utf8.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ids = prompt(14, 40)
    _, _, first_and_last = generate(stack, prompt_token_ids=ids, max_tokens=1, prompt_logprobs=0)
    got = torch.tensor([lp.logprob for lp in first_and_last.prompt_logprobs])
    torch.testing.assert_close(got, expected_prompt_logprobs(reference, ids), atol=TOL, rtol=0)
