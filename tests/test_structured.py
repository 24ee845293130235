"""Structured outputs on a real stack: the embedded random-weight model, which never
writes JSON by chance, made to write what a schema, a regex, a choice list and a
grammar allow, through the gRPC API and the OpenAI API; greedy constrained outputs
unchanged by preemption and by an executor killed mid-stream; bad constraints
refused cleanly while other requests go on."""

import ast
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from flagstop.router.openai.chat_request import ChatCompletionRequest
from flagstop.router.openai.protocol import CompletionRequest
from flagstop.structured import Constraint, GrammarError, check, constraint_from_proto
from flagstop.v1 import generation_pb2
from tests.helpers.executor_harness import Harness
from tools.stack import generate, start_stack

MODEL = "flagstop-tiny"
PROMPT = "The scheduler keeps"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "role": {"enum": ["router", "scheduler", "executor"]},
        "replicas": {"type": "integer", "minimum": 1, "maximum": 64},
        "tags": {"type": "array", "items": {"enum": ["gpu", "cpu", "edge"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "team": {"type": "string", "maxLength": 8},
                "oncall": {"type": "boolean"},
            },
            "required": ["team", "oncall"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "role", "replicas", "tags", "owner"],
    "additionalProperties": False,
}
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ["positive", "negative", "neutral"]
# Small arithmetic: bounded, so that a sampled expression ends before max_tokens.
ARITHMETIC = """root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" num ("+" | "-") num ")"
num ::= [1-9] [0-9]{0,2}
"""
ARITHMETIC_LARK = """start: expr
expr: NUM (OP NUM)~0..3
OP: "+" | "-" | "*"
NUM: /[1-9][0-9]{0,2}/
"""
N = 24  # sampled completions per case and API


def is_arithmetic(text: str) -> bool:
    """A Python expression of integer literals, + - * / and parentheses only."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    return all(isinstance(node, allowed) for node in ast.walk(tree))


def valid_json(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


CASES = {
    "schema": (generation_pb2.StructuredOutputs(json_schema=json.dumps(SCHEMA), strict=True),
               valid_json),
    "regex": (generation_pb2.StructuredOutputs(regex=DATE),
              lambda text: re.fullmatch(DATE, text) is not None),
    "choice": (generation_pb2.StructuredOutputs(choice=generation_pb2.Choices(choices=CHOICES)),
               lambda text: text in CHOICES),
    "grammar": (generation_pb2.StructuredOutputs(grammar=ARITHMETIC), is_arithmetic),
}  # fmt: skip
# The same cases in the OpenAI API's words (vLLM's extras beside response_format).
OPENAI_CASES = {
    "schema": {"response_format": {"type": "json_schema",
               "json_schema": {"name": "service", "schema": SCHEMA, "strict": True}}},
    "regex": {"guided_regex": DATE},
    "choice": {"structured_outputs": {"choice": CHOICES}},
    "grammar": {"guided_grammar": ARITHMETIC},
}  # fmt: skip


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    stack = start_stack(model_dir, tmp_path_factory.mktemp("logs"),
                        executor_args=["--num-blocks", "512"])  # fmt: skip
    yield stack
    assert set(stack.stop().values()) == {0}


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


def sampling(i: int) -> dict:
    """Temperature sampling with a mix of top-k, top-p and seeds."""
    fields: dict = {"temperature": 1.0, "seed": 1000 + i}
    if i % 3 == 1:
        fields["top_k"] = 40
    if i % 3 == 2:
        fields["top_p"] = 0.9
    return fields


def grpc_completion(stack, structured, i: int, **fields):
    tokens, text, last = generate(
        stack, prompt=PROMPT, max_tokens=160, structured_outputs=structured,
        **{**sampling(i), **fields},
    )  # fmt: skip
    return tokens, text, last


def in_parallel(fn, n: int = N) -> list:
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(fn, range(n)))


# -- the canonical form and the checks, in process ----------------------------------


def test_specs_take_one_canonical_form_per_constraint():
    loose = json.dumps({"type": "object", "properties": {"b": {"type": "integer"}}}, indent=2)
    constraint = constraint_from_proto(
        generation_pb2.StructuredOutputs(json_schema=loose, strict=True)
    )
    assert constraint == Constraint(
        "json_schema", '{"type":"object","properties":{"b":{"type":"integer"}}}'
    )
    choice = generation_pb2.StructuredOutputs(choice=generation_pb2.Choices(choices=['a"b', "c"]))
    assert constraint_from_proto(choice) == Constraint("lark", 'start: "a\\"b" | "c"')
    assert (
        constraint_from_proto(generation_pb2.StructuredOutputs(grammar=ARITHMETIC)).kind == "ebnf"
    )
    assert (
        constraint_from_proto(generation_pb2.StructuredOutputs(grammar=ARITHMETIC_LARK)).kind
        == "lark"
    )
    any_object = constraint_from_proto(generation_pb2.StructuredOutputs(json_object=True))
    assert (any_object.kind, any_object.strict) == ("json_schema", False)
    for structured, _ in CASES.values():
        assert check(constraint_from_proto(structured)) is None
    assert (
        check(constraint_from_proto(generation_pb2.StructuredOutputs(grammar=ARITHMETIC_LARK)))
        is None
    )


BAD = {
    "json_schema": ('{"type": "objekt"}', "Invalid type: objekt"),
    "regex": ("(abc", "unclosed group"),
    "grammar": ("root ::= expr", "Rule 'expr' not found"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_constraint_is_refused_with_the_engines_message(kind):
    text, message = BAD[kind]
    refusal = check(constraint_from_proto(generation_pb2.StructuredOutputs(**{kind: text})))
    assert refusal is not None and message in refusal and refusal.startswith(kind)
    for bad in ("", "not json", "[1, 2]"):
        with pytest.raises(GrammarError):
            constraint_from_proto(generation_pb2.StructuredOutputs(json_schema=bad))
    with pytest.raises(GrammarError, match="non-empty"):
        constraint_from_proto(generation_pb2.StructuredOutputs(choice=generation_pb2.Choices()))


def test_openai_fields_map_to_one_constraint():
    body = {"model": MODEL, "prompt": "x"}
    request = CompletionRequest(**body, response_format={"type": "json_object"})
    assert request.choice_request("x", 0).structured_outputs.json_object
    request = ChatCompletionRequest(
        model=MODEL, messages=[{"role": "user", "content": "x"}],
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
    )  # fmt: skip
    so = request.choice_request([1, 2], 0).structured_outputs
    assert json.loads(so.json_schema) == SCHEMA and not so.strict
    text = CompletionRequest(**body, response_format={"type": "text"}).choice_request("x", 0)
    assert not text.HasField("structured_outputs")
    with pytest.raises(ValueError, match="at most one output constraint"):
        CompletionRequest(**body, guided_regex="a", guided_choice=["a"])


# -- the executor's masks, in process ---------------------------------------------


@pytest.fixture(scope="module")
def harness(model_dir) -> Harness:
    config = ExecutorConfig(model=str(model_dir), num_blocks=64, block_size=16, max_num_seqs=8)
    return Harness(ModelRunner(config))


def test_only_constrained_rows_are_masked_and_a_replay_that_breaks_fails_one_request(
    harness, model_dir
):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    digits = Constraint("regex", "[0-9]{3}")
    letters = tokenizer("abc").input_ids[-2:]  # "output" a digit grammar cannot replay
    harness.add("free", [0, 5, 6, 7])
    harness.add("digits", [0, 5, 6, 7], SamplingParams(grammar=digits))
    broken = [0, 5, *letters]
    harness.add("broken", broken, SamplingParams(
        grammar=digits, num_prompt_tokens_constrained=len(letters)))  # fmt: skip
    first = harness.step({"free": 4, "digits": 4, "broken": len(broken)})
    assert first["broken"] == -1, "its replay failed: it ends, the batch goes on"
    assert harness.runner.batch.req_rows.keys() >= {"free", "digits", "broken"}
    harness.leave("broken")
    text = tokenizer.decode([first["digits"]])
    for _ in range(3):
        out = harness.step({"free": 1, "digits": 1})
        text += tokenizer.decode([out["digits"]]) if out["digits"] != 1 else ""
    assert re.fullmatch("[0-9]{1,3}", text), text
    unconstrained = tokenizer.decode(harness.requests["free"].token_ids[4:])
    assert not unconstrained.isdigit(), "the free row was masked too"


def test_a_constraint_after_a_trigger_starts_when_the_trigger_is_sampled(model_dir):
    """A reasoning model's answer is constrained, its reasoning before is free: the row
    is unmasked until its trigger tokens appear, then the grammar sees what follows."""
    import numpy as np
    import torch

    from flagstop.executor.grammar_book import GrammarBook

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trigger = tokenizer("</x>", add_special_tokens=False).input_ids
    digit, letter = tokenizer("7", add_special_tokens=False).input_ids[-1], trigger[0]
    book = GrammarBook(str(model_dir), len(tokenizer), [tokenizer.eos_token_id], 4)
    constraint = Constraint("regex", "[0-9]{3}", after_token_ids=tuple(trigger))
    book.add(0, constraint, [letter, *trigger[:-1]])  # a resumed row: the trigger half sampled

    def step(token: int) -> torch.Tensor:
        logits = torch.zeros(1, len(tokenizer))
        book.accept(book.mask(logits, np.array([0])), [token])
        return logits

    assert torch.isfinite(step(trigger[-1])).all(), "free until the trigger completes"
    masked = step(digit)
    assert torch.isinf(masked[0, letter]) and torch.isfinite(masked[0, digit])
    assert list(constraint_from_proto(generation_pb2.StructuredOutputs(
        regex="a", after_token_ids=trigger)).after_token_ids) == trigger  # fmt: skip


def test_a_thinking_budget_forces_the_trigger_and_holds_drafts_short_of_it(model_dir):
    import numpy as np
    import torch

    from flagstop.executor.grammar_book import GrammarBook
    from flagstop.structured import NONE

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trigger = tuple(tokenizer("</x>", add_special_tokens=False).input_ids)
    book = GrammarBook(str(model_dir), len(tokenizer), [tokenizer.eos_token_id], 4)
    book.add(0, Constraint(NONE, "", after_token_ids=trigger, force_after_within=3), [9])
    assert book.valid_drafts(np.array([0]), [np.array([5, 6, 7])])[0][0].tolist() == [5]
    forced = []
    for token in range(11, 19):  # the model's own picks, overridden past the budget
        logits = torch.zeros(1, len(tokenizer))
        waiting = book.mask(logits, np.array([0]))
        if torch.isinf(logits).any():
            forced.append(int(logits.argmax()))
            token = forced[-1]
        book.accept(waiting, [token])
        if not book.waiting:
            break
    assert tuple(forced) == trigger, "the trigger forced, token by token, from the budget on"
    assert not book.matchers and not book.waiting, "a budget alone: nothing after it"
    assert constraint_from_proto(generation_pb2.StructuredOutputs(
        after_token_ids=list(trigger), force_after_within=3)).kind == NONE  # fmt: skip
    # A model that opens its reasoning itself: counted from its opening, and only when
    # its output starts with it.
    opened = Constraint(NONE, "", after_token_ids=trigger, force_after_within=2,
                         open_token_ids=(7,))  # fmt: skip
    book.add(1, opened, [7, 9])
    book.add(2, opened, [9, 7, 9, 9, 9])
    assert [w.forced() for w in (book.waiting[1], book.waiting[2])] == [None, None]
    book.accept([(0, book.waiting[1])], [9])
    assert book.waiting[1].forced() == trigger[0]
    with pytest.raises(GrammarError):  # neither a constraint nor a budget
        constraint_from_proto(generation_pb2.StructuredOutputs(after_token_ids=list(trigger)))


# -- 50 sampled completions per case, through both APIs --------------------------------


@pytest.mark.processes
@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_grpc_completions_all_match_their_constraint(stack, case):
    structured, valid = CASES[case]
    results = in_parallel(lambda i: grpc_completion(stack, structured, i))
    texts = [text for _, text, _ in results]
    bad = [text for text in texts if not valid(text)]
    assert not bad, f"{len(bad)} of {N} do not match: {bad[:3]}"
    assert all(last.finish_reason == generation_pb2.FINISH_REASON_STOP for *_, last in results)
    if case != "choice":  # the constraint leaves the model real choices to make
        assert len(set(texts)) > N // 2, "sampling was meant to differ between requests"


@pytest.mark.processes
@pytest.mark.parametrize("case", sorted(OPENAI_CASES))
def test_sampled_openai_completions_all_match_their_constraint(client, case):
    _, valid = CASES[case]

    def one(i: int) -> tuple[str, str]:
        fields = {**OPENAI_CASES[case], **_top(i)}
        if i % 2:  # chat, with the SDK's own response_format where the case has one
            rf = fields.pop("response_format", openai.NOT_GIVEN)
            result = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=160,
                temperature=1.0, seed=2000 + i, response_format=rf, extra_body=fields,
            )  # fmt: skip
            choice = result.choices[0]
            return choice.message.content, choice.finish_reason
        result = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=160, temperature=1.0, seed=2000 + i,
            extra_body=fields,
        )  # fmt: skip
        return result.choices[0].text, result.choices[0].finish_reason

    results = in_parallel(one)
    bad = [text for text, _ in results if not valid(text)]
    assert not bad, f"{len(bad)} of {N} do not match: {bad[:3]}"
    assert {reason for _, reason in results} == {"stop"}


def _top(i: int) -> dict:
    return {"top_k": 40} if i % 3 == 1 else {"top_p": 0.9} if i % 3 == 2 else {}


@pytest.mark.processes
def test_json_object_streams_a_json_object(client):
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=300, temperature=0, stream=True,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert text.startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # greedy may wander in a free-form object: then it ran out of tokens
        assert reason == "length"


# -- with the rest of sampling -----------------------------------------------------


@pytest.mark.processes
def test_logprobs_are_those_of_the_masked_distribution(stack):
    stub = stack.generation()
    request = generation_pb2.GenerateRequest(
        prompt=PROMPT, max_tokens=8, temperature=0, logprobs=20,
        structured_outputs=generation_pb2.StructuredOutputs(
            choice=generation_pb2.Choices(choices=CHOICES)
        ),
    )  # fmt: skip
    entries = [lp for chunk in stub.Generate(request, timeout=60) for lp in chunk.logprobs]
    first = entries[0]
    # Only tokens that start a choice are alternatives, and they carry all the mass.
    assert 1 <= len(first.top) < 20
    assert sum(2.718281828459045**t.logprob for t in first.top) == pytest.approx(1.0, abs=1e-4)
    assert all(t.logprob > float("-inf") for e in entries for t in e.top)


@pytest.mark.processes
def test_stop_strings_and_max_tokens_end_a_constrained_output(stack):
    structured = generation_pb2.StructuredOutputs(regex=DATE)
    _, text, last = generate(stack, prompt=PROMPT, max_tokens=50, temperature=0, stop=["-"],
                             structured_outputs=structured)  # fmt: skip
    assert (
        re.fullmatch(r"[0-9]{4}", text) and last.finish_reason == generation_pb2.FINISH_REASON_STOP
    )
    assert last.stop_reason == "-"
    schema = generation_pb2.StructuredOutputs(json_schema=json.dumps(SCHEMA))
    tokens, text, last = generate(stack, prompt=PROMPT, max_tokens=5, temperature=0,
                                  structured_outputs=schema)  # fmt: skip
    assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH and len(tokens) == 5
    assert text.startswith('{"') and not valid_json(text)


# -- refusals ----------------------------------------------------------------------


@pytest.mark.processes
def test_bad_constraints_are_refused_and_other_requests_go_on(stack, client):
    structured, valid = CASES["schema"]
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(grpc_completion, stack, structured, 7)
        for kind, (text, message) in BAD.items():
            with pytest.raises(grpc.RpcError) as error:
                generate(
                    stack,
                    prompt=PROMPT,
                    max_tokens=10,
                    structured_outputs=generation_pb2.StructuredOutputs(**{kind: text}),
                )
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in error.value.details()
        with pytest.raises(grpc.RpcError) as error:
            generate(stack, prompt=PROMPT, max_tokens=10, ignore_eos=True,
                     structured_outputs=structured)  # fmt: skip
        assert "ignore_eos" in error.value.details()
        for body in ({"guided_regex": "(abc"}, {"guided_json": {"type": "objekt"}},
                     {"guided_grammar": "root ::= expr"},
                     {"response_format": {"type": "json_schema"}},
                     {"guided_regex": "a", "guided_choice": ["a"]}):  # fmt: skip
            with pytest.raises(openai.BadRequestError) as error:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                          extra_body=body)  # fmt: skip
            assert error.value.status_code == 400 and error.value.message
        _, text, last = good.result(timeout=60)
    assert valid(text) and last.finish_reason == generation_pb2.FINISH_REASON_STOP


# -- greedy outputs that survive preemption and lost processes ---------------------------


def greedy_requests() -> list[tuple[str, generation_pb2.StructuredOutputs]]:
    # Runs to max_tokens; a matcher that forgot its tokens would restart mid-item.
    words = generation_pb2.StructuredOutputs(regex=r"([a-z]{2,8}=[0-9]{1,3}; ){100}")
    return [(f"{PROMPT} {i}", CASES[c][0]) for i, c in enumerate(sorted(CASES))] + [
        (f"Request {i} of the batch", words) for i in range(6)
    ]


def greedy_outputs(stack, requests, max_tokens: int = 120) -> list[list[int]]:
    def one(item):
        prompt, structured = item
        tokens, _, _ = generate(stack, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                structured_outputs=structured, timeout=120)  # fmt: skip
        return tokens

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


@pytest.mark.processes
@pytest.mark.parametrize("ranks", [1, 2])
def test_greedy_constrained_outputs_are_unchanged_by_preemption(stack, model_dir, tmp_path, ranks):
    """A 384-token pool forces preemption; on two ranks the mask is rank 0's, where
    the group samples."""
    requests = greedy_requests()
    expected = greedy_outputs(stack, requests)
    tight = start_stack(
        model_dir, tmp_path,
        executor_args=["--num-blocks", "24", "--tensor-parallel-size", str(ranks)],
        scheduler_args=["--max-num-batched-tokens", "32", "--max-num-seqs", "8"],
    )  # fmt: skip
    try:
        assert greedy_outputs(tight, requests) == expected
        assert tight.stats().num_preemptions > 0, "the pool was meant to force preemption"
    finally:
        tight.stop(10)


# Long enough that the kill, right after the last stream's 10th token, lands mid-way
# (it takes microseconds; the stack decodes a token every few milliseconds).
MID_STREAM_TOKENS = 100


@pytest.mark.processes
@pytest.mark.parametrize("killed", ["executor", "scheduler"])
def test_greedy_constrained_outputs_survive_a_restart_mid_stream(
    stack, model_dir, tmp_path, killed
):
    """A new executor replays each request's tokens into a fresh matcher; a new
    scheduler gets each request again from the router, its outputs so far in its
    prompt, and the executor replays those."""
    requests = greedy_requests()
    expected = greedy_outputs(stack, requests, max_tokens=MID_STREAM_TOKENS)
    fresh = start_stack(model_dir, tmp_path, executor_args=["--num-blocks", "512"])
    try:
        tokens: list[list[int]] = [[] for _ in requests]

        def one(i: int):
            prompt, structured = requests[i]
            request = generation_pb2.GenerateRequest(
                prompt=prompt,
                max_tokens=MID_STREAM_TOKENS,
                temperature=0,
                structured_outputs=structured,
            )
            for chunk in fresh.generation().Generate(request, timeout=120):
                tokens[i] += chunk.token_ids

        with ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(one, i) for i in range(len(requests))]
            deadline = time.monotonic() + 60
            while min(len(tokens[i]) for i in range(4, len(requests))) < 10:
                assert time.monotonic() < deadline, "the streams did not start"
                time.sleep(0.005)
            fresh.kill(killed)
            assert any(len(t) < MID_STREAM_TOKENS for t in tokens[4:]), (
                "the kill was meant to be mid-stream"
            )
            fresh.restart(killed)
            for future in futures:
                future.result(timeout=120)
        assert tokens == expected
    finally:
        fresh.stop(10)
