"""The parser fixtures of tests/data/ (tool_calls/, reasoning/: a YAML file per family),
and what a parser gives for a case's output fed in pieces."""

import itertools
import json
from pathlib import Path
from typing import Any

import yaml

from flagstop.router.openai.chat_request import ToolDefinition

DATA = Path(__file__).parent.parent / "data"


def cases(kind: str) -> list[tuple[str, dict[str, Any]]]:
    """(family, case) of every file of tests/data/<kind>/; a case gets its file's tools
    unless it names its own."""
    found = []
    for path in sorted((DATA / kind).glob("*.yaml")):
        fixture = yaml.safe_load(path.read_text())
        for case in fixture["cases"]:
            found.append((path.stem, {"tools": fixture.get("tools", []), **case}))
    return found


def case_id(family: str, case: dict[str, Any]) -> str:
    return f"{family}: {case['name']}"


def tool_definitions(tools: list[dict[str, Any]]) -> list[ToolDefinition]:
    return [ToolDefinition(type="function", function=tool) for tool in tools]


def pieces_at(text: str, cuts: list[int]) -> list[str]:
    """text cut at the given places (in any order, repeats allowed)."""
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def feed(parser, pieces: list[str], finish: str) -> tuple[str, list[dict], list[dict]]:
    """(content, call deltas, calls) of a tool-call parser fed the pieces, the output
    ending with the last one."""
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        text, calls = parser.feed(piece, finish if i == len(pieces) - 1 else None)
        content += text
        deltas += calls
    return content, deltas, parser.calls


def comparable(calls: list[dict], with_ids: bool) -> list[tuple]:
    """A reply's calls as (name, arguments parsed[, id]); their arguments are JSON
    objects' text, or this fails."""
    out = []
    for call in calls:
        arguments = json.loads(call["function"]["arguments"])
        assert isinstance(arguments, dict), call
        key = (call["function"]["name"], arguments)
        out.append((*key, call["id"]) if with_ids else key)
    return out


def expected_calls(case: dict[str, Any]) -> list[tuple]:
    return [(c["name"], c["arguments"]) for c in case.get("calls", [])]
