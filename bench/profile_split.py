"""Where a process's CPU goes, by part of the work: py-spy samples (every thread,
at 250 Hz) sorted by the innermost frame that names a part, scaled by the process's
own CPU per token (bench/overhead_bench.py --profile).

A sample in grpc's, pygrpc-native's, uvloop's or the HTTP server's code, or in the
loop's C code under Runner.run (grpc's poller thread included), is the transport's
own share: what bench/grpc_floor.py measures alone. py-spy cannot unwind native frames here, so C
work a Python frame calls (protobuf, tokenizers) counts to that frame's part."""

import collections
import shutil
import subprocess
import sys
from pathlib import Path

TRANSPORT = "transport (gRPC or HTTP server, event loop)"

# (part, substrings of a py-spy frame "function (file:line)"), first match wins,
# searched from the innermost frame out.
ROUTER_PARTS = [
    ("detokenizer", ["router/detokenizer.py:"]),
    ("stop strings", ["StopStringMatcher"]),
    ("telemetry", ["router/telemetry.py", "opentelemetry/", "prometheus_client/",
                   "flagstop/telemetry.py"]),
    ("chunk (text, ids, logprobs, usage)", ["router/pending.py", "router/openai/bodies.py",
                                            "router/openai/sse.py"]),
    ("fan-out", ["RouterEngine.fan_out", "RouterEngine._prefill_facts",
                 "RouterEngine._logprobs"]),
    ("scheduler stream (receive, decode)", ["router/replica.py", "Replica."]),
    ("per-stream wake-up and loop", ["router/engine.py", "router/service.py",
                                     "router/openai/"]),
    ("requests (admission, validation, release)", ["router/", "flagstop/"]),
]  # fmt: skip
SCHEDULER_PARTS = [
    ("core (schedule, update)", ["scheduler_svc/core/"]),
    ("telemetry", ["scheduler_svc/telemetry.py", "opentelemetry/", "prometheus_client/",
                   "flagstop/telemetry.py"]),
    ("plan and result conversion", ["scheduler_svc/convert.py"]),
    ("executor stream", ["scheduler_svc/executor_link.py"]),
    ("router streams", ["scheduler_svc/service.py", "scheduler_svc/router_links.py",
                        "scheduler_svc/intake.py"]),
    ("other", ["flagstop/", "scheduler_svc/"]),
]  # fmt: skip
# Every stack's outer frames (the entry point, the loop's run): they name no part.
ROOT_FRAMES = ("__main__.py", "flagstop/server.py", "<frozen runpy>", "threading.py")
# The transport's own code: a sample in it (a write, a read, serializing a message)
# is the transport's, whoever called it.
TRANSPORT_FRAMES = ("grpc/", "pygrpc_native/", "uvloop/", "uvicorn/", "h11/", "httptools/")


def py_spy() -> str | None:
    found = Path(sys.executable).with_name("py-spy")
    return str(found) if found.exists() else shutil.which("py-spy")


def record(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    """py-spy on every thread of pid for seconds, raw (collapsed) stacks to out."""
    command = [py_spy(), "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))),
               "--rate", "250", "--format", "raw", "--nonblocking", "--threads",
               "--output", str(out)]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def part_of(frames: list[str], parts) -> str:
    for frame in reversed(frames):
        if any(root in frame for root in ROOT_FRAMES):
            continue
        if any(transport in frame for transport in TRANSPORT_FRAMES):
            return TRANSPORT
        for part, needles in parts:
            if any(needle in frame for needle in needles):
                return part
    return TRANSPORT


def split(raw: Path, parts) -> dict[str, float]:
    """Each part's share of the samples (sums to 1; empty without samples)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            counts[part_of(stack.split(";"), parts)] += int(count)
    total = sum(counts.values())
    return {part: n / total for part, n in counts.most_common()} if total else {}


def table(rows: list[dict]) -> str:
    """rows: {variant, streams, process, us_per_token, split}; µs per token per part."""
    lines = ["| variant | streams | process | part | share | CPU µs / token |",
             "|---|---:|---|---|---:|---:|"]  # fmt: skip
    for r in rows:
        for part, share in r["split"].items():
            lines.append(f"| {r['variant']} | {r['streams']} | {r['process']} | {part} | "
                         f"{share:.0%} | {share * r['us_per_token']:.1f} |")  # fmt: skip
    return "\n".join(lines)
