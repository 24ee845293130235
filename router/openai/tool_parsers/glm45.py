"""GLM-4.5's, GLM-4.6's and GLM-4.7's format (their chat templates): the function's
name, then each argument as a key and a value between tags (4.7 leaves out the
newlines), values typed by the tool's schema.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Oslo</arg_value>
    </tool_call>"""

import re

from flagstop.router.openai.tool_parsers.arguments import Parameters
from flagstop.router.openai.tool_parsers.base import Found, Tagged

PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
NAME = re.compile(r"\s*([^<\s]+)")


class Glm45(Tagged):
    def function(self, body: str) -> Found | None:
        name = NAME.match(body)
        if name is None:
            return None
        params, at = Parameters(self.schemas, name[1]), name.end()
        while pair := PAIR.match(body, at):
            params.add(pair[1].strip(), pair[2])
            at = pair.end()
        return Found(name[1], params.text()) if not body[at:].strip() else None
