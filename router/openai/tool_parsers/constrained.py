"""The calls of the tool choices that constrain the output (router/openai/tools.py): a
named function's arguments, or "required"'s JSON list of calls. The grammar makes
them valid; only max_tokens can cut one, and what it cut is content, as the families'
parsers give it (base.py)."""

import json
from typing import Any

from flagstop.router.openai.tool_parsers.arguments import as_object_text, call_of
from flagstop.router.openai.tool_parsers.base import Call, CallParser, Read, Region, new_call_id
from flagstop.router.openai.tool_parsers.json_values import JsonValue


class RequiredCalls(CallParser):
    """tool_choice "required": a JSON list of calls; each call is given out as soon as
    its object closes (the list's brackets and commas are its syntax)."""

    MARKERS = ("{",)

    def open(self, marker: str) -> Region:
        return JsonValue(0)

    def read(self, text: str, closed: bool, cut: bool) -> Read:
        found = None if cut else call_of(_json(text))
        return [text] if found is None else [found]

    def say(self, text: str) -> None:
        if text.strip(" \t\r\n[],"):
            super().say(text)


class NamedCall:
    """A named tool_choice: the whole output is the call's arguments, given out as the
    call when the output ends (content, as written, if max_tokens cut it)."""

    def __init__(self, name: str) -> None:
        self.name, self.text = name, ""
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str, finish: str | None) -> tuple[str, list[dict[str, Any]]]:
        self.text += text
        if not finish:
            return "", []
        arguments = None if finish == "length" else as_object_text(self.text)
        if arguments is None:
            return self.text, []
        call = Call(0, self.name, new_call_id(), arguments)
        self.calls.append(call.as_dict())
        return "", [{"index": 0, **call.as_dict()}]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
