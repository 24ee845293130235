import os

import pytest

# Models are local files only: never reach for a hub, whoever runs pytest.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Without a GPU the Triton kernels run in Triton's interpreter, held to their torch
# twins; it must be chosen before any kernel is defined.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

from tests.checkpoints import load_reference
from tools.make_model import write_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The embedded default checkpoint, written once for every stack test."""
    return write_model(tmp_path_factory.mktemp("model") / "flagstop-tiny", "tiny")


@pytest.fixture(scope="session")
def reference(model_dir):
    """transformers on the same weights: the oracle of greedy tokens."""
    return load_reference(model_dir)
