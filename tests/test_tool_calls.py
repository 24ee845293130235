"""Tool calls read out of scripted model outputs (the hermes parser, whole and split at
every point a stream could split it), the constraints of required and named calls,
and the chat requests that carry tools."""

import json

import jsonschema
import pytest

from flagstop.router.openai.chat_request import ChatCompletionRequest, ToolSpec
from flagstop.router.openai.tools import HermesParser, NamedCall, RequiredCalls, required_schema

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time"}}

SCRIPTS = {
    "plain text": ("The weather is fine.", "The weather is fine.", []),
    "one call": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "", [("get_weather", {"city": "Oslo"})],
    ),
    "text, then two calls": (
        'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    "arguments as a JSON string": (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
        "", [("get_weather", {"city": "Rome"})],
    ),
    "a broken call stays text": (
        "<tool_call>{not json}</tool_call> sorry",
        "<tool_call>{not json}</tool_call> sorry", [],
    ),
    "a call cut short": (
        '<tool_call>{"name": "get_weather", "argu', '<tool_call>{"name": "get_weather", "argu', [],
    ),
    "a tag-like text that is not one": ("a <tool_ca b", "a <tool_ca b", []),
}  # fmt: skip


def parse(pieces: list[str]) -> tuple[str, list, list]:
    parser, content, deltas = HermesParser(), "", []
    for i, piece in enumerate(pieces):
        text, calls = parser.feed(piece, final=i == len(pieces) - 1)
        content += text
        deltas += calls
    return content, deltas, parser.calls


def as_pairs(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name", SCRIPTS)
def test_hermes_whole_and_streamed_at_every_split(name):
    output, content, calls = SCRIPTS[name]
    whole_content, deltas, whole_calls = parse([output])
    assert (whole_content, as_pairs(whole_calls)) == (content, calls)
    assert [d["index"] for d in deltas] == list(range(len(calls)))
    for cut in range(1, len(output)):
        got_content, got_deltas, got_calls = parse([output[:cut], output[cut:], ""])
        assert got_content == content, cut
        assert as_pairs(got_calls) == calls, cut
        assert as_pairs(got_deltas) == calls  # each call whole in one delta
    one_by_one = parse([*output, ""])
    assert one_by_one[0] == content and as_pairs(one_by_one[2]) == calls


def test_a_named_call_streams_its_arguments():
    parser = NamedCall("get_weather")
    deltas = [d for piece in ['{"ci', 'ty": "Oslo"', "}"] for d in parser.feed(piece, False)[1]]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Oslo"}'
    assert json.loads(parser.calls[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_required_calls_are_read_at_the_end_and_a_cut_array_stays_text():
    parser = RequiredCalls()
    assert parser.feed('[{"name": "get_time", "arguments": {}}', False) == ("", [])
    content, deltas = parser.feed("]", True)
    assert content == "" and as_pairs(deltas) == [("get_time", {})]
    cut = RequiredCalls()
    assert cut.feed('[{"name": "get_ti', True) == ('[{"name": "get_ti', [])
    assert cut.calls == []


def test_the_required_schema_takes_exactly_the_tools_calls():
    tools = [ToolSpec(**WEATHER), ToolSpec(**TIME)]
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
