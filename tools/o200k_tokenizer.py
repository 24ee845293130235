"""gpt-oss' tokenizer (o200k_harmony) as a Hugging Face tokenizer.json, built from the
o200k_base ranks (tools/harmony_vocab.py) and openai-harmony's special tokens, as
gpt-oss ships it: byte-level BPE over the o200k split pattern, whole pieces found in
the vocabulary taken as they are (tiktoken's rule), the merges read off the ranks (a
token's splits into two tokens, by rank), specials 199998-201087 at harmony's ids.
`make model ARCH=gpt_oss HARMONY=1` writes it into the gpt-oss-shaped checkpoint, so
that harmony's token ids are the model's."""

import base64
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# o200k's pre-tokenizer pattern (tiktoken's, which harmony's is too).
PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])  # fmt: skip
NUM_TOKENS = 201088  # o200k_harmony: the ranks, then specials and reserved ids


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


def read_ranks(vocab_dir: Path) -> dict[bytes, int]:
    ranks = {}
    for line in (vocab_dir / "o200k_base.tiktoken").read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def merges_of(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Each token's splits into two tokens, ordered by the token's rank, then by its
    parts' ranks (what the BPE applies first)."""
    found = []
    for token, rank in ranks.items():
        cuts = [i for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        splits = [(ranks[token[:i]], ranks[token[i:]], token[:i], token[i:]) for i in cuts]
        found += [(rank, *split) for split in sorted(splits)]
    found.sort(key=lambda merge: merge[0])
    return [(left, right) for _, _, _, left, right in found]


def o200k_harmony(vocab_dir: Path, specials: dict[int, str]) -> Tokenizer:
    """specials: harmony's special tokens by id (every id from the ranks' end up)."""
    ranks = read_ranks(vocab_dir)
    alphabet = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(left), text(right)) for left, right in merges_of(ranks)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    if sorted(specials) != list(range(len(ranks), NUM_TOKENS)):
        raise ValueError("harmony's specials do not follow the ranks without a gap")
    tokenizer.add_special_tokens([AddedToken(specials[i], special=True, normalized=False)
                                  for i in sorted(specials)])  # fmt: skip
    return tokenizer
