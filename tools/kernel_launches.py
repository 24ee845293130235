"""The Triton launches a test run makes, recorded under TRITON_INTERPRET=1: for each
distinct one, the kernel, its arguments' types (a tensor's element type, a scalar's)
and its constexprs and launch options. tools/compile_sm90.py compiles each for the
H200. The test session records them when FLAGSTOP_KERNEL_LAUNCHES names a file
(tests/conftest.py; `make test` does)."""

import inspect
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# The modules of Triton kernels, and their kernels (the @triton.jit functions that are
# launched with a grid, not the device functions they call).
KERNEL_MODULES = ("triton_attention", "triton_lora", "triton_mla", "triton_moe", "triton_quant")
TRITON_TYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.int8: "i8",
    torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
    torch.bool: "i1",
}  # fmt: skip
LAUNCH_OPTIONS = ("num_warps", "num_stages")


@dataclass(frozen=True, slots=True)
class Launch:
    module: str
    kernel: str
    signature: tuple[tuple[str, str], ...]  # (argument, type or "constexpr"), in order
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, int], ...]

    @classmethod
    def from_json(cls, d: dict) -> "Launch":
        return cls(d["module"], d["kernel"], *(tuple(map(tuple, d[k])) for k in (
            "signature", "constexprs", "options")))  # fmt: skip


def scalar_type(value) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"an argument of type {type(value).__name__}")


def launch_of(module: str, kernel, args: tuple, kwargs: dict) -> Launch:
    params = inspect.signature(kernel.fn).parameters
    names = list(params)
    values = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constexprs = [], []
    for name in names:
        value = values[name]
        # A None pointer is specialised away, as a constexpr is.
        if value is None or "constexpr" in str(params[name].annotation):
            signature.append((name, "constexpr"))
            constexprs.append((name, value))
        elif isinstance(value, torch.Tensor):
            signature.append((name, "*" + TRITON_TYPES[value.dtype]))
        else:
            signature.append((name, scalar_type(value)))
    options = tuple((k, int(kwargs[k])) for k in LAUNCH_OPTIONS if k in kwargs)
    return Launch(module, kernel.fn.__name__, tuple(signature), tuple(constexprs), options)


class Recorder:
    """Wraps every interpreted kernel's run to note its launch; save() writes them."""

    def __init__(self) -> None:
        self.launches: set[Launch] = set()

    def install(self) -> None:
        for name in KERNEL_MODULES:
            for kernel in launched_kernels(name):
                kernel.run = self._recording(name, kernel, kernel.run)

    def _recording(self, module: str, kernel, run):
        def recorded(*args, grid, warmup, **kwargs):
            self.launches.add(launch_of(module, kernel, args, kwargs))
            return run(*args, grid=grid, warmup=warmup, **kwargs)

        return recorded

    def save(self, path: str | Path) -> None:
        ordered = sorted(self.launches, key=lambda launch: json.dumps(asdict(launch)))
        Path(path).write_text(json.dumps([asdict(launch) for launch in ordered], indent=1))


def launched_kernels(module_name: str) -> list:
    """A kernel module's interpreted kernels (their names end with _kernel), not the
    device functions they call."""
    import importlib

    module = importlib.import_module(f"flagstop.kernels.{module_name}")
    return [k for k in vars(module).values() if type(k).__name__ == "InterpretedFunction"
            and k.fn.__name__.endswith("_kernel")]  # fmt: skip


def load(path: str | Path) -> list[Launch]:
    return [Launch.from_json(d) for d in json.loads(Path(path).read_text())]
