"""Every tool-call parser fed its family's output whole, split at every character and
one character at a time: the same content and the same calls each way, the calls'
deltas adding up to them (a first delta naming each call, its arguments after)."""

import json

import pytest

from flagstop.router.openai.chat_request import ToolSpec
from flagstop.router.openai.tool_parsers import PARSERS, RequiredCalls

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
TOOLS = [ToolSpec(type="function", function={"name": "get_weather", "parameters": CITY}),
         ToolSpec(type="function", function={"name": "get_time"})]  # fmt: skip
OSLO, PARIS = ("get_weather", {"city": "Oslo", "days": 2}), ("get_weather", {"city": "Paris"})
NOW = ("get_time", {})
DS = {k: f"<｜{k}｜>" for k in ("tool▁calls▁begin", "tool▁calls▁end", "tool▁call▁begin",
                                "tool▁call▁end", "tool▁sep")}  # fmt: skip
KIMI = {
    k: f"<|{k}|>"
    for k in (
        "tool_calls_section_begin",
        "tool_calls_section_end",
        "tool_call_begin",
        "tool_call_argument_begin",
        "tool_call_end",
    )
}


def ds(name: str, args: str, v31: bool = False) -> str:
    if v31:
        return f"{DS['tool▁call▁begin']}{name}{DS['tool▁sep']}{args}{DS['tool▁call▁end']}"
    return (f"{DS['tool▁call▁begin']}function{DS['tool▁sep']}{name}\n```json\n{args}\n```"
            f"{DS['tool▁call▁end']}")  # fmt: skip


def kimi(name: str, index: int, args: str) -> str:
    return (f"{KIMI['tool_call_begin']}functions.{name}:{index}"
            f"{KIMI['tool_call_argument_begin']}{args}{KIMI['tool_call_end']}")  # fmt: skip


# (parser, output, content, calls)
SCRIPTS = {
    "hermes plain text": ("hermes", "The weather is fine. ", "The weather is fine. ", []),
    "hermes one call": (
        "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
        "\n</tool_call>", "", [OSLO]),
    "hermes text, then two calls": (
        "hermes", 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        "Let me check.", [PARIS, NOW]),
    "hermes arguments as a JSON string": (
        "hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", '
        '\\"days\\": 2}"}</tool_call>', "", [OSLO]),
    "hermes keys in another order": (
        "hermes", '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>',
        "", [PARIS]),
    "hermes a broken call stays text": (
        "hermes", "<tool_call>{not json}</tool_call> sorry",
        "<tool_call>{not json}</tool_call> sorry", []),
    "hermes a tag-like text that is not one": ("hermes", "a <tool_ca b", "a <tool_ca b", []),
    "qwen3_coder two calls": (
        "qwen3_coder", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
        "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "Checking.", [OSLO, NOW]),
    "qwen3_coder a string parameter that looks like a number": (
        "qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n2\n</parameter>\n"
        "</function>\n</tool_call>", "", [("get_weather", {"city": "2"})]),
    "llama3_json one call": (
        "llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}', "",
        [OSLO]),
    "llama3_json python tag and two calls": (
        "llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}', "", [PARIS, NOW]),
    "llama3_json text is content": ("llama3_json", "It is {sunny} there.",
                                    "It is {sunny} there.", []),
    "mistral array": (
        "mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"days": 2}}, {"name": "get_time", "arguments": {}}]', "Sure.", [OSLO, NOW]),
    "mistral v11": (
        "mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "", [PARIS, NOW]),
    "deepseek_v3": (
        "deepseek_v3", "Let me look." + DS["tool▁calls▁begin"]
        + ds("get_weather", '{"city": "Oslo", "days": 2}') + ds("get_time", "{}")
        + DS["tool▁calls▁end"], "Let me look.", [OSLO, NOW]),
    "deepseek_v31": (
        "deepseek_v3", DS["tool▁calls▁begin"] + ds("get_weather", '{"city": "Paris"}', v31=True)
        + DS["tool▁calls▁end"], "", [PARIS]),
    "kimi_k2": (
        "kimi_k2", "On it." + KIMI["tool_calls_section_begin"]
        + kimi("get_weather", 0, '{"city": "Oslo", "days": 2}') + kimi("get_time", 1, "{}")
        + KIMI["tool_calls_section_end"], "On it.", [OSLO, NOW]),
    "glm45": (
        "glm45", "Looking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo"
        "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
        "<tool_call>get_time\n</tool_call>", "Looking.", [OSLO, NOW]),
}  # fmt: skip


def parse(parser, pieces: list[str]) -> tuple[str, list[dict], list[dict]]:
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        text, calls = parser.feed(piece, final=i == len(pieces) - 1)
        content += text
        deltas += calls
    return content, deltas, parser.calls


def as_pairs(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def merged(deltas: list[dict]) -> list[dict]:
    """The calls the stream's deltas add up to: the first delta of each names it."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        if "id" in delta:
            assert delta["index"] == len(calls) and delta["function"]["name"]
            calls[delta["index"]] = {"function": dict(delta["function"])}
        else:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    return list(calls.values())


def check(make, output: str, content: str, calls: list) -> None:
    splits = [[output, ""], [*output, ""]]
    splits += [[output[:cut], output[cut:], ""] for cut in range(1, len(output))]
    for pieces in splits:
        got_content, deltas, got_calls = parse(make(), pieces)
        assert (got_content, as_pairs(got_calls)) == (content, calls), pieces
        assert as_pairs(merged(deltas)) == calls, pieces


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_family_whole_split_anywhere_and_char_by_char(name):
    family, output, content, calls = SCRIPTS[name]
    check(lambda: PARSERS[family](TOOLS), output, content, calls)


def test_every_family_has_a_script():
    assert {s[0] for s in SCRIPTS.values()} == set(PARSERS)


def test_arguments_stream_as_they_are_written():
    parser = PARSERS["hermes"](TOOLS)
    _, deltas = parser.feed('<tool_call>{"name": "get_weather", "arguments": {"ci', False)
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[1]["function"]["arguments"] == '{"ci'
    _, deltas = parser.feed('ty": "Oslo"}}</tool_call>', True)
    assert "".join(d["function"]["arguments"] for d in deltas) == 'ty": "Oslo"}'


def test_required_calls_stream_and_a_cut_array_keeps_its_complete_calls():
    array = (
        '[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
        '{"name": "get_time", "arguments": {}}]'
    )
    check(RequiredCalls, array, "", [OSLO, NOW])
    cut = array[: array.index("{}") + 1]  # inside get_time's arguments
    content, deltas, calls = parse(RequiredCalls(), [cut, ""])
    assert (content, as_pairs(calls)) == ("", [OSLO])
    assert [d["function"]["name"] for d in deltas if "id" in d] == ["get_weather", "get_time"]
