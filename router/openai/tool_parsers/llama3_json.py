"""Llama 3.1-3.3's JSON calls (Meta's model card, "JSON based tool calling"): a call is
{"name": N, "parameters": {...}} ("arguments" read too), after <|python_tag|> or not,
at the output's start or after text (as vLLM reads it); parallel calls one after
another, apart by ";" or a newline. An object that is not a call stays content, as
written: the name and the parameters are both required, so a JSON object in an
answer is not taken for a call.

    {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": ...}"""

import re

from flagstop.router.openai.tool_parsers.arguments import json_call
from flagstop.router.openai.tool_parsers.base import CallParser, Read, Region
from flagstop.router.openai.tool_parsers.json_values import JsonScanner, split_values

SEPARATOR = re.compile(r"\s*;?\s*")


class JsonObjects:
    """A region of JSON objects apart by separators: it ends after the last one that
    another object does not follow."""

    __slots__ = ("at", "last", "scanner")

    def __init__(self, skip: int) -> None:
        self.at, self.last = skip, skip  # where scanning goes on; the last object's end
        self.scanner: JsonScanner | None = JsonScanner()

    def end(self, text: str) -> int | None:
        while True:
            if self.scanner is None:
                after = SEPARATOR.match(text, self.at).end()
                if after == len(text):
                    return None  # another may follow
                if text[after] != "{":
                    return self.last
                self.scanner, self.at = JsonScanner(), after
            self.at += self.scanner.scan(text[self.at :])
            if not self.scanner.done:
                return None
            self.scanner, self.last = None, self.at


class Llama3Json(CallParser):
    TAG = "<|python_tag|>"
    MARKERS = (TAG, "{")

    def open(self, marker: str) -> Region:
        return JsonObjects(len(marker) if marker == self.TAG else 0)

    def read(self, text: str, closed: bool, cut: bool) -> Read:
        start = len(self.TAG) if text.startswith(self.TAG) else 0
        spans = split_values(text, start)
        found = [None if cut and not done else json_call(text[b:e], arguments_required=True)
                 for b, e, done in spans]  # fmt: skip
        if not spans or all(f is None for f in found):
            return [text]
        out: Read = [text[:start]] if start and found[0] is None else []
        for i, ((b, e, _), call) in enumerate(zip(spans, found, strict=True)):
            rest = text[e : spans[i + 1][0] if i + 1 < len(spans) else len(text)]
            out.append(call if call is not None else text[b:e])
            if call is None or i + 1 == len(spans) or found[i + 1] is None:
                out.append(rest)  # separators between two calls are the calls' syntax
        return out
