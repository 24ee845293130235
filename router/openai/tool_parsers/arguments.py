"""A call's arguments, read as the families write them: a JSON object (the JSON
formats), or parameters one by one as text (GLM's and Qwen3-Coder's), each value typed
only as the tool's schema says. Arguments are always given out as a JSON object's
text."""

import ast
import json
import re
from typing import Any

from flagstop.router.openai.tool_parsers.base import Found

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama's is "parameters"


def as_object_text(value: Any) -> str | None:
    """Arguments as JSON object text: an object, or a string holding one (some models
    encode them twice); None for anything else (a string, a list: not arguments)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def call_of(value: Any, arguments_required: bool = False) -> Found | None:
    """{"name": N, "arguments": A} (or "parameters") as a call: N a non-empty string,
    A an object (absent: {}, unless arguments_required)."""
    if not isinstance(value, dict) or not isinstance(name := value.get("name"), str) or not name:
        return None
    key = next((k for k in ARGUMENT_KEYS if k in value), None)
    if key is None:
        return None if arguments_required else Found(name, "{}")
    arguments = "{}" if value[key] is None else as_object_text(value[key])
    return None if arguments is None else Found(name, arguments)


# A call object whose closing brace never came: its name first, then its arguments.
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:')
REST = re.compile(r"\s*\}?\s*")


def json_call(text: str, arguments_required: bool = False) -> Found | None:
    """One call written as a JSON object; also one whose own closing brace is missing
    (the model stopped right after its arguments), where the arguments parse."""
    try:
        return call_of(json.loads(text), arguments_required)
    except ValueError:
        pass
    head = HEAD.match(text)
    if head is None:
        return None
    try:
        arguments, end = json.JSONDecoder().raw_decode(text, _skip_space(text, head.end()))
    except ValueError:
        return None
    if REST.fullmatch(text, end) is None:
        return None
    return call_of({"name": json.loads(head[1]), "arguments": arguments})


def json_calls(text: str, arguments_required: bool = False) -> list[Found] | None:
    """A call object, or a list of them (all calls, or None)."""
    try:
        value = json.loads(text)
    except ValueError:
        found = json_call(text, arguments_required)
        return None if found is None else [found]
    values = value if isinstance(value, list) else [value]
    calls = [call_of(v, arguments_required) for v in values]
    return None if not calls or None in calls else calls  # type: ignore[return-value]


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


class Parameters:
    """Arguments written as parameters, each a key of the JSON object with its value
    typed by the tool's schema (`typed`)."""

    def __init__(self, schemas: dict[str, dict[str, Any]], name: str) -> None:
        self.properties = schemas.get(name, {}).get("properties") or {}
        self.values: dict[str, Any] = {}

    def add(self, key: str, raw: str) -> None:
        self.values[key] = typed(raw, self.properties.get(key))

    def text(self) -> str:
        return json.dumps(self.values, ensure_ascii=False)


def typed(raw: str, schema: Any) -> Any:
    """A parameter's value as its schema types it: the first of its types (type, a
    list of them, or anyOf/oneOf's) that the text reads as; a string as written.
    Text that no type reads as stays a string, as does a value with no type in its
    schema (nothing is guessed: "42" is a number only where the schema says so)."""
    types = schema_types(schema)
    value = raw.strip()
    if value == "null" and "null" in types:
        return None
    for kind in types:
        if kind == "string":
            return raw
        converted = _CONVERT.get(kind, _no)(value)
        if converted is not _NO:
            return converted
    return raw


def schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    return [t for key in ("anyOf", "oneOf") for branch in schema.get(key) or ()
            for t in schema_types(branch)]  # fmt: skip


_NO = object()


def _no(value: str) -> Any:
    return _NO


def _json(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return _NO


def _integer(value: str) -> Any:
    parsed = _json(value)
    return parsed if type(parsed) is int else _NO


def _number(value: str) -> Any:
    parsed = _json(value)
    return parsed if type(parsed) in (int, float) else _NO


def _boolean(value: str) -> Any:
    return {"true": True, "false": False}.get(value.lower(), _NO)


def _container(kind: type):
    """An object or array: JSON, or the Python literal some models write instead."""

    def convert(value: str) -> Any:
        parsed = _json(value)
        if parsed is _NO:
            try:
                parsed = ast.literal_eval(value)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return _NO
        if not isinstance(parsed, kind):
            return _NO
        try:  # a Python literal may hold what JSON cannot (bytes, sets)
            json.dumps(parsed)
        except (TypeError, ValueError):
            return _NO
        return parsed

    return convert


_CONVERT = {"integer": _integer, "number": _number, "float": _number, "boolean": _boolean,
            "object": _container(dict), "array": _container(list)}  # fmt: skip
