"""How soon a router stops placing requests on a replica whose executor died: from the
executor's kill -9 to the router's readiness turning NOT_SERVING (one replica: the
moment its requests would go to another), with the engine idle and busy.

    python bench/failover_bench.py [--trials 5] [--out bench/results/failover.md]

Idle, the scheduler notices at its next heartbeat (every 0.5 s); busy, at the step
that breaks on the dead stream. The router hears it in the next message."""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.streams import Streams
from tools.make_model import write_model
from tools.stack import start_stack


def notice_ms(stack, busy: bool) -> float:
    streams = Streams(stack, [([0, 5, 6, 7], 2000)] * 4) if busy else None
    if streams is not None:
        streams.wait_for_tokens(5)
    killed = time.perf_counter()
    stack.kill("executor")
    while stack.router_ready():
        time.sleep(0.002)
    elapsed = (time.perf_counter() - killed) * 1000
    stack.restart("executor")
    while not stack.router_ready():
        time.sleep(0.05)
    if streams is not None:
        streams.results()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "failover.md"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "flagstop-tiny", "tiny")
        stack = start_stack(model, Path(tmp) / "logs", executor_args=["--num-blocks", "512"])
        try:
            rows = []
            for busy in (False, True):
                times = [notice_ms(stack, busy) for _ in range(args.trials)]
                rows.append((("busy (4 streams decoding)" if busy else "idle"), times))
        finally:
            stack.stop(10)
    lines = ["| engine | median ms | min | max |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {statistics.median(t):.0f} | {min(t):.0f} | {max(t):.0f} |"
              for name, t in rows]  # fmt: skip
    table = "\n".join(lines)
    print(table)
    Path(args.out).write_text(
        f"# Executor death to the router placing elsewhere\n\n`python bench/failover_bench.py "
        f"--trials {args.trials}`: kill -9 of the executor to the router's readiness "
        f"NOT_SERVING, {args.trials} trials each.\n\n{table}\n"
    )


if __name__ == "__main__":
    main()
