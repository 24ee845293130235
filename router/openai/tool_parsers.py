"""Tool calls read out of what a model writes, one parser per family's format
(--tool-call-parser, vLLM's names), streamed: a call's first delta names it as soon as
its name is read, then its arguments follow as they are written. Text outside the
calls is content (whitespace next to a call dropped). A call the output cut short has
been streamed as far as it went; the whole response lists complete calls only.

    hermes       <tool_call>{"name": N, "arguments": {...}}</tool_call>   (Hermes, Qwen2.5/3)
    qwen3_coder  <tool_call><function=N><parameter=P>V</parameter>...</function></tool_call>
    llama3_json  {"name": N, "parameters": {...}}; {...}   (the whole output; <|python_tag|>)
    mistral      [TOOL_CALLS][{"name": N, "arguments": {...}}]  or  [TOOL_CALLS]N[ARGS]{...}
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N
                 ```json {...} ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
                 (V3.1: N<｜tool▁sep｜>{...})
    kimi_k2      <|tool_calls_section_begin|><|tool_call_begin|>functions.N:0
                 <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>
    glm45        <tool_call>N<arg_key>P</arg_key><arg_value>V</arg_value>...</tool_call>

Each format is a generator over router/openai/markup.py's Reader."""

import contextlib
import json
import re
import uuid
from typing import Any

from flagstop.router.openai.markup import Format, Json, JsonScanner, Reader, Starts, Until


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class Call:
    __slots__ = ("arguments", "id", "index", "name")

    def __init__(self, index: int, name: str, call_id: str) -> None:
        self.index, self.name, self.id, self.arguments = index, name, call_id, ""

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


class CallParser:
    """Content until the family's calls begin, then its calls. feed(text, final) gives
    (content, tool-call deltas) of what the text added; calls: the complete calls."""

    def __init__(self, tools=None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.schemas = {t.function.name: t.function.parameters or {} for t in tools or ()}
        self.num_opened = 0
        self._content: list[str] = []
        self._deltas: list[dict[str, Any]] = []
        self.space, self.after_call = "", False
        self.reader = Reader(self.read())

    def read(self) -> Format:
        raise NotImplementedError

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.reader.feed(text, final)
        if final and self.space and not self.num_opened:
            self._content.append(self.space)
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    # -- what the formats call -----------------------------------------------------

    def say(self, text: str) -> None:
        """Content. Whitespace at its end is held (dropped when a call follows), and
        whitespace after a call is dropped."""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body) :]
        if body:
            self._content.append(body)

    def calls_begin(self) -> str:
        """The content's held whitespace is dropped: a call follows. Returns it, for
        a call that turns out not to be one."""
        held, self.space = self.space, ""
        return held

    def open(self, name: str, call_id: str | None = None) -> Call:
        call = Call(self.num_opened, name, call_id or new_call_id())
        self.num_opened += 1
        self._deltas.append({"index": call.index, **call.as_dict()})
        return call

    def add_arguments(self, call: Call, text: str) -> None:
        if text:
            call.arguments += text
            self._deltas.append({"index": call.index, "function": {"arguments": text}})

    def close(self, call: Call) -> None:
        self.calls.append(call.as_dict())
        self.after_call = True

    def rest_is_content(self) -> Format:
        yield Until((), self.say)

    def json_array(self) -> Format:
        """A JSON array of {"name", "arguments"} objects: each a call."""
        yield Until(("[",))
        while True:
            if (yield Starts(("]",))):
                yield Until(("]",))
                return
            if (yield Starts((",",))):
                yield Until((",",))
            elif not (yield Starts(("{",))):
                return
            call = JsonCall(self)
            value = yield Json(call.feed)
            call.finish(value)
            if value is None:
                return


class JsonCall:
    """A call written as a JSON object, {"name": N, "arguments": A} ("parameters" for
    Llama's): opened once its name and the start of its arguments are read, A streamed
    as written (A given as a JSON string is decoded at its end). Another key order
    is read whole at the end."""

    HEAD = re.compile(
        r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
    )

    def __init__(self, parser: CallParser) -> None:
        self.parser, self.text, self.call = parser, "", None
        self.value, self.value_text = JsonScanner(), ""

    def feed(self, piece: str) -> None:
        self.text += piece
        if self.call is None:
            head = self.HEAD.match(self.text)
            if head is None:
                return
            self.call = self.parser.open(json.loads(head.group(1)))
            piece = self.text[head.end() :]
        if self.value.done:
            return
        piece = piece[: self.value.scan(piece)]
        if not self.value_text:
            piece = piece.lstrip()
        self.value_text += piece
        if self.value.kind != '"':
            self.parser.add_arguments(self.call, piece)

    def finish(self, body: str | None) -> bool:
        """At the object's end (body: its text; None: the output ended first): whether
        it was a call."""
        parser, call = self.parser, self.call
        if call is None:
            found = _name_and_arguments(body) if body is not None else None
            if found is None:
                return False
            call = parser.open(found[0])
            parser.add_arguments(call, found[1])
        elif body is None or not self.value.done:
            return True  # cut short: streamed as far as it went
        elif self.value.kind == '"':
            parser.add_arguments(call, json.loads(self.value_text))
        parser.close(call)
        return True


def _name_and_arguments(body: str) -> tuple[str, str] | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return parsed["name"], arguments


class Hermes(CallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def read(self) -> Format:
        while True:
            _, found = yield Until((self.OPEN,), self.say)
            if found is None:
                return
            held = self.calls_begin()
            call = JsonCall(self)
            _, end = yield Until((self.CLOSE,), call.feed)
            if not call.finish(call.text if end else None):
                self.space = held  # not a call: the text as written
                self.say(self.OPEN + call.text + (end or ""))
            if end is None:
                return


class Llama3Json(CallParser):
    """The whole output is calls when it starts with one (or <|python_tag|>), as
    vLLM reads Llama 3's JSON calls; otherwise it is content."""

    TAG = "<|python_tag|>"

    def read(self) -> Format:
        if not (yield Starts(("{", self.TAG))):
            yield from self.rest_is_content()
            return
        if (yield Starts((self.TAG,))):
            yield Until((self.TAG,))
        while (yield Starts(("{",))):
            call = JsonCall(self)
            value = yield Json(call.feed)
            if not call.finish(value) and value is not None:
                self.say(value)
            if value is None or not (yield Starts((";",))):
                break
            yield Until((";",))
        yield from self.rest_is_content()


class Mistral(CallParser):
    """[TOOL_CALLS] then a JSON array of calls (v3 tokenizers), or name[ARGS]arguments
    per call (v11+)."""

    START, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def read(self) -> Format:
        _, found = yield Until((self.START,), self.say)
        if found is None:
            return
        self.calls_begin()
        while True:
            if (yield Starts(("[",))):
                yield from self.json_array()
            else:
                name, found = yield Until((self.ARGS,))
                if found is None:
                    return
                call = self.open(name.strip())
                value = yield Json(lambda piece, call=call: self.add_arguments(call, piece))
                if value is None:
                    return
                self.close(call)
            if not (yield Starts((self.START,))):
                break
            yield Until((self.START,))
        yield from self.rest_is_content()


class MarkedArguments(CallParser):
    """Formats whose calls sit in a section between markers, each call's arguments
    (JSON text) between markers of their own."""

    SECTION_BEGIN = SECTION_END = CALL_BEGIN = ""

    def call(self) -> Format:
        raise NotImplementedError

    def read(self) -> Format:
        _, found = yield Until((self.SECTION_BEGIN,), self.say)
        if found is None:
            return
        self.calls_begin()
        while True:
            _, found = yield Until((self.CALL_BEGIN, self.SECTION_END))
            if found != self.CALL_BEGIN:
                break
            if not (yield from self.call()):
                return
        yield from self.rest_is_content()

    def arguments_until(self, call: Call, end: str) -> Format:
        _, found = yield Until((end,), lambda piece: self.add_arguments(call, piece), trim=True)
        if found is not None:
            self.close(call)
        return found is not None


class DeepSeekV3(MarkedArguments):
    SECTION_BEGIN, SECTION_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

    def call(self) -> Format:
        head, found = yield Until((self.SEP,))
        if found is None:
            return False
        if head.strip() != "function":  # V3.1: the name, then the arguments
            return (yield from self.arguments_until(self.open(head.strip()), self.CALL_END))
        name, found = yield Until(("```json",))  # V3: the name, then a json fence
        if found is None:
            return False
        if not (yield from self.arguments_until(self.open(name.strip()), "```")):
            return False
        _, found = yield Until((self.CALL_END,))
        return found is not None


class KimiK2(MarkedArguments):
    SECTION_BEGIN = "<|tool_calls_section_begin|>"
    SECTION_END = "<|tool_calls_section_end|>"
    CALL_BEGIN, ARGUMENTS, CALL_END = (
        "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    )  # fmt: skip

    def call(self) -> Format:
        # The model's own call id, functions.NAME:INDEX, is kept: its template renders
        # the results by it.
        call_id, found = yield Until((self.ARGUMENTS,))
        if found is None:
            return False
        call_id = call_id.strip()
        name = call_id.rsplit(":", 1)[0].removeprefix("functions.")
        return (yield from self.arguments_until(self.open(name, call_id), self.CALL_END))


class Parameters:
    """Arguments written as parameters (GLM's, Qwen3-Coder's): each becomes a key of
    the JSON object, its value typed by the tool's schema (a string parameter as
    written; others parsed as JSON when they parse), streamed a parameter at a time."""

    def __init__(self, parser: CallParser, call: Call) -> None:
        self.parser, self.call, self.count = parser, call, 0
        properties = parser.schemas.get(call.name, {}).get("properties") or {}
        self.types = {k: v.get("type") for k, v in properties.items() if isinstance(v, dict)}

    def add(self, key: str, raw: str) -> None:
        value: Any = raw
        if self.types.get(key) != "string":
            with contextlib.suppress(ValueError):  # not JSON: the text as written
                value = json.loads(raw)
        entry = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        self.parser.add_arguments(self.call, ("{" if self.count == 0 else ", ") + entry)
        self.count += 1

    def close(self) -> None:
        self.parser.add_arguments(self.call, "}" if self.count else "{}")
        self.parser.close(self.call)


class Glm45(CallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"

    def read(self) -> Format:
        while True:
            _, found = yield Until((self.OPEN,), self.say)
            if found is None:
                return
            self.calls_begin()
            name, found = yield Until(("\n", self.KEY, self.CLOSE))
            if found is None:
                return
            params = Parameters(self, self.open(name.strip()))
            if found == "\n":
                _, found = yield Until((self.KEY, self.CLOSE))
            while found == self.KEY:
                key, _ = yield Until((self.KEY_END,))
                yield Until((self.VALUE,))
                value, found = yield Until((self.VALUE_END,))
                if found is None:
                    return
                params.add(key.strip(), value)
                _, found = yield Until((self.KEY, self.CLOSE))
            if found is None:
                return
            params.close()


class Qwen3Coder(CallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END = (
        "<function=", "</function>", "<parameter=", "</parameter>"
    )  # fmt: skip

    def read(self) -> Format:
        while True:
            _, found = yield Until((self.OPEN,), self.say)
            if found is None:
                return
            self.calls_begin()
            _, found = yield Until((self.FUNCTION,))
            if found is None:
                return
            name, found = yield Until((">",))
            if found is None:
                return
            params = Parameters(self, self.open(name.strip()))
            _, found = yield Until((self.PARAMETER, self.FUNCTION_END))
            while found == self.PARAMETER:
                key, _ = yield Until((">",))
                value, found = yield Until((self.PARAMETER_END,))
                if found is None:
                    return
                params.add(key.strip(), _one_newline_off(value))
                _, found = yield Until((self.PARAMETER, self.FUNCTION_END))
            if found is None:
                return
            params.close()
            yield Until((self.CLOSE,))


def _one_newline_off(value: str) -> str:
    """Qwen3-Coder writes a parameter's value on lines of its own."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class RequiredCalls(CallParser):
    """tool_choice "required": the output is constrained to a JSON array of calls,
    each streamed as it is written. An array cut by max_tokens still gives its complete
    calls (finish_reason "length")."""

    def read(self) -> Format:
        yield from self.json_array()


PARSERS: dict[str, type[CallParser]] = {
    "hermes": Hermes, "qwen3_coder": Qwen3Coder, "llama3_json": Llama3Json,
    "mistral": Mistral, "deepseek_v3": DeepSeekV3, "kimi_k2": KimiK2, "glm45": Glm45,
}  # fmt: skip
