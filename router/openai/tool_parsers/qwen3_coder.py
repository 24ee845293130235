"""Qwen3-Coder's format (its chat template; Qwen3.5 and Qwen3-Next write it too): a
function and its parameters as tags, each value on lines of its own, typed by the
tool's schema. Read as vLLM reads it: a function without the <tool_call> around it,
and a parameter whose closing tag is missing where the next tag follows.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    </function>
    </tool_call>"""

import re

from flagstop.router.openai.tool_parsers.arguments import Parameters
from flagstop.router.openai.tool_parsers.base import Closed, Found, Region, Tagged

FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
PARAMETER = re.compile(
    r"\s*<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=\s*<parameter=)|(?=\s*</function>))",
    re.DOTALL,
)
FUNCTION_END = re.compile(r"\s*</function>")


class Qwen3Coder(Tagged):
    BARE = "<function="
    MARKERS = (Tagged.OPEN, BARE)

    def open(self, marker: str) -> Region:
        return Closed(self.CLOSE if marker == self.OPEN else "</function>", marker)

    def function(self, body: str) -> Found | None:
        function = FUNCTION.match(body)
        if function is None:
            return None
        name = function[1].strip()
        params, at = Parameters(self.schemas, name), function.end()
        while parameter := PARAMETER.match(body, at):
            params.add(parameter[1].strip(), _one_newline_off(parameter[2]))
            at = parameter.end()
        end = FUNCTION_END.match(body, at)
        at = end.end() if end else at
        return Found(name, params.text()) if not body[at:].strip() else None


def _one_newline_off(value: str) -> str:
    """The value's own lines: one newline off each end."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value
