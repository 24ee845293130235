"""What every family's tool-call parser shares. Content streams as it comes until one
of the family's markers opens a call region; the region is held whole until it closes
(or the output ends), then read as calls. Because a region is read whole, a stream
split anywhere gives the calls and content the whole text gives: the streamed reply
equals the whole one by construction (tests/test_tool_parsers.py feeds every fixture
both ways). A call is streamed as one delta when its region closes.

The one rule for output that is not a clean call (docs/openai.md, "Tool calling"):
- what does not read as a call is content, as the model wrote it: never dropped;
- a region the output ended inside was cut by max_tokens (finish "length"): content;
  one the model stopped inside (EOS, a stop string) is read as it is: a call if its
  arguments parse, content otherwise;
- whitespace around a call stays the content's as written, except where it only sets
  calls apart (a reply of calls alone has no content)."""

import uuid
from typing import Any, NamedTuple, Protocol

from flagstop.router.openai.reasoning import partial_suffix


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class Call:
    __slots__ = ("arguments", "id", "index", "name")

    def __init__(self, index: int, name: str, call_id: str, arguments: str = "") -> None:
        self.index, self.name, self.id, self.arguments = index, name, call_id, arguments

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


class Found(NamedTuple):
    """A call read from a region: its name, its arguments (a JSON object's text) and
    the id the model gave it (None: one is made)."""

    name: str
    arguments: str
    id: str | None = None


Read = list[Found | str]  # a region's calls, and its text that is not one (content)


class Region(Protocol):
    def end(self, text: str) -> int | None:
        """Where the region ends in text (which starts at its marker): the index just
        after it; None while it may go on."""


class Closed:
    """A region that a closing marker ends (its first after the opening one)."""

    __slots__ = ("close", "searched")

    def __init__(self, close: str, opening: str) -> None:
        self.close, self.searched = close, len(opening)

    def end(self, text: str) -> int | None:
        at = text.find(self.close, self.searched)
        if at < 0:  # the next search starts where a close could still begin
            self.searched = max(self.searched, len(text) - len(self.close) + 1)
            return None
        return at + len(self.close)


class CallParser:
    """A family's parser: MARKERS open its regions, open() says where one ends,
    read() reads it. feed(text, finish) gives (content, call deltas) of what the text
    added; finish: the output's finish reason once it ended (None before). calls:
    the complete calls so far."""

    MARKERS: tuple[str, ...] = ()

    def __init__(self, tools=None) -> None:
        self.schemas = {t.function.name: t.function.parameters or {} for t in tools or ()}
        self.calls: list[dict[str, Any]] = []
        self.pending = ""  # text not given out yet: a region's, or a marker's start
        self.region: Region | None = None
        self.held = ""  # whitespace after the content, until more content follows
        self.closing = ""  # of it, what follows the content directly (no call since)
        self.said = False  # whether any content but whitespace was given
        self.called = False  # whether a call came after the last content
        self._content: list[str] = []
        self._deltas: list[dict[str, Any]] = []

    def open(self, marker: str) -> Region:
        raise NotImplementedError

    def read(self, text: str, closed: bool, cut: bool) -> Read:
        """A region's text (its markers included) as calls and content. closed: its
        end was found; cut: max_tokens ended the output inside it."""
        raise NotImplementedError

    def new_id(self) -> str:
        return new_call_id()

    def feed(self, text: str, finish: str | None) -> tuple[str, list[dict[str, Any]]]:
        self.pending += text
        while self._advance(finish):
            pass
        if finish:  # whitespace that only sets calls apart is not content
            self._content.append(self.closing if self.said else "" if self.calls else self.held)
            self.held = self.closing = ""
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    def _advance(self, finish: str | None) -> bool:
        """Gives out what can be told; whether a region was read (there may be more)."""
        if self.region is None and not self._find_region(finish):
            return False
        end = self.region.end(self.pending)
        if end is None and not finish:
            return False
        closed = end is not None
        end = len(self.pending) if end is None else end
        text, self.pending, self.region = self.pending[:end], self.pending[end:], None
        for item in self.read(text, closed, cut=not closed and finish == "length"):
            self._call(item) if isinstance(item, Found) else self.say(item)
        return True

    def _find_region(self, finish: str | None) -> bool:
        text = self.pending
        if not any(m[0] in text for m in self.MARKERS):  # no marker, nor one's start
            self.say(text)
            self.pending = ""
            return False
        found = [(at, m) for m in self.MARKERS if (at := text.find(m)) >= 0]
        if not found:
            keep = 0 if finish else max((partial_suffix(text, m) for m in self.MARKERS), default=0)
            self.say(text[: len(text) - keep])
            self.pending = text[len(text) - keep :]
            return False
        at, marker = min(found)
        self.say(text[:at])
        self.pending = text[at:]
        self.region = self.open(marker)
        return True

    def say(self, text: str) -> None:
        """Content; its trailing whitespace is held until more content follows (at the
        output's end, what followed the content directly is kept)."""
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body) :]
        if body:
            self._content.append(body)
            self.said, self.called = True, False
        if not self.called:
            self.closing = self.held

    def _call(self, found: Found) -> None:
        call = Call(len(self.calls), found.name, found.id or self.new_id(), found.arguments)
        self.calls.append(call.as_dict())
        self._deltas.append({"index": call.index, **call.as_dict()})
        self.called = True


class Tagged(CallParser):
    """Calls between an opening and a closing tag (<tool_call>...</tool_call>: Hermes',
    GLM's, Qwen3-Coder's), the text between read by found_in()."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    MARKERS = (OPEN,)

    def found_in(self, body: str) -> list[Found] | None:
        """The calls of a region's text between its tags (None: not calls); by default
        the one call function() reads."""
        found = self.function(body)
        return None if found is None else [found]

    def function(self, body: str) -> Found | None:
        raise NotImplementedError

    def open(self, marker: str) -> Region:
        return Closed(self.CLOSE, marker)

    def read(self, text: str, closed: bool, cut: bool) -> Read:
        body = text.removeprefix(self.OPEN)
        found = None if cut else self.found_in(body.removesuffix(self.CLOSE) if closed else body)
        return [text] if found is None else list(found)
