"""gpt-oss' harmony format end to end on a gpt-oss-shaped checkpoint with gpt-oss' own
tokenizer (make model ARCH=gpt_oss HARMONY=1): the tokenizer equal to harmony's
encoding; conversations rendered by openai-harmony and parsed back by its own parser;
outputs read by channel the same whether they arrive whole, split anywhere or token
by token, and as harmony's own parser reads them; through the stack (scripted by
output constraints naming harmony's special tokens), reasoning, content and tool
calls in chat, streamed and whole, and in the Responses API; an output constraint
that waits for the final channel."""

import json
import random

import openai
import pytest
from openai_harmony import Role
from transformers import AutoTokenizer

from flagstop.router.chat import ChatTemplate
from flagstop.router.openai.chat_request import ChatCompletionRequest
from flagstop.router.openai.harmony import HarmonyOutput, HarmonyPath
from flagstop.router.settings import RouterSettings
from tools.make_model import write_model
from tools.stack import start_stack

MODEL = "gpt-oss-harmony"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}}]  # fmt: skip
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]  # fmt: skip
ANALYSIS, FINAL, ARGUMENTS = "Let me think.", "It is sunny.", '{"city": "Oslo"}'
ANSWER = (f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>"
          f"<|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>")  # fmt: skip
CALL = (
    f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant<|channel|>"
    f"commentary to=functions.get_weather <|constrain|>json<|message|>{ARGUMENTS}<|call|>"
)


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model") / MODEL, "nano", arch="gpt_oss",
                       harmony=True)  # fmt: skip


@pytest.fixture(scope="module")
def path(harmony_model) -> HarmonyPath:
    tokenizer = AutoTokenizer.from_pretrained(harmony_model)
    settings = RouterSettings(reasoning_parser="openai_gptoss", tool_call_parser="openai")
    return HarmonyPath(ChatTemplate(tokenizer), settings, tokenizer)


def test_the_checkpoints_tokenizer_is_harmonys_encoding(path, harmony_model):
    tokenizer = AutoTokenizer.from_pretrained(harmony_model)
    rng = random.Random(0)
    words = ["Hello", " world", "!", " 12345", "\n\n", "  ", "日本語", "🎉", "it's", "<|end|>",
             " CamelCase", "\t", "données", "'ll", "x" * 40]  # fmt: skip
    for _ in range(200):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert ids == path.encoding.encode(text, allowed_special="all"), text
        assert tokenizer.decode(ids) == text


def test_a_conversation_round_trips_through_harmonys_parser(path):
    body = ChatCompletionRequest(model=MODEL, messages=HISTORY, tools=TOOLS,
                                 reasoning_effort="low")  # fmt: skip
    ids = path.render(body).token_ids
    text = path.encoding.decode(ids)
    assert "Reasoning: low" in text and "# Instructions\n\nBe brief." in text
    assert "type get_weather = (_: {" in text and text.endswith("<|start|>assistant")
    parsed = path.encoding.parse_messages_from_completion_tokens(ids[:-2], None)
    mine = path.messages(body)
    assert [m.author.role for m in parsed] == [m.author.role for m in mine]
    # The system and developer messages come back as their rendered text.
    assert [m.to_dict() for m in parsed[2:]] == [m.to_dict() for m in mine[2:]]
    call, result = parsed[-2], parsed[-1]
    assert (call.recipient, call.channel, call.content[0].text) == (
        "functions.get_weather", "commentary", '{"city": "Oslo"}')  # fmt: skip
    assert (result.author.name, result.content[0].text) == ("functions.get_weather", "sunny")


def read(path: HarmonyPath, pieces: list[list[int]], finish: str = "stop"
         ) -> tuple[str, str, list, list]:  # fmt: skip
    output = HarmonyOutput(path.encoding, show_reasoning=True)
    reasoning = content = ""
    deltas = []
    for i, piece in enumerate(pieces):
        parsed = output.feed(piece, "", finish if i == len(pieces) - 1 else None)
        reasoning, content, deltas = reasoning + parsed.reasoning, content + parsed.content, [
            *deltas, *parsed.calls]  # fmt: skip
    return reasoning, content, deltas, output.calls


@pytest.mark.parametrize("script", ["answer", "call"])
def test_an_output_reads_the_same_however_it_arrives_and_as_harmony_reads_it(path, script):
    ids = path.encoding.encode(ANSWER if script == "answer" else CALL, allowed_special="all")
    by_harmony = path.encoding.parse_messages_from_completion_tokens(ids, Role.ASSISTANT)
    expected_reasoning = by_harmony[0].content[0].text
    whole = read(path, [ids])

    def functions(calls: list) -> list:  # the calls without their ids (new each read)
        return [c["function"] for c in calls]

    for pieces in ([[t] for t in ids], *([ids[:cut], ids[cut:]] for cut in range(1, len(ids)))):
        reasoning, content, _, calls = read(path, pieces)
        assert (reasoning, content, functions(calls)) == (*whole[:2], functions(whole[3]))
    reasoning, content, deltas, calls = whole
    assert reasoning == expected_reasoning == ANALYSIS
    if script == "answer":
        assert (content, calls) == (by_harmony[1].content[0].text, []) == (FINAL, [])
    else:
        assert content == "" and [c["function"] for c in calls] == [
            {"name": "get_weather", "arguments": by_harmony[1].content[0].text}]  # fmt: skip
        assert [{k: v for k, v in d.items() if k != "index"} for d in deltas] == calls, \
            "a call is given out whole when its message ends"  # fmt: skip


def test_a_call_cut_or_not_json_is_content(path):
    """The one rule of the text parsers (router/openai/tool_parsers/base.py): a call
    max_tokens cut, or whose arguments are not a JSON object, is content as written."""
    cut = path.encoding.encode(CALL, allowed_special="all")
    cut = cut[: cut.index(path.encoding.encode("<|call|>", allowed_special="all")[0]) - 1]
    reasoning, content, deltas, calls = read(path, [cut], finish="length")
    assert (reasoning, calls, deltas) == (ANALYSIS, [], []) and content.startswith('{"city"')
    not_json = CALL.replace('{"city": "Oslo"}', "city=Oslo")
    ids = path.encoding.encode(not_json, allowed_special="all")
    assert read(path, [[t] for t in ids])[1:] == ("city=Oslo", [], [])


def test_output_that_is_not_harmony_is_content(path):
    ids = path.encoding.encode("Plain words, no channels.")
    assert read(path, [ids])[:2] == ("", "Plain words, no channels.")
    broken = path.encoding.encode("<|channel|>analysis<|message|>Hm<|end|> and then text",
                                  allowed_special="all")  # fmt: skip
    assert read(path, [[t] for t in broken])[:2] == ("Hm", " and then text")


# -- through the stack ---------------------------------------------------------------------


def grammar(path: HarmonyPath, text: str) -> dict:
    """The constraint that makes the model write text, harmony's tokens by their ids."""
    items = []
    for token in path.encoding.encode(text, allowed_special="all"):
        if path.encoding.is_special_token(token):
            items.append(f"<[{token}]>")
        else:
            items.append(json.dumps(path.encoding.decode([token])))
    return {"structured_outputs": {"grammar": "start: " + " ".join(items)}}


@pytest.fixture(scope="module")
def stack(harmony_model, tmp_path_factory):
    stack = start_stack(
        harmony_model, tmp_path_factory.mktemp("logs"), executor_args=["--num-blocks", "200"],
        router_args=["--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai",
                     "--structured-outputs-in-reasoning"],
    )  # fmt: skip
    yield stack
    assert set(stack.stop().values()) == {0}
    assert "Traceback" not in (stack.log_dir / "router.log").read_text()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


@pytest.mark.processes
@pytest.mark.parametrize("stream", [False, True])
def test_chat_reads_harmony_channels(client, path, stream):
    reply = client.chat.completions.create(model=MODEL, messages=HISTORY[:2], max_tokens=64,
                                           stream=stream,
                                           extra_body=grammar(path, ANSWER))  # fmt: skip
    if stream:
        chunks = [c for c in reply if c.choices]
        reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning") or ""
                            for c in chunks)  # fmt: skip
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        reasoning, content = message.model_extra["reasoning"], message.content
    assert (reasoning, content, finish) == (ANALYSIS, FINAL, "stop")


@pytest.mark.processes
def test_chat_and_responses_read_a_harmony_call(client, path):
    reply = client.chat.completions.create(model=MODEL, messages=HISTORY[:2], tools=TOOLS,
                                           max_tokens=64,
                                           extra_body=grammar(path, CALL))  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Oslo"},
    )
    follow_up = client.chat.completions.create(
        model=MODEL, messages=[*HISTORY[:2], choice.message.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}],
        tools=TOOLS, max_tokens=64, extra_body=grammar(path, ANSWER),
    )  # fmt: skip
    assert follow_up.choices[0].message.content == FINAL
    response = client.responses.create(
        model=MODEL, input="Weather in Oslo?", instructions="Be brief.", max_output_tokens=64,
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        extra_body=grammar(path, CALL),
    )  # fmt: skip
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.output[1].name == "get_weather"
    assert json.loads(response.output[1].arguments) == {"city": "Oslo"}


def test_an_output_constraint_waits_for_the_final_channel_and_stops_are_harmonys(path):
    """The constraint covers the answer on the final channel, not the analysis before
    it (the executor's grammar rows start it there: tests/test_structured.py)."""
    body = ChatCompletionRequest(model=MODEL, messages=HISTORY[:2], n=2,
                                 response_format={"type": "json_object"})  # fmt: skip
    requests = path.requests(body, path.render(body))
    final = path.encoding.encode("<|channel|>final<|message|>", allowed_special="all")
    for request in requests:
        assert list(request.structured_outputs.after_token_ids) == final
        assert set(request.stop_token_ids) == set(
            path.encoding.stop_tokens_for_assistant_actions())  # fmt: skip


@pytest.mark.processes
def test_required_and_named_tool_choices_are_refused_with_why(client):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError, match="gpt-oss writes its calls itself"):
            client.chat.completions.create(model=MODEL, messages=HISTORY[:2], tools=TOOLS,
                                           tool_choice=choice, max_tokens=4)  # fmt: skip
