"""Where openai-harmony finds the o200k_base vocabulary its gpt-oss encoding is built
on: $TIKTOKEN_ENCODINGS_BASE, else flagstop's cache (~/.cache/flagstop/tiktoken,
written by `python -m tools.harmony_vocab`), else harmony downloads it itself."""

import os
from pathlib import Path

VOCAB_FILE = "o200k_base.tiktoken"
# harmony checks the file against this (its src/tiktoken_ext/public_encodings.rs).
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
VOCAB_DIR = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flagstop" / "tiktoken"
)
BASE_VARIABLE = "TIKTOKEN_ENCODINGS_BASE"


def use_vocab(directory: Path | None = None) -> Path | None:
    """Point harmony at directory (or flagstop's cache, when it holds the file) unless
    $TIKTOKEN_ENCODINGS_BASE says where already. Returns the directory used."""
    if given := os.environ.get(BASE_VARIABLE):
        return Path(given)
    directory = directory or VOCAB_DIR
    if (directory / VOCAB_FILE).exists():
        os.environ[BASE_VARIABLE] = str(directory)
        return directory
    return None
