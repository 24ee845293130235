"""Reasoning split off a thinking model's output by each --reasoning-parser: the
fixtures in tests/data/reasoning/ (a file per family: its templates' and models' ways,
calls after the reasoning or ending it), each fed whole, one character at a time and
split at random places (Hypothesis), the same reasoning, content and calls every way;
where the prompt leaves the reasoning open or closed; the chat fields that shape the
prompt; and a thinking budget's tokens."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flagstop.router.openai.chat_request import ChatCompletionRequest
from flagstop.router.openai.outputs import PlainContent, TextOutput
from flagstop.router.openai.reasoning import FORMATS, ThinkParser
from flagstop.router.openai.tool_parsers import PARSERS
from tests.helpers.parser_fixtures import (
    case_id,
    cases,
    comparable,
    expected_calls,
    pieces_at,
    tool_definitions,
)

CASES = cases("reasoning")
IDS = [case_id(*c) for c in CASES]


def read(family: str, case: dict, pieces: list[str]) -> tuple[str, str, list[tuple]]:
    """(reasoning, content, calls) of the case's output fed in pieces."""
    tools = PARSERS[case["tool_call_parser"]](tool_definitions(case["tools"])) \
        if "tool_call_parser" in case else PlainContent()  # fmt: skip
    fmt = FORMATS[family]
    opened = case["prompt_opened"] or fmt.always_opened  # as ReasoningSetup.parser has it
    output = TextOutput(ThinkParser(fmt, opened), tools, True)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        parsed = output.feed([], piece, "stop" if i == len(pieces) - 1 else None)
        reasoning, content = reasoning + parsed.reasoning, content + parsed.content
    return reasoning, content, comparable(output.calls, with_ids=False)


@pytest.mark.parametrize(("family", "case"), CASES, ids=IDS)
def test_each_fixture_splits_as_its_family_writes_it(family, case):
    want = (case["reasoning"], case["content"], expected_calls(case))
    assert read(family, case, [case["output"]]) == want
    assert read(family, case, [*case["output"]]) == want


@pytest.mark.parametrize(("family", "case"), CASES, ids=IDS)
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=12))
def test_each_fixture_streamed_in_any_split_reads_as_it_does_whole(family, case, cuts):
    output = case["output"]
    pieces = pieces_at(output, [cut % (len(output) + 1) for cut in cuts])
    assert read(family, case, pieces) == (case["reasoning"], case["content"],
                                          expected_calls(case))  # fmt: skip


def test_every_tag_family_has_its_fixtures():
    assert {family for family, _ in CASES} == set(FORMATS)


def test_the_prompt_says_whether_the_reasoning_is_open():
    qwen3 = FORMATS["qwen3"]
    assert qwen3.opened_by("<|im_start|>assistant\n<think>\n")
    assert not qwen3.opened_by("<|im_start|>assistant\n")
    assert qwen3.closed_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert FORMATS["deepseek_r1"].opened_by("<|Assistant|>")


def test_the_reasoning_can_be_left_out_of_the_reply():
    hidden = TextOutput(ThinkParser(FORMATS["qwen3"], False), PARSERS["hermes"](), False)
    assert hidden.feed([], "<think>a</think>b", "stop") == ("", "b", [])


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_the_chat_fields_that_shape_the_prompt():
    options = chat(chat_template_kwargs={"enable_thinking": False}, reasoning_effort="low")
    assert options.template_options({"enable_thinking": True, "x": 1}) == {
        "add_generation_prompt": True, "continue_final_message": False, "template": None,
        "variables": {"enable_thinking": False, "x": 1, "reasoning_effort": "low"},
    }  # fmt: skip
    inside = chat(chat_template_kwargs={"add_generation_prompt": False}).template_options(None)
    assert inside["add_generation_prompt"] is False
    going_on = chat(continue_final_message=True).template_options(None)
    assert going_on["add_generation_prompt"] is False
    for bad in (dict(continue_final_message=True, add_generation_prompt=True),
                dict(chat_template_kwargs={"tools": []})):  # fmt: skip
        with pytest.raises(ValueError):
            chat(**bad).template_options(None)


def test_a_thinking_budget_counts_from_the_models_own_think(tmp_path):
    from transformers import AutoTokenizer

    from flagstop.router.chat import ChatTemplate
    from flagstop.router.openai.chat_path import ChatPath
    from flagstop.router.settings import RouterSettings
    from tools.make_model import VOCAB_SIZE, write_model

    tokenizer = AutoTokenizer.from_pretrained(write_model(tmp_path / "m", thinking=True))
    path = ChatPath(ChatTemplate(tokenizer), RouterSettings(reasoning_parser="qwen3"), tokenizer)
    body = chat(thinking_token_budget=8)
    [request] = path.requests(body, path.render(body))
    budget = request.structured_outputs
    assert (budget.force_after_within, list(budget.open_token_ids),
            list(budget.after_token_ids)) == (8, [VOCAB_SIZE], [VOCAB_SIZE + 1])  # fmt: skip
    off = chat(thinking_token_budget=8, chat_template_kwargs={"enable_thinking": False})
    [request] = path.requests(off, path.render(off))
    assert not request.HasField("structured_outputs"), "the template closed it: no budget"
