"""How a benchmark leaves its results: a Markdown table under a heading that names the
command, the date and the machine's cores (bench/report.py gathers them into
RESULTS.md), and the rows as JSON beside it."""

import json
import os
import sys
from datetime import date
from pathlib import Path


def write_result(out: str | Path, title: str, setup: str, table: str, data: dict) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data))
    command = f"python {Path(sys.argv[0]).as_posix()} {' '.join(sys.argv[1:])}".strip()
    out.write_text(
        f"# {title}\n\n`{command}` on {date.today()}, {os.cpu_count()} CPU cores: "
        f"{setup}\n\n{table}\n"
    )
