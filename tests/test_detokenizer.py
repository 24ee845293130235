import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from flagstop.router.detokenizer import (
    ByteLevelDetokenizer,
    IncrementalDetokenizer,
    StopStringMatcher,
    StreamDetokenizer,
    new_detokenizer,
)
from tools.make_model import write_model

# The byte-level one (new_detokenizer's pick for the embedded model), DecodeStream's
# for other fast tokenizers, the windowed one for slow tokenizers: the same guarantees
# hold for all three.
DETOKENIZERS = [new_detokenizer, StreamDetokenizer, IncrementalDetokenizer]
IDS = ["byte_level", "decode_stream", "windowed"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(write_model(tmp_path_factory.mktemp("tok"), "tiny"))


@pytest.mark.parametrize("Detokenizer", DETOKENIZERS, ids=IDS)
def test_deltas_never_split_a_multibyte_character(tokenizer, Detokenizer):
    text = " héllo wörld ✓ 日本語 and 🙂 done"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    # A byte-level vocabulary of 512 splits the CJK and emoji characters across tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detokenizer = Detokenizer(tokenizer, tokenizer("Hi").input_ids)
    deltas = [detokenizer.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


@pytest.mark.parametrize("Detokenizer", DETOKENIZERS, ids=IDS)
def test_invalid_bytes_are_flushed_at_the_end(tokenizer, Detokenizer):
    ids = tokenizer("日", add_special_tokens=False).input_ids
    detokenizer = Detokenizer(tokenizer, [0])
    assert detokenizer.add(ids[:-1]) == ""  # an incomplete character waits
    assert detokenizer.add([], final=True) == "\ufffd"


def test_a_byte_level_tokenizer_streams_through_its_bytes(tokenizer):
    assert tokenizer.is_fast
    assert isinstance(new_detokenizer(tokenizer, [0]), ByteLevelDetokenizer)


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.text(min_size=1, max_size=12),
    generated=st.lists(st.integers(0, 511), min_size=1, max_size=40),
    chunk=st.integers(1, 4),
)
def test_both_stream_what_a_full_decode_gives(tokenizer, prompt, generated, chunk):
    """Any generated ids (special tokens, stray continuation bytes), in chunks of any
    size: the deltas of both add up to what a full decode adds to the prompt's text."""
    prompt_ids = tokenizer(prompt).input_ids
    head = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full = tokenizer.decode(prompt_ids + generated, skip_special_tokens=True)
    for Detokenizer in DETOKENIZERS:
        detokenizer, deltas = Detokenizer(tokenizer, prompt_ids), []
        for start in range(0, len(generated), chunk):
            final = start + chunk >= len(generated)
            deltas.append(detokenizer.add(generated[start : start + chunk], final=final))
        assert head + "".join(deltas) == full, Detokenizer


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 511), min_size=1, max_size=8),
    # (True, i): the i-th token of English text (whole characters); (False, i): id i.
    drawn=st.lists(st.tuples(st.booleans(), st.integers(0, 511)), min_size=1, max_size=60),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=8),
)
def test_byte_level_gives_each_delta_decode_stream_gives(tokenizer, prompt, drawn, chunks):
    """Tokens of whole characters between any others (partial characters, stray
    bytes, special tokens), in calls of any size: every call returns what
    DecodeStream returns, the last (final) included. (A prompt whose last tokens
    decode to U+FFFD is the next test's: DecodeStream repeats them.)"""
    assume(not tokenizer.decode(prompt[-5:], skip_special_tokens=True).endswith("\ufffd"))
    english = tokenizer(" the quick brown fox jumps over the lazy dog").input_ids
    generated = [english[i % len(english)] if whole else i for whole, i in drawn]
    ours, stream = new_detokenizer(tokenizer, prompt), StreamDetokenizer(tokenizer, prompt)
    start, sizes = 0, (chunks * len(generated))[: len(generated)]
    for size in sizes:
        ids, start = generated[start : start + size], start + size
        final = start >= len(generated)
        assert ours.add(ids, final=final) == stream.add(ids, final=final), ids
        if final:
            break


def test_a_prompt_that_ends_inside_a_character_is_completed_not_repeated(tokenizer):
    """The generated tokens that complete the prompt's last character give that
    character; DecodeStream, primed with text ending in U+FFFD, gives the prompt's
    last tokens' text again before it."""
    prompt = tokenizer("ab", add_special_tokens=False).input_ids
    char = tokenizer("日", add_special_tokens=False).input_ids
    assert len(char) == 3
    ours = new_detokenizer(tokenizer, prompt + char[:1])
    assert [ours.add([t]) for t in char[1:]] == ["", "日"]
    stream = StreamDetokenizer(tokenizer, prompt + char[:1])
    assert [stream.add([t]) for t in char[1:]] == ["", "ab日"]


@pytest.mark.parametrize(
    ("pieces", "stop", "expected"),
    [
        (["hello wo", "rld"], ["wor"], ("hello ", "wor")),
        (["abc", "d"], ["xyz"], ("abcd", None)),
        (["a", "b", "c"], ["bc", "c"], ("a", "bc")),
    ],
)
def test_stop_strings_across_pieces(pieces, stop, expected):
    matcher = StopStringMatcher(stop)
    emitted, matched = "", None
    for i, piece in enumerate(pieces):
        text, matched = matcher.feed(piece, final=i == len(pieces) - 1)
        emitted += text
        if matched:
            break
    assert (emitted, matched) == expected
