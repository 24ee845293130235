"""Server-Sent Events: each event a JSON object on one line, whoever splits the lines."""

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"

# Characters JSON leaves unescaped that str.splitlines() splits at: clients that read
# a stream with it (httpx's aiter_lines) would cut an event in two. SSE itself splits
# at CR and LF only, which JSON escapes.
_LINE_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def json_line(obj: Any) -> bytes:
    """obj as JSON on one line, whoever splits the lines."""
    data = orjson.dumps(obj)
    if not data.isascii():
        for raw, escaped in _LINE_BREAKS:
            if raw in data:
                data = data.replace(raw, escaped)
    return data


def sse(obj: Any) -> bytes:
    return b"data: " + json_line(obj) + b"\n\n"
