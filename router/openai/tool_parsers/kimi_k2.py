"""Kimi-K2's format (its chat template): calls in a section, each with the model's own
id, functions.NAME:COUNTER (the counter runs over the conversation). Read as SGLang
reads it: NAME:COUNTER without "functions.", and a bare COUNTER, whose tool is the one
the arguments fit (the only tool, or the only one whose schema has every argument
and whose required ones are all there; otherwise it is content). The id given out is
the template's form, functions.NAME:COUNTER, which renders the result back to it.

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>"""

import json
import re

from flagstop.router.openai.tool_parsers.arguments import as_object_text
from flagstop.router.openai.tool_parsers.base import Found
from flagstop.router.openai.tool_parsers.sections import Sections

ARGUMENT = "<|tool_call_argument_begin|>"
CALL_ID = re.compile(r"(?:functions\.)?(?:([\w.\-]+):)?(\d+)")


class KimiK2(Sections):
    SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    MARKERS = (SECTION_BEGIN,)
    CALL_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"

    def call(self, body: str) -> Found | None:
        head, sep, rest = body.partition(ARGUMENT)
        call_id = CALL_ID.fullmatch(head.strip())
        arguments = as_object_text(rest.strip()) if sep else None
        if call_id is None or arguments is None:
            return None
        name = call_id[1] or self._fitting(json.loads(arguments))
        return None if name is None else Found(name, arguments, f"functions.{name}:{call_id[2]}")

    def _fitting(self, arguments: dict) -> str | None:
        """The tool a bare counter's arguments fit, if exactly one does."""
        if len(self.schemas) == 1:
            return next(iter(self.schemas))
        fits = [name for name, schema in self.schemas.items() if _fits(arguments, schema)]
        return fits[0] if len(fits) == 1 else None


def _fits(arguments: dict, schema: dict) -> bool:
    properties = schema.get("properties") or {}
    required = schema.get("required") or []
    return bool(arguments) and set(arguments) <= set(properties) and set(required) <= set(arguments)
