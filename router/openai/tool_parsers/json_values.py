"""JSON values found in text as it arrives: where one ends (JsonScanner, character by
character, nesting and strings tracked), a region that is one value, and the values
one after another in a region's text."""


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


class JsonValue:
    """A region that is one JSON value after its marker (skip: the marker's length)."""

    __slots__ = ("scanned", "scanner")

    def __init__(self, skip: int) -> None:
        self.scanner, self.scanned = JsonScanner(), skip

    def end(self, text: str) -> int | None:
        used = self.scanner.scan(text[self.scanned :])
        self.scanned += used
        return self.scanned if self.scanner.done else None


def split_values(text: str, start: int = 0) -> list[tuple[int, int, bool]]:
    """The JSON objects and arrays in text from start, one after another: (begin, end,
    complete) of each; the last may be incomplete. What lies between is not looked at."""
    spans, at = [], start
    while (at := _next_value(text, at)) < len(text):
        scanner = JsonScanner()
        end = at + scanner.scan(text[at:])
        spans.append((at, end, scanner.done))
        if not scanner.done:
            break
        at = end
    return spans


def _next_value(text: str, at: int) -> int:
    while at < len(text) and text[at] not in "{[":
        at += 1
    return at
