"""The router's tokenizer: what AutoTokenizer loads, without importing torch where the
checkpoint allows. AutoTokenizer reads the model's configuration, and transformers'
configuration code imports torch: 5-6 s of every router's start-up (and 300 MB) for a
process that never runs a model. A checkpoint whose tokenizer_config names the
generic fast class is loaded by that class directly, which is what AutoTokenizer
would pick; any other goes through AutoTokenizer."""

import json
from pathlib import Path

GENERIC_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def load_tokenizer(model: str):
    """The tokenizer of a model directory (OSError/ValueError as transformers raises)."""
    if _tokenizer_class(Path(model)) in GENERIC_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _tokenizer_class(model_dir: Path) -> str | None:
    try:
        return json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
