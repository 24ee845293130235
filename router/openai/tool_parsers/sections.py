"""Formats whose calls sit in a section between markers, each call between markers of
its own (DeepSeek's, Kimi-K2's): the section is the region, read call by call. A
call the output ended inside is read as the region rule says (base.py); text in the
section that is not a call is content, whitespace between calls their syntax."""

from flagstop.router.openai.tool_parsers.base import CallParser, Closed, Found, Read, Region


class Sections(CallParser):
    SECTION_BEGIN = SECTION_END = CALL_BEGIN = CALL_END = ""

    def call(self, body: str) -> Found | None:
        """A call's text between its markers, read."""
        raise NotImplementedError

    def open(self, marker: str) -> Region:
        return Closed(self.SECTION_END, marker)

    def read(self, text: str, closed: bool, cut: bool) -> Read:
        body = text[len(self.SECTION_BEGIN) : len(text) - len(self.SECTION_END) if closed else None]
        out: Read = []
        at = 0
        while (begin := body.find(self.CALL_BEGIN, at)) >= 0:
            if between := body[at:begin].strip():
                out.append(between)
            end = body.find(self.CALL_END, begin)
            closed = end >= 0
            stop = end + len(self.CALL_END) if closed else len(body)
            inside = body[begin + len(self.CALL_BEGIN) : end if closed else None]
            found = None if cut and not closed else self.call(inside)
            out.append(body[begin:stop] if found is None else found)
            at = stop
        if rest := body[at:].strip():
            out.append(rest)
        return out if any(isinstance(item, Found) for item in out) else [text]
