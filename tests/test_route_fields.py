"""Every field of the three chat-shaped routes honoured or refused, never dropped: the
table of docs/openai.md ("Fields by route") walked row by row on every route (a
Responses or Messages request becomes the chat request the engine gets: `yes` is the
field's effect found on it, `400` a refusal naming the field), and every field the
openai and anthropic SDKs send for Responses and Messages a field of the route's own,
honoured or refused by name. (Through a stack, the prompt fields Messages and
Responses once dropped: tests/test_agents.py.)"""

import re
import typing
from pathlib import Path

import pytest
from anthropic.types import message_create_params
from openai.types.responses import response_create_params
from pydantic import ValidationError

from flagstop.router.openai.chat_request import ChatCompletionRequest, as_chat
from flagstop.router.openai.errors import OpenAIError
from flagstop.router.openai.messages_request import MessagesRequest
from flagstop.router.openai.responses_request import ResponsesRequest

DOCS = Path(__file__).parent.parent / "docs" / "openai.md"
USER = {"role": "user", "content": "hi"}


def chat(fields: dict) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[USER], **fields)


def responses(fields: dict) -> ChatCompletionRequest:
    return as_chat(ResponsesRequest(model="m", input="hi", **fields))


def messages(fields: dict) -> ChatCompletionRequest:
    return as_chat(MessagesRequest(model="m", max_tokens=16, messages=[USER], **fields))


ROUTES = {"chat": chat, "responses": responses, "messages": messages}
SCHEMA = {"type": "object"}

# Per row: what is sent, and the effect the engine's request (or the prompt's template
# options) shows when it is honoured.
SAMPLES = {
    "max_tokens": ({"max_tokens": 7}, lambda r, g, t: g.max_tokens == 7),
    "max_completion_tokens": ({"max_completion_tokens": 7}, lambda r, g, t: g.max_tokens == 7),
    "temperature": ({"temperature": 0.25}, lambda r, g, t: g.temperature == 0.25),
    "top_p": ({"top_p": 0.5}, lambda r, g, t: g.top_p == 0.5),
    "seed": ({"seed": 11}, lambda r, g, t: g.seed == 11),
    "stop": ({"stop": ["zz"]}, lambda r, g, t: list(g.stop) == ["zz"]),
    "n": ({"n": 2}, lambda r, g, t: r.n == 2),
    "logprobs": ({"logprobs": True}, lambda r, g, t: g.HasField("logprobs")),
    "top_logprobs": ({"top_logprobs": 3}, lambda r, g, t: r.top_logprobs == 3),
    "frequency_penalty": ({"frequency_penalty": 0.5}, lambda r, g, t: g.frequency_penalty == 0.5),
    "presence_penalty": ({"presence_penalty": 0.5}, lambda r, g, t: g.presence_penalty == 0.5),
    "logit_bias": ({"logit_bias": {"5": 2.0}}, lambda r, g, t: dict(g.logit_bias) == {5: 2.0}),
    "parallel_tool_calls": ({"parallel_tool_calls": False},
                            lambda r, g, t: r.parallel_tool_calls is False),
    "response_format": ({"response_format": {"type": "json_object"}},
                        lambda r, g, t: g.structured_outputs.json_object),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}},
                       lambda r, g, t: r.include_usage),
    "user": ({"user": "ada"}, lambda r, g, t: g.labels["user"] == "ada"),
    "chat_template_kwargs": ({"chat_template_kwargs": {"x": 1}},
                             lambda r, g, t: t["variables"]["x"] == 1),
    "reasoning_effort": ({"reasoning_effort": "low"},
                         lambda r, g, t: t["variables"]["reasoning_effort"] == "low"),
    "add_generation_prompt": ({"add_generation_prompt": False},
                              lambda r, g, t: t["add_generation_prompt"] is False),
    "continue_final_message": ({"continue_final_message": True},
                               lambda r, g, t: t["continue_final_message"] is True),
    "chat_template": ({"chat_template": "{{ messages }}"},
                      lambda r, g, t: t["template"] == "{{ messages }}"),
    "include_reasoning": ({"include_reasoning": False}, lambda r, g, t: not r.include_reasoning),
    "thinking_token_budget": ({"thinking_token_budget": 9},
                              lambda r, g, t: r.thinking_token_budget == 9),
    "top_k": ({"top_k": 4}, lambda r, g, t: g.top_k == 4),
    "min_p": ({"min_p": 0.1}, lambda r, g, t: abs(g.min_p - 0.1) < 1e-6),
    "repetition_penalty": ({"repetition_penalty": 1.5},
                           lambda r, g, t: g.repetition_penalty == 1.5),
    "min_tokens": ({"min_tokens": 3}, lambda r, g, t: g.min_tokens == 3),
    "ignore_eos": ({"ignore_eos": True}, lambda r, g, t: g.ignore_eos),
    "stop_token_ids": ({"stop_token_ids": [9]}, lambda r, g, t: list(g.stop_token_ids) == [9]),
    "priority": ({"priority": 2}, lambda r, g, t: g.priority == 2),
    "prompt_logprobs": ({"prompt_logprobs": 1}, lambda r, g, t: g.prompt_logprobs == 1),
    "return_tokens_as_token_ids": ({"return_tokens_as_token_ids": True},
                                   lambda r, g, t: r.return_tokens_as_token_ids),
    "structured_outputs": ({"structured_outputs": {"regex": "[0-9]"}},
                           lambda r, g, t: g.structured_outputs.regex == "[0-9]"),
    "guided_json": ({"guided_json": SCHEMA}, lambda r, g, t: g.structured_outputs.json_schema),
    "guided_regex": ({"guided_regex": "a+"}, lambda r, g, t: g.structured_outputs.regex == "a+"),
    "guided_choice": ({"guided_choice": ["a", "b"]},
                      lambda r, g, t: list(g.structured_outputs.choice.choices) == ["a", "b"]),
    "guided_grammar": ({"guided_grammar": "start: \"a\""},
                       lambda r, g, t: g.structured_outputs.grammar),
    "num_speculative_tokens": ({"num_speculative_tokens": 0},
                               lambda r, g, t: g.HasField("num_speculative_tokens")),
    "slo_ttft_ms": ({"slo_ttft_ms": 250}, lambda r, g, t: g.slo_ttft_ms == 250),
    "slo_tpot_ms": ({"slo_tpot_ms": 40}, lambda r, g, t: g.slo_tpot_ms == 40),
    "tenant": ({"tenant": "acme"}, lambda r, g, t: g.tenant == "acme"),
    "request_class": ({"request_class": "batch"}, lambda r, g, t: g.request_class == "batch"),
}  # fmt: skip


def documented_rows() -> dict[str, dict[str, str]]:
    """The "Fields by route" table: field -> route -> yes / 400 / own."""
    text = DOCS.read_text()
    section = text[text.index("## Fields by route") :]
    section = section[: section.index("\n\n", section.index("| field |"))]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        verdicts = [re.match(r"(yes|400|own)", c)[1] for c in cells[1:]]
        rows[cells[0].strip("`")] = dict(zip(ROUTES, verdicts, strict=True))
    return rows


ROWS = documented_rows()


def test_every_documented_field_has_a_sample_and_every_sample_a_row():
    assert set(ROWS) == set(SAMPLES)
    assert len(ROWS) >= 40


@pytest.mark.parametrize("field", sorted(ROWS))
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_each_field_on_each_route_is_honoured_or_refused_by_name(route, field):
    verdict = ROWS[field][route]
    if verdict == "own":
        return  # the route's own field of that name: its own table, below
    sent, effect = SAMPLES[field]
    if verdict == "400":
        with pytest.raises(OpenAIError) as refused:
            ROUTES[route](sent)
        assert refused.value.status == 400 and field in str(refused.value)
        return
    request = ROUTES[route](sent)
    generated = request.choice_request([5, 6], 0)
    assert effect(request, generated, request.template_options(None)), (route, field)


def sdk_fields(params) -> set[str]:
    return set(typing.get_type_hints(params))


# A non-neutral value of each field a route refuses unless unset.
REFUSED = {
    "responses": {"previous_response_id": "resp_1", "background": True, "conversation": "c",
                  "prompt": {"id": "p"}, "max_tool_calls": 2, "prompt_cache_options": {"ttl": "1h"},
                  "context_management": [{"type": "x"}],
                  "moderation": {"x": 1}, "image": {"x": 1}, "access_programs": {"x": 1},
                  "service_tier": "flex", "truncation": "auto", "include": ["reasoning.x"],
                  "stream_options": {"include_obfuscation": True}},
    "messages": {"container": "c", "mcp_servers": [{"url": "u"}], "diagnostics": {"x": 1},
                 "inference_geo": "eu", "user_profile_id": "u", "workspace_id": "w",
                 "speed": "fast"},
}  # fmt: skip
ACCEPTED = {
    "responses": {"store": True, "prompt_cache_key": "k", "prompt_cache_retention": "in_memory",
                  "service_tier": "auto", "truncation": "disabled", "metadata": {"a": "b"},
                  "safety_identifier": "ada", "stream_options": {"include_obfuscation": False},
                  "reasoning": {"effort": "low", "summary": "auto"}},
    "messages": {"cache_control": {"type": "ephemeral", "ttl": "5m"}, "service_tier": "auto",
                 "speed": "standard", "metadata": {"user_id": "ada"},
                 "output_config": {"effort": "high", "format": {"type": "json_schema",
                                                                 "schema": SCHEMA}}},
}  # fmt: skip


@pytest.mark.parametrize(("route", "params", "model"), [
    ("responses", response_create_params.ResponseCreateParamsBase, ResponsesRequest),
    ("messages", message_create_params.MessageCreateParamsBase, MessagesRequest),
])  # fmt: skip
def test_every_field_the_sdks_send_is_the_routes_own(route, params, model):
    assert sdk_fields(params) - {"stream"} <= set(model.model_fields), "unknown: ignored"


@pytest.mark.parametrize("route", ["responses", "messages"])
def test_the_routes_own_fields_are_honoured_or_refused_by_name(route):
    for field, value in REFUSED[route].items():
        with pytest.raises(OpenAIError) as refused:
            ROUTES[route]({field: value})
        assert field in str(refused.value), field
    for field, value in ACCEPTED[route].items():
        ROUTES[route]({field: value})


def test_what_the_routes_own_fields_become():
    assert responses({"safety_identifier": "ada"}).user == "ada"
    assert messages({"metadata": {"user_id": "ada"}}).user == "ada"
    config = messages(
        {"output_config": {"effort": "high", "format": {"type": "json_schema", "schema": SCHEMA}}}
    )
    assert config.reasoning_effort == "high"
    assert config.response_format.json_schema.schema_ == SCHEMA
    assert messages({"thinking": {"type": "disabled"}, "chat_template_kwargs": {"x": 1}}
                    ).chat_template_kwargs == {"enable_thinking": False, "x": 1}  # fmt: skip
    prefill = as_chat(MessagesRequest(model="m", max_tokens=8, messages=[
        USER, {"role": "assistant", "content": "The answer is"}]))  # fmt: skip
    assert prefill.template_options(None)["continue_final_message"] is True


def test_a_field_set_both_ways_is_refused_naming_it():
    with pytest.raises(OpenAIError, match="stop is set by this API's own field"):
        messages({"stop_sequences": ["a"], "stop": ["b"]})
    with pytest.raises(OpenAIError, match="reasoning_effort"):
        responses({"reasoning": {"effort": "low"}, "reasoning_effort": "high"})


def test_unknown_fields_are_ignored_on_every_route():
    for route in ROUTES.values():
        route({"some_other_providers_field": 1})


def test_a_refused_chat_field_at_its_unset_value_is_taken():
    for route in (responses, messages):
        assert route({"n": 1, "logprobs": False}).n == 1
    with pytest.raises(ValidationError):
        chat({"n": 0})
