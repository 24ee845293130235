"""Mistral's formats, as its tokenizers write them (mistral-common):
- v2/v3 (Mistral-7B-Instruct-v0.3, Mixtral): [TOOL_CALLS] then a JSON list of
  {"name", "arguments"} objects (keys in either order);
- v11+ (Mistral-Small-3.2, Devstral, Magistral): [TOOL_CALLS]name[ARGS]{...} per call,
  [CALL_ID]id before [ARGS] where the tokenizer writes one, and the same without
  [ARGS] (name{...}: the tokenizers before it, or [ARGS] decoded away).
Call ids are nine letters and digits: Mistral's templates refuse others."""

import json
import random
import re
import string
from typing import Any

from flagstop.router.openai.tool_parsers.arguments import as_object_text, call_of
from flagstop.router.openai.tool_parsers.base import CallParser, Found, Read, Region
from flagstop.router.openai.tool_parsers.json_values import JsonScanner, split_values

START, CALL_ID, ARGS = "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"
HEAD = re.compile(r"([\w.\-]+)(?:\[CALL_ID\](\w+))?(?:\[ARGS\])?\s*")
ID_CHARACTERS = string.ascii_letters + string.digits


class MistralCalls:
    """[TOOL_CALLS], then a list, or a name (its id, [ARGS]) and an object: the region
    ends with that JSON value, or where the text stops reading as either."""

    __slots__ = ("at", "scanner")

    def __init__(self) -> None:
        self.at, self.scanner = len(START), None

    def end(self, text: str) -> int | None:
        if self.scanner is None:
            start = _value_start(text)
            if start is None or start < 0:
                return None if start is None else -start
            self.scanner, self.at = JsonScanner(), start
        self.at += self.scanner.scan(text[self.at :])
        return self.at if self.scanner.done else None


def _value_start(text: str) -> int | None:
    """Where the calls' JSON value starts after [TOOL_CALLS]; None while that is not
    known; -i where the text stops reading as calls at i."""
    at = len(START)
    while at < len(text) and text[at].isspace():
        at += 1
    if at == len(text) or text[at] == "[":
        return None if at == len(text) else at
    head = HEAD.match(text, at)
    if head is None:
        return -at
    after = head.end()
    if after == len(text) or CALL_ID.startswith(text[after:]) or ARGS.startswith(text[after:]):
        return None  # the name, its id or [ARGS] may go on
    return after if text[after] == "{" else -after


class Mistral(CallParser):
    MARKERS = (START,)

    def open(self, marker: str) -> Region:
        return MistralCalls()

    def new_id(self) -> str:
        return "".join(random.choices(ID_CHARACTERS, k=9))

    def read(self, text: str, closed: bool, cut: bool) -> Read:
        body = text[len(START) :].lstrip()
        if body.startswith("["):
            return self._listed(text, len(text) - len(body) + 1, cut)
        head = HEAD.match(body)
        value = body[head.end() :] if head else ""
        arguments = None if cut or not value else as_object_text(value)
        return [text] if arguments is None else [Found(head[1], arguments, head[2])]

    def _listed(self, text: str, start: int, cut: bool) -> Read:
        """A JSON list of calls (v3) from start: its complete calls, the rest content."""
        found: Read = []
        for begin, end, done in split_values(text, start):
            call = call_of(_json(text[begin:end])) if done else None
            if call is None or (cut and not done):
                return [*found, text[begin:]] if found else [text]
            found.append(call)
        return found or [text]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
