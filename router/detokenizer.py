"""Incremental detokenization for streaming: text deltas that never split a
multi-byte character, and stop strings matched across token boundaries.

Fast tokenizers stream through `tokenizers`' own DecodeStream (Rust: it keeps the
offsets and holds back incomplete UTF-8 itself; ~2 CPU µs per token against ~6.5 for
decoding windows from Python, bench/detokenizer_bench.py), byte-level ones through a
table of each token's own text for as long as every token has one; slow
(pure-Python) tokenizers fall back to the windowed decode of IncrementalDetokenizer."""

import functools
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

# Context tokens decoded before the new ones, so that merges and leading spaces come
# out as in a full decode.
CONTEXT_TOKENS = 5
# Tokens in a row, each ending a character, after which a DecodeStream hands back to
# the tokens' own texts.
WHOLE_TO_RETURN = 16


def new_detokenizer(tokenizer, prompt_token_ids: list[int]):
    """The fastest detokenizer the tokenizer allows; both have add(ids, final)."""
    if getattr(tokenizer, "is_fast", False):
        return StreamDetokenizer(tokenizer, prompt_token_ids, own_texts(tokenizer))
    return IncrementalDetokenizer(tokenizer, prompt_token_ids)


class OwnTexts(dict):
    """A byte-level tokenizer's tokens whose text is their own: a ByteLevel decoder
    turns tokens into bytes and the bytes into text, so a token that decodes alone to
    whole characters (most do) adds exactly that text after any run of such tokens.
    None for the others (part of a character, a stray byte). Filled as tokens come:
    a dict lookup per token, where DecodeStream's step costs ~2 µs (the router's
    costliest per-token call, bench/detokenizer_bench.py)."""

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.backend = tokenizer.backend_tokenizer

    def __missing__(self, token_id: int) -> str | None:
        text = self.backend.decode([token_id], skip_special_tokens=True)
        own = None if "\ufffd" in text else text  # U+FFFD: bytes of a partial character
        self[token_id] = own
        return own


@functools.cache
def own_texts(tokenizer) -> OwnTexts | None:
    """The tokenizer's OwnTexts where its decoder is byte-level alone, else None."""
    if type(tokenizer.backend_tokenizer.decoder).__name__ != "ByteLevel":
        return None
    return OwnTexts(tokenizer)


class StreamDetokenizer:
    """A fast tokenizer's DecodeStream, primed with the end of the prompt. With a
    byte-level tokenizer, between character boundaries where every token has a text of
    its own (see OwnTexts), those texts are the deltas, exactly what DecodeStream
    gives: a token without one starts a DecodeStream, primed with the tokens before
    it (a boundary, as a prompt's end is), until the character it began is complete."""

    __slots__ = ("backend", "held", "num_whole", "own", "recent", "stream", "tokenizer")

    def __init__(self, tokenizer, prompt_token_ids: list[int], own: OwnTexts | None = None):
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.recent = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.own = own
        self.stream: DecodeStream | None = None
        if own is None or any(own[t] is None for t in self.recent):
            self._start_stream()
        self.held: list[int] = []  # tokens of an incomplete character, not yet text

    def _start_stream(self) -> None:
        self.stream = DecodeStream(ids=self.recent[-CONTEXT_TOKENS:], skip_special_tokens=True)
        self.num_whole = 0  # tokens in a row since, each ending a character

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """The text the new tokens complete; at the end (final) an incomplete UTF-8
        character comes out as U+FFFD rather than being lost."""
        if self.stream is None:
            own = self.own
            if len(token_ids) == 1 and (text := own[token_ids[0]]) is not None:
                self._seen(token_ids)
                return text  # the common call: one step's token, whole characters
            texts = [own[t] for t in token_ids]
            if None not in texts:
                self._seen(token_ids)
                return "".join(texts)
            cut = texts.index(None)
            self._seen(token_ids[:cut])
            self._start_stream()
            return "".join(texts[:cut]) + self._step(token_ids[cut:], final)
        return self._step(token_ids, final)

    def _seen(self, token_ids: list[int]) -> None:
        recent = self.recent
        recent += token_ids
        if len(recent) > 8 * CONTEXT_TOKENS:
            del recent[:-CONTEXT_TOKENS]

    def _step(self, token_ids: list[int], final: bool) -> str:
        """Through DecodeStream; back to own texts after WHOLE_TO_RETURN tokens in a
        row that each ended a character (stray bytes would start a stream per token)."""
        pieces, own = [], self.own
        for token_id in token_ids:
            text = self.stream.step(self.backend, token_id)
            if text is None:
                self.held.append(token_id)
                self.num_whole = 0
            else:
                self.held.clear()
                pieces.append(text)
                self.num_whole += 1
        if final and self.held:
            pieces.append(self.tokenizer.decode(self.held, skip_special_tokens=True))
            self.held = []
        if own is not None:  # the tail that primes the next DecodeStream
            self._seen(token_ids)
            if not self.held and self.num_whole >= WHOLE_TO_RETURN:
                self.stream = None
        return "".join(pieces)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """The text the new tokens complete. A trailing partial UTF-8 character (decoded
        as U+FFFD) is held back until the tokens that complete it, unless final."""
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text[len(prefix) :]


@dataclass(slots=True)
class StopStringMatcher:
    """Holds back the last len(longest stop string) - 1 characters, which could be the
    start of a stop string, until more text shows they are not."""

    stop: list[str]
    pending: str = ""
    hold: int = field(init=False)

    def __post_init__(self) -> None:
        self.hold = max((len(s) for s in self.stop), default=1) - 1

    def feed(self, text: str, final: bool = False) -> tuple[str, str | None]:
        """Returns (text to emit, matched stop string or None). After a match the
        text stops just before it."""
        if not self.stop:
            return text, None
        self.pending += text
        first = min(((i, s) for s in self.stop if (i := self.pending.find(s)) >= 0), default=None)
        if first is not None:
            index, matched = first
            emit, self.pending = self.pending[:index], ""
            return emit, matched
        keep = 0 if final else min(self.hold, len(self.pending))
        emit, self.pending = (
            self.pending[: len(self.pending) - keep],
            self.pending[len(self.pending) - keep :],
        )
        return emit, None
