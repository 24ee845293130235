"""Every Triton launch the test suite made, compiled for the H200 (sm_90a) by Triton's
own compiler and the ptxas it bundles, without a GPU; with the bf16 (and FP8 KV
cache) variants the executor launches on a GPU, which the interpreter cannot run.

    python -m tools.compile_sm90 LAUNCHES.json [--out bench/results/kernels_sm90.md]

LAUNCHES.json: what a test run recorded (tools/kernel_launches.py; `make test` records
and then runs this). Fails on any kernel that does not compile or needs more shared
memory than a block may have on an H200 (it could not launch); lists those that spill
registers (they launch, slower); prints per kernel its configurations, shared memory
and registers (ptxas' own report).

What this proves and what it does not: docs/kernels.md."""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

# A block's shared memory on an H200 (sm_90), opted in: 227 KB.
MAX_SHARED_BYTES = 227 * 1024
# The arguments that take the model's dtype (bf16 on a GPU: the tests run float32) and
# those that take the KV cache's (bf16, or FP8 with --kv-cache-dtype fp8), per kernel.
ROLES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "_store_kv_kernel": (("key", "value"), ("k_cache", "v_cache")),
    "_decode_partition_kernel": (("query",), ("k_cache", "v_cache")),
    "_decode_merge_kernel": (("out",), ()),
    "_prefill_kernel": (("query", "out"), ("k_cache", "v_cache")),
    "_sgmv_kernel": (("inp", "w", "out"), ()),
    "_mla_decode_kernel": (("q_latent", "q_pe"), ("cache",)),
    "_mla_prefill_kernel": (("query", "key", "value", "out"), ()),
    "_grouped_gemm_kernel": (("a", "b", "c"), ()),
    "_w8_gemm_kernel": (("a", "c"), ()),
    "_int4_gemm_kernel": (("a", "c"), ()),
}


@dataclass(frozen=True, slots=True)
class Compiled:
    launch: object
    variant: str
    error: str = ""
    shared: int = 0
    registers: int = 0
    spills: int = 0  # bytes stored and loaded
    seconds: float = 0.0


def variants(launch) -> list[tuple[str, object]]:
    """The launch as the tests made it, and as a GPU executor makes it: bf16 (float32
    arguments of the model's dtype in bf16, non-IEEE dots), and with an FP8 KV cache."""
    from tools.kernel_launches import Launch

    if launch.kernel not in ROLES:
        raise SystemExit(f"{launch.kernel}: a new kernel; say in ROLES which of its "
                         "arguments take the model's dtype and the KV cache's")  # fmt: skip
    act, kv = ROLES[launch.kernel]
    out = [("as tested", launch)]

    def retyped(names, to: str) -> Launch:
        signature = tuple((n, to if n in names and t == "*fp32" else t)
                          for n, t in launch.signature)  # fmt: skip
        constexprs = tuple((n, False if n == "IEEE" else v) for n, v in launch.constexprs)
        return replace(launch, signature=signature, constexprs=constexprs)

    bf16 = retyped(set(act) | set(kv), "*bf16")
    out.append(("bf16", bf16))
    if kv:
        fp8 = retyped(set(kv), "*fp8e4nv")
        fp8 = replace(fp8, signature=tuple((n, "*bf16" if n in act and t == "*fp32" else t)
                                           for n, t in fp8.signature))  # fmt: skip
        out.append(("bf16, fp8 KV", fp8))
    return out


def compile_one(item: tuple[str, object]) -> Compiled:
    variant, launch = item
    os.environ.pop("TRITON_INTERPRET", None)
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    started = time.perf_counter()
    try:
        fn = getattr(importlib.import_module(f"flagstop.kernels.{launch.module}"), launch.kernel)
        source = ASTSource(fn, dict(launch.signature), constexprs=dict(launch.constexprs))
        options = dict(launch.options)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        registers, spills = ptxas_report(kernel.asm["ptx"])
    except Exception as e:  # any failure is the report's, kernel by kernel
        return Compiled(launch, variant, error=f"{type(e).__name__}: {e}".splitlines()[0])
    return Compiled(launch, variant, "", kernel.metadata.shared, registers, spills,
                    time.perf_counter() - started)  # fmt: skip


def ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers a thread, spilled bytes) as the bundled ptxas reports them."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        ptxas = get_ptxas(90).path
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(source), "-o", f"{tmp}/k.cubin"],
                              capture_output=True, text=True, check=True)  # fmt: skip
    report = done.stderr + done.stdout
    registers = max((int(n) for n in re.findall(r"Used (\d+) registers", report)), default=0)
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    return registers, spills


def report(results: list[Compiled]) -> tuple[str, list[str], list[str]]:
    """The markdown table per kernel and variant, the failures (a kernel that does not
    compile, or needs more shared memory than a block has: it could not launch) and
    the warnings (register spills: it launches, slower)."""
    by_kernel: dict[tuple[str, str], list[Compiled]] = defaultdict(list)
    for r in results:
        by_kernel[r.launch.kernel, r.variant].append(r)
    lines = ["| kernel | variant | configs | shared memory (max bytes) | registers (max) "
             "| spills | compile s (mean) |", "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    problems, warnings = [], []
    for (kernel, variant), rs in sorted(by_kernel.items()):
        ok = [r for r in rs if not r.error]
        problems += [f"{kernel} ({variant}) {dict(r.launch.constexprs)}: {r.error}"
                     for r in rs if r.error]  # fmt: skip
        shared = max((r.shared for r in ok), default=0)
        spills = sum(r.spills for r in ok)
        if shared > MAX_SHARED_BYTES:
            problems.append(f"{kernel} ({variant}): {shared} bytes of shared memory, above "
                            f"H200's {MAX_SHARED_BYTES} a block")  # fmt: skip
        warnings += [f"{kernel} ({variant}) {dict(r.launch.constexprs)} "
                     f"{dict(r.launch.options) or ''}: {r.spills} bytes of register spills "
                     f"({r.registers} registers)" for r in ok if r.spills]  # fmt: skip
        seconds = sum(r.seconds for r in ok) / max(len(ok), 1)
        lines.append(
            f"| {kernel} | {variant} | {len(rs)} | {shared} | "
            f"{max((r.registers for r in ok), default=0)} | {spills} | {seconds:.2f} |"
        )
    return "\n".join(lines), problems, warnings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("launches", type=Path)
    parser.add_argument("--out", type=Path, help="write the report (markdown) here too")
    args = parser.parse_args()
    from tools.kernel_launches import load

    items = {(v, launch) for recorded in load(args.launches) for v, launch in variants(recorded)}
    items = sorted(items, key=lambda item: (item[1].kernel, item[0], str(item[1])))
    started = time.perf_counter()
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        results = list(pool.map(compile_one, items))
    table, problems, warnings = report(results)
    kernels = len({r.launch.kernel for r in results})
    summary = (
        f"{len(results)} launches of {kernels} kernels compiled for sm_90a in "
        f"{time.perf_counter() - started:.0f} s ({os.cpu_count()} processes)"
    )
    print(f"{summary}\n\n{table}")
    for warning in warnings:
        print("spills:", warning)
    for problem in problems:
        print("FAILED:", problem)
    if args.out is not None:
        import triton

        args.out.write_text(f"# Triton kernels compiled for the H200 (sm_90a)\n\n"
                            f"`python -m tools.compile_sm90` (Triton {triton.__version__}, "
                            f"its bundled ptxas), from the launches of a test run: {summary}."
                            f"\n\n{table}\n\nRegister spills (it launches, slower):\n\n"
                            + "".join(f"- {w}\n" for w in warnings))  # fmt: skip
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
