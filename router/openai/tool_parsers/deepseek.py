"""DeepSeek's formats (their chat templates): calls in a section, each call
- V3, R1-0528: function<｜tool▁sep｜>NAME, then its arguments in a json fence;
- V3.1: NAME<｜tool▁sep｜>ARGUMENTS (JSON).

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>"""

import re

from flagstop.router.openai.tool_parsers.arguments import as_object_text
from flagstop.router.openai.tool_parsers.base import Found
from flagstop.router.openai.tool_parsers.sections import Sections

SEP = "<｜tool▁sep｜>"
FENCED = re.compile(r"\s*(.+?)\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)


class DeepSeekV3(Sections):
    SECTION_BEGIN, SECTION_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    MARKERS = (SECTION_BEGIN,)
    CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"

    def call(self, body: str) -> Found | None:
        head, sep, rest = body.partition(SEP)
        if not sep or not head.strip():
            return None
        if head.strip() == "function":  # V3: the name, then a json fence
            fenced = FENCED.fullmatch(rest)
            if fenced is None:
                return None
            name, rest = fenced[1], fenced[2]
        else:  # V3.1
            name = head.strip()
        arguments = as_object_text(rest.strip())
        return None if arguments is None else Found(name.strip(), arguments)
