"""Reasoning split off a thinking model's output by each --reasoning-parser, whole,
split at every character and one character at a time; where the prompt leaves the
reasoning open or closed; the chat fields that shape the prompt; and an output
constraint that waits for the reasoning's end in the executor's grammar rows."""

import pytest

from flagstop.router.openai.chat_request import ChatCompletionRequest
from flagstop.router.openai.outputs import TextOutput
from flagstop.router.openai.reasoning import FORMATS, ThinkParser
from flagstop.router.openai.tool_parsers import PARSERS

OPEN, CLOSED, NONE = "<|assistant|>\n<think>\n", "<think>\n\n</think>\n\n", "<|assistant|>\n"

# (parser, prompt's end, output, reasoning, content)
SCRIPTS = {
    "qwen3 thinks in its output": ("qwen3", NONE, "<think>\nHmm, Oslo.\n</think>\n\nIt is sunny.",
                                   "\nHmm, Oslo.\n", "It is sunny."),
    "qwen3 with the template's open think": ("qwen3", OPEN, "Hmm.</think>Sunny.", "Hmm.",
                                             "Sunny."),
    "qwen3 thinking turned off": ("qwen3", CLOSED, "Sunny. <think> is a tag.", "",
                                  "Sunny. <think> is a tag."),
    "qwen3 no reasoning at all": ("qwen3", NONE, "  Sunny.", "", "  Sunny."),
    "deepseek_r1 reasons first, tag or not": ("deepseek_r1", NONE, "Hmm.</think>Sunny.", "Hmm.",
                                              "Sunny."),
    "deepseek_r1 never ends its reasoning": ("deepseek_r1", NONE, "Hmm, <thi", "Hmm, <thi", ""),
    "glm45": ("glm45", OPEN, "Let me see.</think>\nSunny.", "Let me see.", "Sunny."),
    "kimi_k2": ("kimi_k2", NONE, "<think>a</think>b", "a", "b"),
    "deepseek_v3": ("deepseek_v3", NONE, "<think>a < b</think>b", "a < b", "b"),
}  # fmt: skip


def split(parser, pieces: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = parser.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_parser_splits_the_same_however_the_text_arrives(name):
    family, prompt, output, reasoning, content = SCRIPTS[name]
    fmt = FORMATS[family]
    opened = fmt.opened_by(prompt) and not fmt.closed_by(prompt)
    splits = [[output, ""], [*output, ""]]
    splits += [[output[:cut], output[cut:], ""] for cut in range(1, len(output))]
    for pieces in splits:
        assert split(ThinkParser(fmt, opened), pieces) == (reasoning, content), pieces


def test_tool_calls_are_read_from_the_answer_only():
    output = TextOutput(ThinkParser(FORMATS["qwen3"], False), PARSERS["hermes"](), True)
    text = ('<think>I could write <tool_call>{"name": "x", "arguments": {}}</tool_call></think>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')  # fmt: skip
    parsed = output.feed([], text, True)
    assert parsed.reasoning.startswith("I could write <tool_call>")
    assert [c["function"]["name"] for c in output.calls] == ["get_time"]
    hidden = TextOutput(ThinkParser(FORMATS["qwen3"], False), PARSERS["hermes"](), False)
    assert hidden.feed([], "<think>a</think>b", True).reasoning == ""


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
