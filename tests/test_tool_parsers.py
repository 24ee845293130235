"""Every --tool-call-parser held to its family's published format: the fixtures in
tests/data/tool_calls/ (a file per family: outputs from the model cards and chat
templates, the outputs other engines' parser tests use, and the one rule for cut and
malformed calls), each fed whole, one character at a time, and split at random places
(Hypothesis): the same content and calls every way, each call's stream delta the call
itself, its arguments a JSON object's text."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flagstop.router.openai.tool_parsers import PARSERS
from tests.helpers.parser_fixtures import (
    case_id,
    cases,
    comparable,
    expected_calls,
    feed,
    pieces_at,
    tool_definitions,
)

CASES = cases("tool_calls")
IDS = [case_id(*c) for c in CASES]


def read(family: str, case: dict, pieces: list[str]) -> tuple[str, list[tuple]]:
    parser = PARSERS[family](tool_definitions(case["tools"]))
    content, deltas, calls = feed(parser, pieces, case.get("finish", "stop"))
    assert [{k: v for k, v in d.items() if k != "index"} for d in deltas] == calls
    assert [d["index"] for d in deltas] == list(range(len(calls)))
    return content, comparable(calls, with_ids=True)


@pytest.mark.parametrize(("family", "case"), CASES, ids=IDS)
def test_each_fixture_reads_as_its_family_writes_it(family, case):
    content, calls = read(family, case, [case["output"]])
    assert content == case["content"]
    assert [c[:2] for c in calls] == expected_calls(case)
    for want, got in zip(case.get("calls", []), calls, strict=True):
        assert "id" not in want or got[2] == want["id"]
    one_by_one = read(family, case, [*case["output"]])
    assert (one_by_one[0], [c[:2] for c in one_by_one[1]]) == (content, [c[:2] for c in calls])


@pytest.mark.parametrize(("family", "case"), CASES, ids=IDS)
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=12))
def test_each_fixture_streamed_in_any_split_reads_as_it_does_whole(family, case, cuts):
    output = case["output"]
    pieces = pieces_at(output, [cut % (len(output) + 1) for cut in cuts])
    content, calls = read(family, case, pieces)
    assert (content, [c[:2] for c in calls]) == (case["content"], expected_calls(case))


def test_every_family_has_its_fixtures():
    assert {family for family, _ in CASES} == set(PARSERS)
