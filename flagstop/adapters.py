"""What every process knows of a LoRA adapter without reading its weights: its
identity, and the names it may be served under. Pure Python (no torch): the router
and the executor simulator use it too."""

import hashlib
from dataclasses import dataclass
from pathlib import Path

# The files of a PEFT adapter that decide what it computes, in the order hashed.
FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    """An adapter an executor holds: where it was read from, its identity
    (adapter_digest), its largest rank and the modules it changes."""

    path: str
    id: str
    rank: int
    modules: tuple[str, ...]


def adapter_digest(path: str | Path) -> str:
    """The adapter's identity: the sha256 of its files as they are now (a missing one
    counts as empty). The prefix cache keys an adapter's blocks by it, so that a name
    loaded again from other files never hits what the old ones computed, while the
    same files under another name, on another replica or after a restart do."""
    digest = hashlib.sha256()
    for name in FILES:
        file = Path(path) / name
        digest.update(name.encode() + b"\0")
        if file.is_file():
            with file.open("rb") as f:
                digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def already_loaded(name: str) -> str:
    return (f"LoRA adapter {name!r} is already loaded: unload it first, or load it with "
            "load_inplace to replace it")  # fmt: skip


def name_refusal(name: str, base_model: str) -> str | None:
    """Why an adapter may not be loaded under `name` beside `base_model`, or None."""
    if not name:
        return "an adapter needs a name (lora_name)"
    if name == base_model:
        return (f"LoRA adapter name {name!r} is the base model's: requests by that name "
                "run the base model; load the adapter under another name")  # fmt: skip
    return None
