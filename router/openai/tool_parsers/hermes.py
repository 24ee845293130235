"""Hermes' format (NousResearch's Hermes 2 Pro and 3, Qwen2.5 and Qwen3 with their own
templates): each call a JSON object between tags, arguments an object (a string that
holds one is taken too), a list of calls in one tag read as they are.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>"""

from flagstop.router.openai.tool_parsers.arguments import json_calls
from flagstop.router.openai.tool_parsers.base import Found, Tagged


class Hermes(Tagged):
    def found_in(self, body: str) -> list[Found] | None:
        return json_calls(body)
