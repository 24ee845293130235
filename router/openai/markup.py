"""The reading machinery of the tool-call parsers (router/openai/tool_parsers.py): a
family's format is written as a generator that asks for what comes next, and Reader
feeds it the text as it arrives, the same way whatever the chunks. A generator asks:

    text, marker = yield Until(markers, sink)   # the text up to the first of markers
                                                # (with a sink: what the sink did not get)
    value = yield Json(sink)                    # one JSON value (an object, an array...)
    found = yield Starts(prefixes)              # whether one of prefixes comes next

Until gives (text, None) when the output ends first. A sink gets the text as it comes
(Until holds back what may be the start of a marker, and for args=True whitespace
at either end); Json's sink gets each piece of the value. Both hold the text back
until it cannot change: the calls streamed equal the calls read whole."""

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from flagstop.router.openai.reasoning import partial_suffix

Sink = Callable[[str], None] | None


@dataclass(slots=True)
class Until:
    markers: tuple[str, ...]
    sink: Sink = None
    trim: bool = False  # the sink skips leading whitespace and holds trailing whitespace
    sent: int = 0  # characters of the buffer given to the sink
    started: bool = False

    def find(self, buffer: str) -> tuple[int, str] | None:
        found = [(at, m) for m in self.markers if (at := buffer.find(m)) >= 0]
        return min(found) if found else None

    def stream(self, buffer: str, upto: int) -> None:
        """Give the sink the buffer's text before upto that it has not had."""
        if self.sink is None:
            return
        text = buffer[self.sent : upto]
        if self.trim:
            if not self.started:
                stripped = text.lstrip()
                self.sent += len(text) - len(stripped)
                text, self.started = stripped, bool(stripped)
            text = text.rstrip()
        if text:
            self.sink(text)
            self.sent += len(text)

    def hold(self, buffer: str) -> int:
        """Where the text that may still change begins."""
        return len(buffer) - max((partial_suffix(buffer, m) for m in self.markers), default=0)


@dataclass(slots=True)
class Starts:
    """Whether the text, after whitespace, starts with one of prefixes (the whitespace
    is consumed; nothing else)."""

    prefixes: tuple[str, ...]


@dataclass(slots=True)
class Json:
    """One JSON value at the buffer's start (after whitespace): its text."""

    sink: Sink = None
    scanner: "JsonScanner" = field(default_factory=lambda: JsonScanner())


class JsonScanner:
    """Where a JSON value ends, character by character: nesting and strings tracked."""

    __slots__ = ("begin", "depth", "done", "escaped", "in_string", "kind", "length")

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False
        self.kind = ""  # the value's first character: { [ " or a primitive's
        self.begin = 0  # where it is, after the whitespace before it
        self.length, self.done = 0, False  # characters scanned; whether it ended

    def scan(self, text: str) -> int:
        """Consume text; returns how much of it belongs to the value (all of it while
        the value goes on)."""
        for i, c in enumerate(text):
            if not self.kind:
                if c.isspace():
                    self.length += 1
                    continue
                self.kind, self.begin = c, self.length
            if self._step(c):
                self.done = True
                return i + 1 if self.kind in '{["' else i
            self.length += 1
        return len(text)

    def _step(self, c: str) -> bool:
        """Whether c ends the value (a primitive ends before its c)."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                return self.depth == 0
            return False
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            return self.depth == 0
        elif self.kind not in '{["' and (c in ",}];" or c.isspace()):
            return True
        return False


Format = Generator[Any, Any, None]


class Reader:
    """Drives a format's generator over text that arrives in pieces."""

    def __init__(self, reading: Format) -> None:
        self.reading, self.buffer, self.ended = reading, "", False
        self.asked = next(reading)

    def feed(self, text: str, final: bool) -> None:
        self.buffer += text
        while not self.ended and self._advance(final):
            pass

    def _advance(self, final: bool) -> bool:
        asked = self.asked
        if isinstance(asked, Json):
            return self._json(asked, final)
        if isinstance(asked, Starts):
            return self._starts(asked, final)
        buffer = self.buffer
        found = asked.find(buffer)
        if found is None and not final:
            asked.stream(buffer, asked.hold(buffer))
            # What the sink has had leaves the buffer: a long text with no marker is
            # searched once, not once a chunk.
            self.buffer, asked.sent = buffer[asked.sent :], 0
            return False
        at, marker = found if found else (len(buffer), None)
        asked.stream(buffer, at)  # with trim, the whitespace held back is dropped
        self.buffer = buffer[at + len(marker or "") :]
        return self._answer((buffer[:at], marker))

    def _json(self, asked: Json, final: bool) -> bool:
        scanner, buffer = asked.scanner, self.buffer
        start = scanner.length
        used = scanner.scan(buffer[start:]) + start
        if asked.sink and scanner.kind and (piece := buffer[max(start, scanner.begin) : used]):
            asked.sink(piece)
        if not scanner.done and not final:
            return False
        self.buffer = buffer[used:]
        return self._answer(buffer[:used].strip() if scanner.done else None)

    def _starts(self, asked: Starts, final: bool) -> bool:
        head = self.buffer.lstrip()
        if any(head.startswith(p) for p in asked.prefixes):
            self.buffer = head
            return self._answer(True)
        if not final and any(p.startswith(head) for p in asked.prefixes):
            return False  # it may yet
        return self._answer(False)

    def _answer(self, answer) -> bool:
        try:
            self.asked = self.reading.send(answer)
        except StopIteration:
            self.ended = True
            return False
        return True
