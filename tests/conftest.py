import os

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
