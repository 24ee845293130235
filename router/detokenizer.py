"""Incremental detokenization for streaming: text deltas that never split a
multi-byte character, and stop strings matched across token boundaries.

A byte-level tokenizer's text is the UTF-8 decode of its tokens' bytes, so it
streams through Python's incremental UTF-8 decoder (ByteLevelDetokenizer: a dict
lookup per token, ~0.2 CPU µs). Other fast tokenizers stream through `tokenizers`'
own DecodeStream (Rust: it keeps the offsets and holds back incomplete UTF-8 itself;
~2-3 µs a token); slow (pure-Python) tokenizers fall back to the windowed decode of
IncrementalDetokenizer (~18 µs). bench/detokenizer_bench.py measures all three."""

import codecs
import functools
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream
from transformers.convert_slow_tokenizer import bytes_to_unicode

# Context tokens decoded before the new ones, so that merges and leading spaces come
# out as in a full decode.
CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"  # what a decode makes of bytes that are no (complete) character


def new_detokenizer(tokenizer, prompt_token_ids: list[int]):
    """The fastest detokenizer the tokenizer allows; all have add(ids, final)."""
    if (texts := byte_level_texts(tokenizer)) is not None:
        return ByteLevelDetokenizer(texts, prompt_token_ids)
    if getattr(tokenizer, "is_fast", False):
        return StreamDetokenizer(tokenizer, prompt_token_ids)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids)


class OwnTexts(dict):
    """Each token's text where it decodes alone to whole characters (most do: then it
    adds exactly that text after any run of whole tokens), None where it holds part
    of one (U+FFFD alone). A special token's is empty: it is skipped."""

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.backend = tokenizer.backend_tokenizer

    def __missing__(self, token_id: int) -> str | None:
        text = self.backend.decode([token_id], skip_special_tokens=True)
        own = None if REPLACEMENT in text else text
        self[token_id] = own
        return own


class TokenBytes(dict):
    """Each token's bytes: its own text's, else its vocabulary string read back
    through the byte-level alphabet (GPT-2's bytes_to_unicode)."""

    def __init__(self, tokenizer, own: OwnTexts) -> None:
        super().__init__()
        self.backend, self.own = tokenizer.backend_tokenizer, own
        self.byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

    def __missing__(self, token_id: int) -> bytes:
        if (text := self.own[token_id]) is not None:
            raw = text.encode()
        else:  # a character outside the alphabet stands for itself
            token, byte_of = self.backend.id_to_token(token_id) or "", self.byte_of
            raw = b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode() for c in token)
        self[token_id] = raw
        return raw


@dataclass(frozen=True, slots=True)
class ByteLevelTexts:
    own: OwnTexts
    raw: TokenBytes


@functools.cache
def byte_level_texts(tokenizer) -> ByteLevelTexts | None:
    """A tokenizer's tables, where its decoder is byte-level alone, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return None
    own = OwnTexts(tokenizer)
    return ByteLevelTexts(own, TokenBytes(tokenizer, own))


class ByteLevelDetokenizer:
    """A byte-level tokenizer's stream. While nothing is held, a token of whole
    characters adds its own text (the common call: one dict lookup). Otherwise its
    bytes go through an incremental UTF-8 decoder, which keeps a character's first
    bytes until the tokens that complete it, and text ending in U+FFFD (bytes that
    can no longer be a character) waits for the next token, as DecodeStream's does:
    each call returns what DecodeStream would, at ~a tenth of its CPU."""

    __slots__ = ("held", "open", "own", "raw", "utf8")

    def __init__(self, texts: ByteLevelTexts, prompt_token_ids: list[int]) -> None:
        self.own, self.raw = texts.own, texts.raw
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.held = ""  # text decoded, not yet returned: it ends in U+FFFD
        # A prompt that ends inside a character: its bytes wait for the rest.
        self.utf8.decode(b"".join(self.raw[t] for t in prompt_token_ids[-CONTEXT_TOKENS:]))
        self.open = bool(self.utf8.getstate()[0])  # bytes or text held

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """The text the new tokens complete; at the end (final) an incomplete UTF-8
        character comes out as U+FFFD rather than being lost."""
        if not self.open:
            if len(token_ids) == 1 and (text := self.own[token_ids[0]]) is not None:
                return text
            texts = [self.own[t] for t in token_ids]
            if None not in texts:
                return "".join(texts)
        return self._decode(token_ids, final)

    def _decode(self, token_ids: list[int], final: bool) -> str:
        pieces, held, decode, raw = [], self.held, self.utf8.decode, self.raw
        for token_id in token_ids:
            held += decode(raw[token_id])
            if held and not held.endswith(REPLACEMENT):
                pieces.append(held)
                held = ""
        if final:
            pieces.append(held + decode(b"", True))
            held = ""
        self.held = held
        self.open = bool(held) or bool(self.utf8.getstate()[0])
        return "".join(pieces)


class StreamDetokenizer:
    """A fast tokenizer's DecodeStream, primed with the end of the prompt."""

    __slots__ = ("backend", "held", "stream", "tokenizer")

    def __init__(self, tokenizer, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.stream = DecodeStream(ids=list(prompt_token_ids[-CONTEXT_TOKENS:]),
                                   skip_special_tokens=True)  # fmt: skip
        self.held: list[int] = []  # tokens of an incomplete character, not yet text

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """The text the new tokens complete; at the end (final) an incomplete UTF-8
        character comes out as U+FFFD rather than being lost."""
        pieces = []
        for token_id in token_ids:
            text = self.stream.step(self.backend, token_id)
            if text is None:
                self.held.append(token_id)
            else:
                self.held.clear()
                pieces.append(text)
        if final and self.held:
            pieces.append(self.tokenizer.decode(self.held, skip_special_tokens=True))
            self.held = []
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
