"""A chat choice's output read as the API shows it: reasoning, content and tool calls.
The reasoning parser sees the text first; the tool-call parser sees the answer after
the reasoning. gpt-oss's harmony output is read from its token ids by the format's own
parser instead (router/openai/harmony.py). Each choice gets its own ChatOutput, fed
each chunk as it arrives."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from flagstop.router.media.processor import Processed
from flagstop.router.openai.reasoning import (
    FORMATS,
    NoReasoning,
    ReasoningParser,
    ThinkFormat,
    ThinkParser,
)
from flagstop.router.openai.tools import ToolParser
from flagstop.server import StartupError


class Parsed(NamedTuple):
    """What one chunk adds: reasoning, content and tool-call deltas (the stream's). A
    tuple: made once a chunk on every stream, where a dataclass cost 0.1-0.2 us more
    (bench/output_bench.py)."""

    reasoning: str
    content: str
    calls: Sequence[dict[str, Any]]


class ChatOutput(Protocol):
    calls: list[dict[str, Any]]  # the complete calls so far
    in_reasoning: bool

    def feed(self, token_ids, text: str, finish: str | None) -> Parsed:
        """finish: the output's finish reason once it ended (its last chunk), None
        before."""


class PlainContent:
    """No tool calls to read: the answer is content."""

    calls: tuple = ()

    def feed(self, text: str, finish: str | None) -> tuple[str, list[dict[str, Any]]]:
        return text, []


class PlainOutput:
    """No reasoning parser, no tool calls to read: the text is the content (the
    default path: one call a chunk, not two parsers')."""

    __slots__ = ()
    calls: tuple = ()
    in_reasoning = False

    def feed(self, token_ids, text: str, finish: str | None) -> Parsed:
        return "", text, ()  # a plain tuple: Parsed's fields, without its __new__


class TextOutput:
    """Reasoning split off by tags, then the answer's tool calls by the family's
    parser, both on the text."""

    __slots__ = ("reasoning", "show_reasoning", "tools")

    def __init__(self, reasoning: ReasoningParser, tools: ToolParser, show_reasoning: bool):
        self.reasoning, self.tools, self.show_reasoning = reasoning, tools, show_reasoning

    @property
    def calls(self) -> list[dict[str, Any]]:
        return self.tools.calls

    @property
    def in_reasoning(self) -> bool:
        return self.reasoning.in_reasoning

    def feed(self, token_ids, text: str, finish: str | None) -> Parsed:
        reasoning, answer = self.reasoning.feed(text, finish is not None)
        content, calls = self.tools.feed(answer, finish)
        return Parsed(reasoning if self.show_reasoning else "", content, calls)


@dataclass(slots=True)
class Rendered:
    """A chat prompt: its text (what the reasoning parser reads the template's tags
    from) and token ids."""

    text: str
    token_ids: list[int]
    # Its images processed (router/media/): the token ids are then the processor's,
    # each image's placeholders expanded; None: text only.
    media: Processed | None = None


class ReasoningSetup:
    """--reasoning-parser, set up once against the model's tokenizer: the format, and
    the token its reasoning ends with (what an output constraint waits for)."""

    def __init__(self, name: str | None, tokenizer) -> None:
        self.name = name
        self.format: ThinkFormat | None = FORMATS.get(name) if name else None
        self.end_token_ids: list[int] = []
        self.start_token_ids: list[int] = []
        if self.format is not None:
            end = self.format.end
            self.start_token_ids = tokenizer(self.format.start, add_special_tokens=False).input_ids
            self.end_token_ids = tokenizer(end, add_special_tokens=False).input_ids
            if len(self.end_token_ids) != 1:
                raise StartupError(
                    f"--reasoning-parser {name}: the model's tokenizer has no single token "
                    f"for {end!r} (it takes {len(self.end_token_ids)}); this model does not "
                    "write that format: leave --reasoning-parser unset"
                )

    def parser(self, prompt: Rendered) -> Callable[[], ReasoningParser]:
        fmt = self.format
        if fmt is None:
            return NoReasoning
        opened = fmt.opened_by(prompt.text) and not fmt.closed_by(prompt.text)
        return lambda: ThinkParser(fmt, opened)

    def opening(self, prompt: Rendered) -> list[int]:
        """The tokens the model opens its reasoning with, where the prompt did not open
        it (a thinking budget counts from them); none where it did."""
        fmt = self.format
        if fmt is None or fmt.opened_by(prompt.text):
            return []
        return self.start_token_ids

    def constraint_waits(self, prompt: Rendered, in_reasoning: bool) -> list[int]:
        """The tokens an output constraint starts after: the reasoning's end, unless the
        prompt ended the reasoning already (a thinking switch turned off) or
        --structured-outputs-in-reasoning."""
        fmt = self.format
        if fmt is None or in_reasoning or fmt.closed_by(prompt.text):
            return []
        return self.end_token_ids


def text_outputs(
    reasoning: Callable[[], ReasoningParser], tools: Callable[[], ToolParser | None],
    show_reasoning: bool,
) -> Callable[[], ChatOutput]:  # fmt: skip
    """What makes each choice's ChatOutput."""

    def make() -> ChatOutput:
        parser, calls = reasoning(), tools()
        if calls is None and isinstance(parser, NoReasoning):
            return PlainOutput()
        return TextOutput(parser, calls or PlainContent(), show_reasoning)

    return make
