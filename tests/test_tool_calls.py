"""The constraints of required and named tool calls, and the chat requests that
carry tools and their history (each family's parser: tests/test_tool_parsers.py)."""

import json

import jsonschema
import pytest

from flagstop.router.openai.chat_request import (
    ChatCompletionRequest,
    ToolDefinition,
    required_schema,
)
from flagstop.router.openai.tool_parsers import NamedCall, RequiredCalls

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def feed(parser, pieces: list[str], finish: str) -> tuple[str, list[dict]]:
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        text, calls = parser.feed(piece, finish if i == len(pieces) - 1 else None)
        content, deltas = content + text, deltas + calls
    return content, deltas


def test_a_named_call_is_given_out_whole_and_a_cut_one_is_content():
    parser = NamedCall("get_weather")
    content, [delta] = feed(parser, ['{"ci', 'ty": "Oslo"', "}"], "stop")
    assert content == "" and delta["id"].startswith("call_")
    assert delta["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert parser.calls == [{k: v for k, v in delta.items() if k != "index"}]
    cut = NamedCall("get_weather")
    assert feed(cut, ['{"ci', 'ty": "Os'], "length") == ('{"city": "Os', []) and not cut.calls


REQUIRED = ('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "get_time", "arguments": {}}]')  # fmt: skip


def test_required_calls_come_as_each_closes_and_a_cut_list_keeps_its_complete_ones():
    parser = RequiredCalls()
    first = REQUIRED.index("}}") + 2
    assert [d["function"]["name"] for d in parser.feed(REQUIRED[:first], None)[1]] == [
        "get_weather"]  # fmt: skip
    assert parser.feed(REQUIRED[first:], "stop") == ("", [{"index": 1, **parser.calls[1]}])
    cut = REQUIRED[: REQUIRED.index("{}") + 1]  # inside get_time's arguments
    content, deltas = feed(RequiredCalls(), [cut], "length")
    assert [d["function"]["name"] for d in deltas] == ["get_weather"]
    assert content == '{"name": "get_time", "arguments": {'
    assert json.loads(deltas[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_the_required_schema_takes_exactly_the_tools_calls():
    tools = [ToolDefinition(**WEATHER), ToolDefinition(**TIME)]
    schema = required_schema(tools, parallel=False)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "x"}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}],
                [{"name": "nope", "arguments": {}}],
                [{"name": "get_time", "arguments": {}}] * 2):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, required_schema(tools, True))


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_tool_choice_modes_and_their_constraints():
    assert chat().tool_mode == "none" and chat(tools=[WEATHER]).tool_mode == "auto"
    assert chat(tools=[WEATHER], tool_choice="none").template_tools() is None
    named = chat(tools=[WEATHER], tool_choice={"type": "function",
                                                "function": {"name": "get_weather"}})  # fmt: skip
    assert named.tool_mode == "named"
    assert json.loads(named._constraint.json_schema) == WEATHER["function"]["parameters"]
    required = chat(tools=[WEATHER, TIME], tool_choice="required")
    assert json.loads(required._constraint.json_schema)["minItems"] == 1
    assert chat(tools=[WEATHER], tool_choice="auto")._constraint is None


@pytest.mark.parametrize(("fields", "words"), [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "not in tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "at most one output constraint"),
    ({"functions": [{"name": "f"}]}, "send tools and tool_choice"),
])  # fmt: skip
def test_tool_requests_that_cannot_be_served_say_why(fields, words):
    with pytest.raises(ValueError, match=words):
        chat(**fields)


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip


@pytest.mark.parametrize(("history", "words"), [
    ([{"role": "tool", "content": "sunny"}], "messages.1: a tool message needs tool_call_id"),
    ([{"role": "tool", "tool_call_id": "call_9", "content": "sunny"}],
     "messages.1.tool_call_id: 'call_9' answers no call"),
    ([{"role": "assistant", "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}], "'call_2' answers no call"),
    ([{"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": "{city: Oslo"}}]}],
     "messages.1.tool_calls: the arguments of call 'call_1' are not JSON"),
])  # fmt: skip
def test_a_tool_history_is_checked_as_openai_checks_it(history, words):
    with pytest.raises(ValueError, match=words):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}, *history])
    ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])  # fmt: skip


def test_history_with_calls_renders_as_templates_read_it():
    message = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]).messages  # fmt: skip
    assistant, tool = message[1].as_template_input(), message[2].as_template_input()
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
