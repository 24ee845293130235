"""Hermes' format (NousResearch's Hermes 2 Pro and 3, Qwen2.5 and Qwen3 with their own
templates): each call a JSON object between tags, arguments an object (a string that
holds one is taken too), a list of calls in one tag read as they are.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>"""

from flagstop.router.openai.tool_parsers.arguments import json_calls
from flagstop.router.openai.tool_parsers.base import CallParser, Closed, Read, Region


class Hermes(CallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    MARKERS = (OPEN,)

    def open(self, marker: str) -> Region:
        return Closed(self.CLOSE, marker)

    def read(self, text: str, closed: bool, cut: bool) -> Read:
        body = text[len(self.OPEN) : len(text) - len(self.CLOSE) if closed else None]
        calls = None if cut else json_calls(body)
        return [text] if calls is None else list(calls)
