"""The o200k_base vocabulary that openai-harmony (gpt-oss' format) and the gpt-oss
tokenizer are built on, for machines that cannot reach where harmony downloads it
from (openaipublic.blob.core.windows.net).

harmony reads `o200k_base.tiktoken` from $TIKTOKEN_ENCODINGS_BASE and checks its
SHA-256. The same ranks ship in the npm package js-tiktoken (MIT), which this reads
from the npm registry (its tarball checked against the registry's sha512), writes in
tiktoken's format, and keeps only when the SHA-256 is harmony's own: the file is
byte for byte the one harmony would have downloaded.

    python -m tools.harmony_vocab        # prints the directory; export it as
                                         # TIKTOKEN_ENCODINGS_BASE (the router looks
                                         # there by itself)"""

import base64
import hashlib
import io
import json
import tarfile
import urllib.request
from pathlib import Path

from flagstop.router.openai.harmony_vocab import VOCAB_DIR, VOCAB_FILE, VOCAB_SHA256

PACKAGE = "https://registry.npmjs.org/js-tiktoken/-/js-tiktoken-1.0.21.tgz"
PACKAGE_SHA512 = (
    "biOj/6M5qdgx5TKjDnFT1ymSpM5tbd3ylwDtrQvFQSu0Z7bBYko2dF+W/aUkXUPuk6IVpRxk/3Q2sHOzGlS36g=="
)
RANKS = "package/dist/ranks/o200k_base.js"


def ensure_vocab(directory: Path = VOCAB_DIR) -> Path:
    """The directory holding o200k_base.tiktoken, written there first if missing."""
    path = directory / VOCAB_FILE
    if path.exists() and _sha256(path.read_bytes()) == VOCAB_SHA256:
        return directory
    text = tiktoken_text(_ranks(_download(PACKAGE)))
    if _sha256(text.encode()) != VOCAB_SHA256:
        raise RuntimeError(f"the ranks in {PACKAGE} are not harmony's o200k_base")
    directory.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    partial.replace(path)
    return directory


def _download(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=120) as reply:
        data = reply.read()
    digest = base64.b64encode(hashlib.sha512(data).digest()).decode()
    if digest != PACKAGE_SHA512:
        raise RuntimeError(f"{url}: its sha512 is not the registry's")
    return data


def _ranks(tarball: bytes) -> dict[int, str]:
    """js-tiktoken's ranks: lines of `! OFFSET TOKEN TOKEN ...` (base64 tokens, ranks
    from OFFSET up)."""
    with tarfile.open(fileobj=io.BytesIO(tarball)) as archive:
        source = archive.extractfile(RANKS).read().decode()  # type: ignore[union-attr]
    data = json.loads(source.removeprefix("export default ").rstrip().rstrip(";"))
    ranks = {}
    for line in data["bpe_ranks"].splitlines():
        if line:
            _, offset, *tokens = line.split(" ")
            ranks.update((int(offset) + i, token) for i, token in enumerate(tokens))
    return ranks


def tiktoken_text(ranks: dict[int, str]) -> str:
    return "".join(f"{ranks[rank]} {rank}\n" for rank in sorted(ranks))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


if __name__ == "__main__":
    print(ensure_vocab())
