import pytest
from transformers import AutoTokenizer

from executor.make_model import write_model
from router.detokenizer import IncrementalDetokenizer, StopStringMatcher


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(write_model(tmp_path_factory.mktemp("tok"), "tiny"))


def test_deltas_never_split_a_multibyte_character(tokenizer):
    text = " héllo wörld ✓ 日本語 and 🙂 done"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    # A byte-level vocabulary of 512 splits the CJK and emoji characters across tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer("Hi").input_ids)
    deltas = [detokenizer.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_invalid_bytes_are_flushed_at_the_end(tokenizer):
    ids = tokenizer("日", add_special_tokens=False).input_ids
    detokenizer = IncrementalDetokenizer(tokenizer, [0])
    assert detokenizer.add(ids[:-1]) == ""  # an incomplete character waits
    assert detokenizer.add([], final=True) == "\ufffd"


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
