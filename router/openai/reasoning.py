"""Reasoning output: a thinking model writes its reasoning before its answer, between
tags (`<think>` ... `</think>`: DeepSeek-R1, Qwen3, GLM-4.5, Kimi K2, DeepSeek-V3.1
with thinking) or on a channel of its own (gpt-oss: router/openai/harmony.py). The
router's --reasoning-parser (vLLM's names) splits each choice's text into reasoning
and content, streamed as it comes; the tool-call parser and the structured-output
constraint see the content only.

A parser takes the text as it arrives and gives back (reasoning, content) of what can
be told apart so far: a possible start of a tag at a chunk's end is held back, so the
split is the same wherever a stream's chunks fall."""

from dataclasses import dataclass
from typing import Protocol


class ReasoningParser(Protocol):
    in_reasoning: bool  # the text so far ends inside the reasoning

    def feed(self, text: str, final: bool) -> tuple[str, str]: ...


class NoReasoning:
    """No --reasoning-parser, or include_reasoning false with nothing to split: all
    content."""

    in_reasoning = False

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        return "", text


@dataclass(frozen=True, slots=True)
class ThinkFormat:
    """A family's reasoning tags. always_opened: the model's output starts inside its
    reasoning whatever the prompt says (DeepSeek-R1's templates open <think> in the
    prompt, and its older ones leave it out although the model still reasons first);
    otherwise the output starts inside when the prompt leaves a <think> open, or when
    the output itself opens one. ended_by: where the family's calls begin, which end
    its reasoning when the model calls without closing it first (Qwen3.5 and Kimi-K2
    do: the marker stays, for the tool-call parser)."""

    start: str = "<think>"
    end: str = "</think>"
    always_opened: bool = False
    ended_by: tuple[str, ...] = ()

    def opened_by(self, prompt_text: str) -> bool:
        """Whether the rendered prompt leaves the reasoning open (its template wrote
        the start tag for the model)."""
        if self.always_opened:
            return True
        start = prompt_text.rfind(self.start)
        return start >= 0 and prompt_text.find(self.end, start) < 0

    def closed_by(self, prompt_text: str) -> bool:
        """Whether the prompt closed a reasoning block at its end (Qwen3's template with
        enable_thinking false writes an empty one): the output is all answer."""
        end = prompt_text.rfind(self.end)
        return end >= 0 and not prompt_text[end + len(self.end) :].strip()


# vLLM's --reasoning-parser names; openai_gptoss is harmony's (a channel, not tags).
FORMATS = {
    "deepseek_r1": ThinkFormat(always_opened=True),
    "deepseek_v3": ThinkFormat(),
    "qwen3": ThinkFormat(ended_by=("<tool_call>",)),
    "glm45": ThinkFormat(),
    "kimi_k2": ThinkFormat(ended_by=("<|tool_calls_section_begin|>",)),
}
HARMONY = "openai_gptoss"
NAMES = (*FORMATS, HARMONY)


class ThinkParser:
    """Reasoning between a family's tags. Before any text: inside when the prompt
    opened the reasoning; a start tag at the output's start (after whitespace) opens
    it too, and is dropped where the prompt opened it already (DeepSeek-R1 writes it
    either way). The end tag closes it; the answer's leading whitespace is dropped. A
    call begun inside the reasoning (one of the family's markers) is held: a draft,
    and reasoning, if the end tag follows; the answer, ending the reasoning, if the
    output ends first. An output that never closes its reasoning otherwise is all
    reasoning."""

    def __init__(self, fmt: ThinkFormat, opened: bool) -> None:
        self.fmt = fmt
        self.markers = (fmt.end, *fmt.ended_by)
        # Every tag begins "<": a chunk without one has none, nor the start of one (the
        # common case, once a chunk: bench/output_bench.py).
        leads = {m[0] for m in self.markers}
        self.lead = leads.pop() if len(leads) == 1 else None
        self.in_reasoning = opened
        self.undecided = True  # at the output's start: a start tag may come
        self.ended = False
        self.buffer = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self.buffer += text
        reasoning = content = ""
        if self.undecided and not self._decide(final):
            return "", ""
        if self.in_reasoning:
            reasoning = self._reasoning(final)
        if not self.in_reasoning:
            content, self.buffer = self.buffer, ""
            if self.ended:
                content = content.lstrip()
                self.ended = not content
        return reasoning, content

    def _decide(self, final: bool) -> bool:
        """Whether the output opens with a start tag (True once known)."""
        head = self.buffer.lstrip()
        start = self.fmt.start
        if head.startswith(start):
            self.buffer, self.in_reasoning = head[len(start) :], True
        elif start.startswith(head) and not final:
            return False  # the tag may still be coming
        self.undecided = False
        return True

    def _reasoning(self, final: bool) -> str:
        buffer = self.buffer
        if self.lead is not None and self.lead not in buffer:
            self.buffer = ""
            return buffer
        end = buffer.find(self.fmt.end)
        if end >= 0:  # calls written before it were drafts: reasoning
            self.buffer, self.in_reasoning, self.ended = (
                buffer[end + len(self.fmt.end) :],
                False,
                True,
            )
            return buffer[:end]
        calls = [at for m in self.fmt.ended_by if (at := buffer.find(m)) >= 0]
        if calls:  # held from the call: a draft if the end tag comes, the answer if not
            at = min(calls)
            self.buffer, self.in_reasoning, self.ended = buffer[at:], not final, final
            return buffer[:at]
        keep = 0 if final else max(partial_suffix(buffer, m) for m in self.markers)
        self.buffer = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag (held back: the tag may
    be completing). Only where the tag's first character is in text's last len(tag) - 1
    can one begin: a search in C, once a chunk on every stream (bench/output_bench.py)."""
    at = text.find(tag[0], max(len(text) - len(tag) + 1, 0))
    while at >= 0:
        if tag.startswith(text[at:]):
            return len(text) - at
        at = text.find(tag[0], at + 1)
    return 0
