import os
import subprocess

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

from tests.helpers.checkpoints import load_reference
from tools.make_model import write_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The embedded default checkpoint, written once for every stack test."""
    return write_model(tmp_path_factory.mktemp("model") / "flagstop-tiny", "tiny")


@pytest.fixture(scope="session")
def reference(model_dir):
    """transformers on the same weights: the oracle of greedy tokens."""
    return load_reference(model_dir)


_EXECUTE_CHILD = subprocess.Popen._execute_child


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The `processes` marker is what `make test-fast` leaves out (-m "not
    processes"): a test without it that starts a process (its fixtures included)
    fails, saying so, so that the in-process set stays in-process."""
    if item.get_closest_marker("processes") is not None:
        return (yield)

    def refuse(self, args, *rest, **kwargs):
        raise AssertionError(
            f"{item.nodeid} starts a process ({args!r}): mark it @pytest.mark.processes"
        )

    subprocess.Popen._execute_child = refuse
    try:
        return (yield)
    finally:
        subprocess.Popen._execute_child = _EXECUTE_CHILD


# The Triton launches the kernel tests make, for tools/compile_sm90.py (`make test`
# compiles each for the H200 after the run). Interpreted launches only: on a GPU the
# kernels compile for real as they run.
_LAUNCHES = os.environ.get("FLAGSTOP_KERNEL_LAUNCHES")
_RECORDER = None


def pytest_sessionstart(session):
    global _RECORDER
    if _LAUNCHES and os.environ.get("TRITON_INTERPRET") == "1":
        from tools.kernel_launches import Recorder

        _RECORDER = Recorder()
        _RECORDER.install()


def pytest_sessionfinish(session, exitstatus):
    if _RECORDER is not None:
        _RECORDER.save(_LAUNCHES)
